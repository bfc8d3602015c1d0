"""What a chunked map's state machine hears and says: the events it handles and the instructions it returns.

Events (:data:`Event`) are what the world tells the machine: the map starts, a chunk finished, ran out of
memory, failed, its worker died, the cluster was lost, the user stopped the flow... Instructions
(:data:`Instruction`) are what it asks the world to do: submit a chunk, record an observation, tell
observers of a decision, mark task runs, cancel, finalize. Both are plain frozen data, so the same
events give the same instructions in a real run (:mod:`memchunk_prefect.run.executor`) and in a simulated
one (:mod:`memchunk_prefect.sim`). Units: bytes, elements, seconds since the epoch (``at``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping, Union

from memchunk_prefect.core.chunks import Chunk, Shape, with_halo
from memchunk_prefect.core.deaths import DeathEvidence
from memchunk_prefect.core.records import Observation, Pause, Reward
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings

#: Extra decisions recorded about the output (not about the chunking).
RESUME = "resume"


RESTART = "restart"


#: How a chunk's task run ended, as the report and ``ChunkedResult.events`` call it.
OK, MEMORY_ERROR, KILLED, LOST, DEFERRED = "ok", "memory_error", "killed", "lost", "deferred"


@dataclass(frozen=True)
class Start:
    """The map begins on a cluster of ``slots`` worker slots with ``budget_bytes`` per task.

    ``budget_bytes``: what one task may use above its worker's resting memory as
    read at the start (the kill line less that, per thread, or a user's cap below it);
    ``headroom_bytes``: the kill line less the resting memory, per thread, on the
    tightest worker (None: no line, or not known); ``drift_bytes``: how far above
    that resting memory the workers are expected to sit when tasks start (from
    this operator's recent runs: what they started above it, or what a first use
    left held, whichever is more). Plans fit ``min(budget_bytes, headroom_bytes -
    drift)``, the drift followed as runs report where their workers stood.
    ``completed``: chunks a resumed output already holds (its completion markers);
    ``restarted``: why an existing output at the path is being replaced, if it is.
    ``gpu_budget_bytes``: on a GPU, what one task may use of the device's memory above
    the worker's resting GPU memory; every plan fits it as well (the GPU model of the
    key, :meth:`Knowledge.predict_gpu`). None on the CPU.
    ``touched_bytes``: each worker's high-water mark less its resting memory, per thread, by address (what a
    task may use there without the kernel faulting in memory the process never held: plans count what
    growing past it costs, :class:`memchunk_prefect.core.estimates.FirstTouch`); None: not read, nothing counted.
    ``threads_per_worker`` and ``worker_budget_bytes``: each worker's threads, and what one task may use alone on
    the tightest worker (None: not known); a map whose chunks need more than a thread's share runs one task per
    worker (:mod:`memchunk_prefect.core.sharing`). ``threads_per_core``: how many worker threads share each CPU
    core (:func:`memchunk_prefect.core.budget.threads_per_core`; 1.0: a core each, or not known).
    """

    slots: int
    budget_bytes: int
    completed: tuple[Chunk, ...] = ()
    restarted: str | None = None
    at: float = 0.0
    headroom_bytes: int | None = None
    drift_bytes: int = 0
    gpu_budget_bytes: int | None = None
    touched_bytes: Mapping[str, int] | None = None
    threads_per_worker: int = 1
    worker_budget_bytes: int | None = None
    threads_per_core: float = 1.0


@dataclass(frozen=True)
class ChunkDone:
    """Submission ``id`` returned: its chunk is written, ``observation`` is what it measured."""

    id: int
    observation: Observation
    at: float = 0.0


@dataclass(frozen=True)
class ChunkOutOfMemory:
    """Submission ``id`` raised ``MemoryError``; ``observation`` is the worker's censored record, if it sent one."""

    id: int
    observation: Observation | None = None
    at: float = 0.0
    gpu: bool = False  # the GPU's memory ran out, not the host's


@dataclass(frozen=True)
class ChunkFailed:
    """Submission ``id`` raised something other than ``MemoryError``: the operator's own error."""

    id: int
    error: BaseException
    at: float = 0.0


@dataclass(frozen=True)
class GpuContextLost:
    """Submission ``id`` hit a CUDA error that left its worker's GPU context unusable (``error``, a
    :class:`~memchunk_prefect.core.errors.GpuContextError`); ``worker``: that worker's address."""

    id: int
    worker: str
    error: BaseException
    at: float = 0.0


@dataclass(frozen=True)
class WorkerDied:
    """The worker running submission ``id`` died (``KilledWorker``).

    ``written``: the chunk's completion marker exists (it died after writing);
    ``kill_headroom_bytes``: what a task may use above its worker's resting
    memory before the nanny kills it, read at the death (None: unknown);
    ``worker``: the address of the worker that died ('' unknown); ``evidence``: what the batch system, the
    kernel or the nanny said about the death (:class:`~memchunk_prefect.core.deaths.DeathEvidence`; None: nothing
    was read, the model's guess decides); ``started``: whether the chunk had begun on that worker (False: it was
    only queued there, and Dask failed it with the worker, as it fails every task assigned to a worker that dies
    when no failure is allowed; None: not known).
    """

    id: int
    error: str
    written: bool = False
    kill_headroom_bytes: int | None = None
    at: float = 0.0
    worker: str = ""
    evidence: DeathEvidence | None = None
    started: bool | None = None


