"""What a chunked map does when a chunk is lost: the rules of :class:`~memchunk_prefect.core.machine.MapMachine`
for a ``MemoryError``, a worker's death, a chunk that found no room where it began, a broken GPU context and a
lost scheduler. Functions of the machine (``m``), in its handlers' table; pure, as the machine is.

What happens when a worker dies mid-map (:class:`WorkerDied`), in order:

1. its chunk's completion marker exists (``written``): the worker died after
   writing it. The chunk is kept, its task run marked Crashed, the measurement
   recovered from the marker. Nothing is recomputed.
2. it had not begun on that worker (``started`` is False: Dask had queued it there, and fails every task
   assigned to a worker that dies): its death says nothing about its memory. The same chunk goes to the
   front of the queue, nothing is recorded, and its attempts are not counted.
3. else what was read about the death decides (``WorkerDied.evidence``: the
   nanny's memory kill, the kernel's OOM count in the job's cgroup, the batch
   job's end state; the rule is :func:`memchunk_prefect.core.deaths.death_cause`);
   where it says nothing, the model's upper bound for the chunk *not ready* or
   above ``memory_kill_fraction`` (0.5) of the kill headroom, or a second death
   of the chunk, is taken as a **memory kill**. A censored observation (needs more than the
   kill headroom) is recorded and the chunk is split in two; the halves go to
   the front of the queue (``retry-smaller``). A chunk that cannot be split
   fails the map with :class:`~memchunk_prefect.core.errors.ChunkOutOfMemoryError`.
4. else a **lost worker** (walltime, preemption, a node lost, a SIGKILL): nothing
   is learned about memory, and the same chunk goes to the front of the queue once more.

A chunk that finds, where it begins, its worker already holding so much that its bound would pass the worker's
kill line (:class:`ChunkDeferred`: another map's first use, or memory another map's runs left there, after it
was planned and submitted) starts nothing: it goes back to the front of the queue, the worker's standing is
raised to what the chunk found, and the queue is re-planned for the lower budget before anything more is
submitted. Nothing is learned about its memory, and no worker dies. A chunk that finds no room
:data:`DEFERRALS` times (the re-plan kept it: split pieces were queued, which are never re-planned) is split.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from memchunk_prefect.core.deaths import worker_death
from memchunk_prefect.core.errors import (
    ChunkOutOfMemoryError,
    ClusterLostError,
    GpuContextError,
    MemoryNotChunkSizeError,
    format_bytes,
)
from memchunk_prefect.core.messages import (
    DEFERRED,
    KILLED,
    LOST,
    MEMORY_ERROR,
    ChunkDeferred,
    ChunkOutOfMemory,
    ClusterLost,
    GpuContextLost,
    Instruction,
    MarkRuns,
    Record,
    RecoverMarkers,
    RestartWorker,
    WorkerDied,
)
from memchunk_prefect.core.plan_queue import Pending
from memchunk_prefect.core.plans import RECHUNK, RETRY_SMALLER
from memchunk_prefect.core.policy import split_chunk
from memchunk_prefect.core.sharing import go_alone

DEFERRALS = 2
"""Times a chunk may find no room where it begins before it is split (its halves start over); an unsplittable
one found no room this many times runs without the check (the nanny then decides, as for any chunk)."""

#: The map's machine (:class:`memchunk_prefect.core.machine.MapMachine`, which imports this module for its
#: handlers' table: named here without importing it back).
MapMachine = Any


def out_of_memory(m: MapMachine, ev: ChunkOutOfMemory) -> list[Instruction]:
    item = m._get(ev.id)
    # A worker that could not send its record: all the flow knows is that it needed more than the budget.
    obs = ev.observation or m._flow_observation(item, "memory_error", m.budget_bytes, ev.at)
    if ev.gpu and not obs.gpu_out_of_memory:
        obs = replace(obs, gpu_out_of_memory=True)
    m._check_replan = True
    out: list[Instruction] = [Record(obs), m._ended(ev.id, item, MEMORY_ERROR, obs, ev.at)]
    if ev.gpu:
        # Learned (the GPU model of the key, model.gpu_view) and split like the host's, but never judged "not
        # the chunk's size": the device is shared (other processes, the pool's fragmentation), so a GPU chunk
        # is split until it fits or cannot be split.
        needed = obs.gpu_peak_bytes or m.gpu_budget_bytes or 0  # unmeasured: more than the GPU budget
        return out + retry_smaller(m, ev.id, item, needed, "GPU out of memory", ev.at)
    upper = m._upper_for(item.chunk)
    if (item.attempt >= m.settings.memory_error_splits and upper is not None
            and upper <= m.settings.memory_kill_fraction * m.budget_bytes):
        return out + m._fail(MemoryNotChunkSizeError(
            f"{m.spec.name(item.chunk)} raised MemoryError after {item.attempt} splits, at {item.chunk.shape} "
            f"(the model puts it at {format_bytes(upper)} at most, of a {format_bytes(m.budget_bytes)} "
            "budget per task): what fails is not the chunk's size, so it is not split further. Look for a "
            "limit on the workers' address space (ulimit -v, a container limit) or thread pools reserving "
            "memory (BLAS / OpenMP: set OMP_NUM_THREADS=1 on the workers), then rerun: the chunks written "
            "are kept", operator=m.spec.operator_key, chunk=item.chunk, budget_bytes=m.budget_bytes,
            needed_bytes=obs.peak_bytes))
    out += retry_smaller(m, ev.id, item, obs.peak_bytes, "MemoryError", ev.at)
    return out


def worker_died(m: MapMachine, ev: WorkerDied) -> list[Instruction]:
    item = m._get(ev.id)
    name = m.spec.name(item.chunk)
    m.deaths += 1
    m._check_replan = True
    if ev.written:
        # It died after writing the chunk and its marker (before returning): keep it, do not redo it.
        del m.in_flight[ev.id]
        m.done.append(item.chunk)
        return [MarkRuns(((ev.id, "Crashed", f"worker died after {name} was written; the chunk is kept"),)),
                RecoverMarkers((item.chunk,)),
                m._ended(ev.id, item, LOST, None, ev.at, kept=True)]
    if ev.started is False:
        del m.in_flight[ev.id]
        m.queue.push_front([Pending(item.chunk, item.decision, item.attempt, item.armed)])
        message = (f"worker {ev.worker or '?'} died ({ev.error}) before {name}, queued there, began: "
                   "resubmitting the same chunk")
        return [MarkRuns(((ev.id, "Crashed", message),)), m._ended(ev.id, item, LOST, None, ev.at)]
    headroom = ev.kill_headroom_bytes or m.budget_bytes
    if ev.kill_headroom_bytes and ev.id in m.submitted_alone:
        headroom *= m.sharing.threads  # a thread's share was read; alone the chunk had its whole worker
    memory_kill, why = worker_death(ev.evidence, m._upper_for(item.chunk), headroom, item.attempt, m.settings)
    message = (f"worker running {name} died ({ev.error}); {why}: "
               + ("the chunk is split and resubmitted" if memory_kill else "resubmitting the same chunk"))
    out: list[Instruction] = [MarkRuns(((ev.id, "Crashed", message),))]
    if memory_kill:
        obs = replace(m._flow_observation(item, KILLED, headroom, ev.at), worker=ev.worker)
        out += [Record(obs), m._ended(ev.id, item, KILLED, obs, ev.at)]
        out += retry_smaller(m, ev.id, item, headroom, f"worker killed: {why}", ev.at)
        return out
    # Lost for another reason: learn nothing about memory; run the same chunk once more, first.
    del m.in_flight[ev.id]
    obs = m._flow_observation(item, "error", 0, ev.at)
    m.queue.push_front([Pending(item.chunk, item.decision, item.attempt + 1, item.armed)])
    return out + [Record(obs), m._ended(ev.id, item, LOST, obs, ev.at)]


def gpu_context_lost(m: MapMachine, ev: GpuContextLost) -> list[Instruction]:
    """Restart the worker and run the chunk once more; a chunk that breaks a context twice, or a map whose
    restarts reach ``settings.gpu_context_restarts``, fails with the error (never retried without end)."""
    item = m._get(ev.id)  # stays in flight when failing: Stop settles its task run
    name = m.spec.name(item.chunk)
    if ev.worker in m.restarted_workers:
        # It ran on a worker whose context another chunk had broken (queued there before the restart): not
        # its doing; run it again elsewhere, restarting nothing more and counting nothing.
        del m.in_flight[ev.id]
        obs = m._flow_observation(item, "error", 0, ev.at)
        m.queue.push_front([replace(item, attempt=item.attempt + 1)])
        return [Record(obs), m._ended(ev.id, item, LOST, obs, ev.at)]
    if item.restarted >= 1 or m.gpu_restarts >= m.settings.gpu_context_restarts:
        why = ("it did so again after a restart" if item.restarted
               else f"this map has restarted {m.gpu_restarts} worker(s) already "
                    f"(gpu_context_restarts={m.settings.gpu_context_restarts})")
        err = GpuContextError(
            f"{ev.error}; not retried: {why}. The operator or its input makes the GPU fault (run it with "
            "device='cpu' to see its own error), or the GPU is failing (nvidia-smi -q: ECC errors; Xid lines "
            "in the system log). The chunks written are kept: a rerun resumes", ev.worker)
        err.__cause__ = ev.error
        return m._fail(err)
    del m.in_flight[ev.id]
    m.gpu_restarts += 1
    m.restarted_workers.add(ev.worker)
    obs = m._flow_observation(item, "error", 0, ev.at)
    m.queue.push_front([replace(item, attempt=item.attempt + 1, restarted=item.restarted + 1)])
    return [Record(obs), m._ended(ev.id, item, LOST, obs, ev.at),
            RestartWorker(ev.worker, f"{name} left its GPU context unusable ({ev.error}); the chunk runs once "
                                     "more")]


def cluster_lost(m: MapMachine, ev: ClusterLost) -> list[Instruction]:
    item = m._get(ev.id)  # stays in flight: Stop marks its task run
    detail = " ".join(str(ev.error).split())
    err = ClusterLostError(
        f"lost the Dask scheduler at {ev.address} while running {m.spec.operator} "
        f"({type(ev.error).__name__}: {detail}); the {ev.written_chunks} chunks written so far are kept in "
        f"{m.spec.output_path}. Start the scheduler again (or point the runner at a live one) and rerun "
        "the flow: it resumes the output and computes only the missing chunks")
    err.__cause__ = ev.error
    del item
    return m._fail(err)


def chunk_deferred(m: MapMachine, ev: ChunkDeferred) -> list[Instruction]:
    """The chunk found no room where it began (see the module docstring): back to the front of the queue, the
    worker's standing raised to what it found, and the queue re-planned before the next submission."""
    item = m._get(ev.id)
    del m.in_flight[ev.id]
    m.standing.heard(ev.worker, int(ev.above_bytes))
    m.budget_bytes = m._budget()
    m._check_replan = True
    # Its task run ended Failed on the worker, with the error that says why (ChunkDeferredError).
    out: list[Instruction] = [m._ended(ev.id, item, DEFERRED, None, ev.at)]
    again = replace(item, deferred=item.deferred + 1)
    pieces = split_chunk(item.chunk, whole_traces=m.spec.whole_traces) if again.deferred == DEFERRALS else []
    if not pieces:  # re-planned with the queue; past DEFERRALS, an unsplittable chunk runs unchecked
        m.queue.push_front([again])
        return out
    m.queue.push_front(replace(again, chunk=p, deferred=0) for p in pieces)
    return out + [m._decided(RECHUNK, None, f"{m.spec.label(item.chunk)} found no room where it began "
                             f"{DEFERRALS} times ({format_bytes(ev.process_bytes)} held on {ev.worker}, its bound "
                             f"{format_bytes(ev.upper_bytes)}, the kill line {format_bytes(ev.kill_bytes)}): split "
                             f"into {len(pieces)} pieces of {pieces[0].shape}", ev.at, chunk=item.chunk.key())]