@dataclass(frozen=True)
class ChunkDeferred:
    """Submission ``id`` did not start: where it began, its worker (``worker``) already held ``process_bytes``,
    ``above_bytes`` above the resting memory the map read there, and the chunk's bound (``upper_bytes``) on top
    would have passed the worker's kill line (``kill_bytes``). Bytes. (Another map's first use, or memory its runs
    left there, after this chunk was planned.)"""

    id: int
    worker: str
    process_bytes: int
    above_bytes: int
    upper_bytes: int
    kill_bytes: int
    at: float = 0.0


@dataclass(frozen=True)
class ClusterLost:
    """The scheduler forgot submission ``id`` (killed, restarted, unreachable): no worker death to learn from."""

    id: int
    error: BaseException
    address: str = ""
    written_chunks: int = 0  # completion markers on disk, for the message
    at: float = 0.0


@dataclass(frozen=True)
class MarkersRecovered:
    """Observations read back from completion markers that the store lacked (answer to :class:`RecoverMarkers`)."""

    observations: tuple[Observation, ...]
    at: float = 0.0


@dataclass(frozen=True)
class Stop:
    """The map stops early: an interrupt or cancellation (``interrupted``), or an error (named in ``error``).

    ``finished``: (id, observation) of submissions in flight whose task had
    already returned when the executor looked: their chunks are kept.
    """

    error: str
    interrupted: bool
    finished: tuple[tuple[int, Observation], ...] = ()
    at: float = 0.0


@dataclass(frozen=True)
class PausesRead:
    """The workers' pauses the scheduler logged over the map (answer to :class:`ReadPauses`; empty when they could
    not be read)."""

    pauses: tuple[Pause, ...] = ()
    at: float = 0.0


@dataclass(frozen=True)
class SlotsChanged:
    """The cluster's worker slots changed mid-map: batch jobs joined from the queue (dask-jobqueue), an adaptive
    cluster scaled, or workers left at their walltime. The in-flight cap follows at once, and a queue planned
    for the old count is re-planned where the new count makes it faster by ``settings.replan_gain`` (the
    rule of a moved bound). The budget per task stays the one read at the start."""

    slots: int
    at: float = 0.0


@dataclass(frozen=True)
class WorkerStands:
    """Another map of the flow run had a run alone on ``worker`` that says the worker's next task starts
    ``above_bytes`` above the resting memory this map's budget read there (what its runs left held: a library
    imported, a CUDA context, Prefect's per-run memory). Where this map knew less, its budget follows
    (:meth:`memchunk_prefect.core.standing.WorkerStanding.heard`)."""

    worker: str
    above_bytes: int
    at: float = 0.0
    source: str = ""  # the map whose run it was (its ``map_id``)


@dataclass(frozen=True)
class FirstUseExpected:
    """Another map of the flow run (``source``) left ``nbytes`` held on a worker at its first chunk there (a first
    use: a library imported) and has not run on ``worker`` yet: when it does, ``worker`` holds that much more.
    Kept apart from the worker's standing until the source reports from it
    (:meth:`memchunk_prefect.core.standing.WorkerStanding.expect`). ``nbytes`` 0: the source ended without running
    there, and nothing is expected of it any more."""

    worker: str
    source: str
    nbytes: int
    at: float = 0.0


@dataclass(frozen=True)
class UpstreamWritten:
    """The upstream map this one reads (a gated map's source, still being written) wrote ``chunks``: their
    elements are final. ``complete``: it finalized its output (every element is written)."""

    chunks: tuple[Chunk, ...] = ()
    complete: bool = False
    at: float = 0.0


Event = Union[Start, ChunkDone, ChunkOutOfMemory, ChunkFailed, WorkerDied, ClusterLost, MarkersRecovered, Stop,
              PausesRead, SlotsChanged, UpstreamWritten, GpuContextLost, WorkerStands, FirstUseExpected, ChunkDeferred]


@dataclass(frozen=True)
class DecisionRecord:
    """A decision taken, with why: for the log, the report and ``ChunkedResult.decisions``.

    ``chunk_shape`` is the largest chunk of the plan (no halo);
    ``predicted_peak_bytes`` / ``upper_bound_bytes`` the model's mean and upper
    bound for it with its halo.
    """

    decision: str
    reason: str
    operator: str
    operator_key: str
    n_chunks: int | None = None
    chunk_shape: Shape | None = None
    predicted_peak_bytes: float | None = None
    upper_bound_bytes: float | None = None
    at: float = 0.0
    region: str | None = None  # Chunk.key() of the box planned
    chunk: str | None = None  # Chunk.key() of the chunk split
    arm: str | None = None  # the learned policy's arm the plan was fitted under
    warning: str | None = None  # what the user should hear about this plan (logged as a warning)