def retry_smaller(m: MapMachine, sid: int, item: Pending, needed_bytes: int, cause: str,
                  at: float) -> list[Instruction]:
    """Split a chunk that ran out of memory; its pieces go to the front of the queue. Unsplittable: fail."""
    pieces = split_chunk(item.chunk, whole_traces=m.spec.whole_traces)
    label = m.spec.label(item.chunk)
    on_gpu = cause.startswith("GPU")
    if (not pieces and not on_gpu and m.gpu_budget_bytes is None and sid not in m.submitted_alone
            and (m.sharing.alone or m.sharing.may_go_alone(m.cap_bytes))):
        # It ran on a thread's share: alone (now, or from now on) it has its whole worker.
        if not m.sharing.alone:
            go_alone(m, f"{label} cannot be split further and needed more than {format_bytes(needed_bytes)}")
        del m.in_flight[sid]
        m.queue.push_front([Pending(item.chunk, RETRY_SMALLER, item.attempt + 1, item.armed)])
        return [m._decided(RETRY_SMALLER, None, m._alone_words() + f"{label} ran out of memory ({cause}) "
                              "on a thread's share and cannot be split further: it runs again alone on its worker",
                              at, chunk=item.chunk.key())]
    if not pieces:
        return m._fail(ChunkOutOfMemoryError(
            f"{m.spec.name(item.chunk)} ran out of memory ({cause}) and cannot be split further "
            f"(shape {item.chunk.shape}{', whole traces' if m.spec.whole_traces else ''}): it needed more "
            + (f"than {format_bytes(needed_bytes)} of GPU memory. Run one worker per GPU (and one thread per "
               "worker), use a GPU with more memory, or run this operator with device='cpu'"
               if on_gpu else
               f"than {format_bytes(needed_bytes)} with a budget of {format_bytes(m.budget_bytes)} per task. "
               "Give workers more memory (memory_limit), fewer threads per worker, or a smaller operator "
               "parameter"),
            operator=m.spec.operator_key, chunk=item.chunk,
            budget_bytes=m.gpu_budget_bytes if on_gpu else m.budget_bytes, needed_bytes=needed_bytes,
            device="gpu" if on_gpu else "host"))
    del m.in_flight[sid]
    m.queue.push_front(Pending(p, RETRY_SMALLER, item.attempt + 1, item.armed) for p in pieces)
    return [m._decided(RETRY_SMALLER, None,
                          f"{label} ran out of memory ({cause}, needed more than {format_bytes(needed_bytes)}): "
                          f"split into {len(pieces)} pieces of {pieces[0].shape}", at, chunk=item.chunk.key())]