@dataclass(frozen=True)
class Decided:
    """Tell the log and the observers about a decision."""

    record: DecisionRecord


@dataclass(frozen=True)
class Submit:
    """Submit ``chunk`` as submission ``id`` (a new Prefect task run).

    ``predicted_bytes`` / ``upper_bytes``: the model's figures for the block it
    reads (``read_extents``, halo included) when submitted; None while the model
    is not ready. ``per_worker``: at most this many of the map's tasks on one worker at once (None: one per
    thread, Dask's own placement; :mod:`memchunk_prefect.core.sharing`). ``check_room``: the worker checks,
    before the chunk begins, that the chunk's bound on top of what it holds stays under its kill line
    (:mod:`memchunk_prefect.core.losses`).
    """

    id: int
    chunk: Chunk
    decision: str
    attempt: int
    label: str
    read_extents: Shape
    predicted_bytes: float | None = None
    upper_bytes: float | None = None
    at: float = 0.0
    per_worker: int | None = None
    check_room: bool = True  # the worker checks it can hold the chunk before it begins (ChunkDeferred)


@dataclass(frozen=True)
class Record:
    """Persist ``observation`` and teach the model with it, before the next :meth:`MapMachine.advance`."""

    observation: Observation


@dataclass(frozen=True)
class ChunkEnded:
    """Submission ``id`` ended (``outcome``: ok, memory_error, killed, lost); the map's progress after it."""

    id: int
    chunk: Chunk
    outcome: str
    decision: str
    observation: Observation | None = None
    kept: bool = False  # a lost worker had already written it
    done_chunks: int = 0
    done_elements: int = 0
    at: float = 0.0
    queued_chunks: int = 0  # chunks in flight or planned after this one ended (boxes not planned yet not counted)



@dataclass(frozen=True)
class MarkRuns:
    """Force these task runs into a final state unless they have one: (id, ``"Crashed"``/``"Cancelled"``, message).

    Nothing else ends a run whose worker died (prefect #12968, #21638).
    ``look_again``: a run not created yet may appear a moment later (a worker
    started it just before a cancellation reached it): look for it again.
    """

    marks: tuple[tuple[int, str, str], ...]
    look_again: bool = False


@dataclass(frozen=True)
class RestartWorker:
    """Restart the worker at ``address`` (a new process: a new CUDA context); ``reason`` in words, for the log."""

    address: str
    reason: str


@dataclass(frozen=True)
class Cancel:
    """Cancel these submissions on the cluster."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class RecoverMarkers:
    """Read the measurements in these chunks' completion markers (where written); answer :class:`MarkersRecovered`."""

    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class ReadPauses:
    """Read the workers' pauses (Dask's pause line) between ``since`` and ``until``; answer :class:`PausesRead`."""

    since: float
    until: float


@dataclass(frozen=True)
class Fail:
    """Stop the map with ``error`` (raise it); then send :class:`Stop` to settle what is in flight."""

    error: BaseException


@dataclass(frozen=True)
class Finalize:
    """Every element is written: finalize the output. ``settle_runs``: a worker died during the map."""

    settle_runs: bool


@dataclass(frozen=True)
class Stopped:
    """The early stop is settled; ``kept``: chunks collected while stopping."""

    error: str
    kept: int


@dataclass(frozen=True)
class Rewarded:
    """The map is finalized: persist ``reward`` (what its arm's plan earned) and teach the learned policy."""

    reward: Reward


Instruction = Union[Decided, Submit, Record, ChunkEnded, MarkRuns, Cancel, RecoverMarkers, Fail, Rewarded, Finalize,
                    ReadPauses, Stopped, RestartWorker]


@dataclass(frozen=True)
class MapSpec:
    """What one chunked map computes, fixed for its life: plain data."""

    operator: str  # the task's name, for messages
    operator_key: str  # the model key (name, memory parameters, dtype, device)
    shape: Shape  # the volume (iline, xline, twt)
    halo: Shape
    whole_traces: bool  # the operator needs uncut traces (no cut along twt)
    output_path: str = ""  # for messages
    incoming: tuple[Chunk, ...] | None = None  # the upstream map's chunking, if the source is one
    settings: PolicySettings = DEFAULT_SETTINGS
    gated: bool = False  # the source is an upstream map still being written: see :class:`Gate`

    def label(self, chunk: Chunk) -> str:
        return chunk.label(self.shape)

    def read_extents(self, chunk: Chunk) -> Shape:
        """The block a placed chunk reads (halo included, clipped at the volume's edges)."""
        return _read_extents(chunk, tuple(self.halo), tuple(self.shape))

    def name(self, chunk: Chunk) -> str:
        return f"{self.operator}[{self.label(chunk)}]"


@functools.lru_cache(maxsize=2**16)
def _read_extents(chunk: Chunk, halo: tuple[int, ...], shape: tuple[int, ...]) -> Shape:
    # A chunk's block is asked for when it is queued, submitted and reported: computed once (a map of 20,000
    # chunks asked 70,000 times, 1.7 s of a 2.9 s simulation).
    return with_halo(chunk, halo, shape)[0].shape
