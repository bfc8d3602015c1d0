"""What one task may use: the per-task memory budget (host and GPU) from what the workers report, and the slots.

Pure arithmetic over figures read from the cluster (:mod:`memchunk_prefect.run.cluster` reads them): each
worker's threads, memory limit, resting memory, high-water mark and the fraction of its limit at which its
nanny kills it, and, on a batch cluster or in a container, the memory its job may hold (its cgroup's limit, the
batch system's ``--mem``) less what the job's other processes hold: where that is lower than the nanny's line,
the kernel or the batch system kills the worker first, and the budget is derived from it (:func:`kill_line`).
All sizes are bytes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from memchunk_prefect.core.errors import BudgetError, BudgetTooSmallError, format_bytes
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings


@dataclass(frozen=True)
class WorkerMemory:
    """One worker as the budget sees it (bytes).

    ``resting_bytes`` is the process memory the scheduler last heard (between
    maps: what the idle worker holds); ``kill_fraction`` the fraction of
    ``memory_limit_bytes`` at which its nanny kills it (None: never).
    """

    address: str
    nthreads: int
    memory_limit_bytes: int
    resting_bytes: int
    kill_fraction: float | None
    #: The most the worker's process has held (:func:`memchunk_prefect.run.monitor.high_water_bytes`; its resting
    #: memory where no run has been measured there), bytes; None where not read.
    high_water_bytes: int | None = None
    #: The memory its job may hold (the lowest of its cgroup's limit and the batch system's request), bytes; None
    #: where there is none (or it was not read). ``job_others_bytes``: what the job's other processes (the
    #: nanny, other workers at rest, ...) hold of it; ``job_limit_source``: where the limit was read, in words;
    #: ``job_workers``: the workers that share that limit (dask-jobqueue's ``processes``, a LocalCluster in a
    #: container), among which what is free of it is shared.
    job_limit_bytes: int | None = None
    job_others_bytes: int = 0
    job_limit_source: str = ""
    job_workers: int = 1

    @property
    def line(self) -> tuple[float, str]:
        """The process memory at which the worker is killed, and by what (:func:`kill_line`, with its job's line
        from :func:`job_line_bytes`)."""
        job = None if self.job_limit_bytes is None else job_line_bytes(
            self.job_limit_bytes, self.job_others_bytes, self.resting_bytes, self.job_workers)
        return kill_line(self.memory_limit_bytes, self.kill_fraction, job)

    @property
    def touched_bytes(self) -> int | None:
        """What a task may use above the resting memory without taking its worker above the most it has held,
        per thread (bytes; None where the high-water mark was not read): memory above it is faulted in and zeroed
        by the kernel during the task, a cost a plan of larger chunks pays once per worker."""
        if self.high_water_bytes is None:
            return None
        return max(0, int(self.high_water_bytes) - self.resting_bytes) // max(1, self.nthreads)

    @property
    def kill_headroom_bytes(self) -> int | None:
        """What a task may use above the resting memory before the nanny, the kernel or the batch system kills the
        worker (None: nothing kills it)."""
        line, by = self.line
        if by not in (NANNY, JOB):
            return None
        return int(line) - self.resting_bytes

    def describe_line(self) -> str:
        """The kill line in words, for a budget's reason."""
        line, by = self.line
        nanny = (f"the kill line {format_bytes(self.kill_fraction * self.memory_limit_bytes)} ({self.kill_fraction:g} "
                 f"x memory_limit {format_bytes(self.memory_limit_bytes)})"
                 if self.kill_fraction is not None and self.memory_limit_bytes else "")
        if by == JOB:
            others = (f" less {format_bytes(self.job_others_bytes)} held by the job's other processes"
                      if self.job_others_bytes else "")
            shared = f", its free part shared by {self.job_workers} workers" if self.job_workers > 1 else ""
            return (f"the job's memory limit {format_bytes(self.job_limit_bytes)} ({self.job_limit_source}){others}"
                    + shared + (f", below {nanny}" if nanny else ""))
        if by == NANNY:
            return nanny
        return f"memory_limit {format_bytes(line)} (no nanny kills this worker)"


def job_line_bytes(limit_bytes: int, others_bytes: int, resting_bytes: int, workers: int = 1) -> float:
    """The process memory (bytes) one worker may reach before its job's limit is crossed: its resting memory plus
    its share of what is free of the limit (the limit less what the job's other processes hold, the other workers'
    resting memory among them, less its own), shared evenly by the ``workers`` that share the limit.

    | limit | others | resting | workers | line |
    |---|---|---|---|---|
    | 1000 | 100 | 200 | 1 | 900 |
    | 1000 | 300 | 200 | 2 | 450 (each worker's tasks get 250: together 500, what is free) |

    >>> job_line_bytes(1000, 100, 200), job_line_bytes(1000, 300, 200, 2)
    (900.0, 450.0)
    """
    free = float(limit_bytes) - float(others_bytes) - float(resting_bytes)
    return float(resting_bytes) + free / max(1, int(workers))


#: What a worker's kill line is (:func:`kill_line`): its nanny's line, its job's limit, its memory_limit where
#: nothing kills it, or nothing at all.
NANNY, JOB, LIMIT, NONE = "nanny", "job", "memory_limit", "none"


def kill_line(memory_limit_bytes: int, kill_fraction: float | None, job_line_bytes: float | None) -> tuple[float, str]:
    """The process memory (bytes) at which a worker is killed, and by what: the lower of its nanny's line
    (``kill_fraction`` x ``memory_limit_bytes``) and its job's line (``job_line_bytes``: the job's limit less
    what its other processes hold), else ``memory_limit_bytes`` where nothing kills it (without a nanny Dask only
    pauses a worker there), else 0 (no line at all).

    | memory_limit | kill_fraction | job line | line | by |
    |---|---|---|---|---|
    | 1000 | 0.95 | None | 950 | nanny |
    | 1000 | 0.95 | 500 | 500 | job |
    | 1000 | None | 1200 | 1200 | job (no nanny: the job is what kills) |
    | 1000 | None | None | 1000 | memory_limit |
    | 0 | None | None | 0 | none |

    >>> kill_line(1000, 0.95, None), kill_line(1000, 0.95, 500), kill_line(1000, 0.95, 960)
    ((950.0, 'nanny'), (500.0, 'job'), (950.0, 'nanny'))
    >>> kill_line(1000, None, None), kill_line(1000, None, 1200), kill_line(0, 0.95, 500), kill_line(0, None, None)
    ((1000.0, 'memory_limit'), (1200.0, 'job'), (500.0, 'job'), (0.0, 'none'))
    """
    nanny = float(kill_fraction) * memory_limit_bytes if memory_limit_bytes and kill_fraction is not None else None
    job = float(job_line_bytes) if job_line_bytes is not None else None
    if job is not None and (nanny is None or job < nanny):
        return job, JOB
    if nanny is not None:
        return nanny, NANNY
    return (float(memory_limit_bytes), LIMIT) if memory_limit_bytes else (0.0, NONE)


def workers_from_info(info: Mapping[str, Any], kill_fractions: Mapping[str, object],
                      default_fraction: float | None, resting: Mapping[str, int] | None = None,
                      high_water: Mapping[str, int] | None = None,
                      jobs: Mapping[str, tuple[int | None, int, str, int]] | None = None) -> list[WorkerMemory]:
    """The workers of a ``client.scheduler_info()`` answer, with the kill fraction each one's nanny applies.

    ``kill_fractions``: each worker's own ``distributed.worker.memory.terminate``
    by worker address (see :func:`read_kill_fractions`); a worker not in it takes
    ``default_fraction``. A worker without a nanny has no kill line (None).
    ``resting``: each worker's resting memory as read by :func:`read_resting`; the
    heartbeat's process memory for a worker not in it. ``high_water``: each worker's high-water mark as read
    by :func:`read_marks` (None for a worker not in it). ``jobs``: each worker's job memory as
    ``(limit bytes or None, bytes its other processes hold, where the limit was read, workers sharing it)``
    (:func:`memchunk_prefect.run.job_memory.read_job_memory`; no job limit for a worker not in it).

    >>> info = {"workers": {"tcp://w:1": {"nthreads": 1, "memory_limit": 1000, "metrics": {"memory": 100},
    ...                                    "nanny": "tcp://n:1"}}}
    >>> [w.kill_headroom_bytes for w in workers_from_info(info, {"tcp://w:1": 0.9}, 0.95)]
    [800]
    """
    out = []
    for address, w in (info.get("workers") or {}).items():
        if not w.get("nanny"):
            fraction = None
        elif address in kill_fractions:
            fraction = memory_fraction(kill_fractions[address])
        else:
            fraction = default_fraction
        hw = (high_water or {}).get(address)
        limit, others, source, sharing = (jobs or {}).get(address) or (None, 0, "", 1)
        out.append(WorkerMemory(
            address=str(address), nthreads=int(w.get("nthreads", 1) or 1),
            memory_limit_bytes=int(w.get("memory_limit") or 0),
            resting_bytes=int((resting or {}).get(address) or (w.get("metrics") or {}).get("memory", 0) or 0),
            kill_fraction=fraction,
            high_water_bytes=None if hw is None else int(hw),
            job_limit_bytes=None if limit is None else int(limit), job_others_bytes=int(others or 0),
            job_limit_source=str(source), job_workers=max(1, int(sharing or 1))))
    return out


def memory_fraction(value: object) -> float | None:
    """A Dask memory threshold as a fraction of ``memory_limit``; ``False`` or None (the check is off) is None."""
    return None if value is None or value is False else float(value)  # type: ignore[arg-type]


def slots(workers: list[WorkerMemory]) -> int:
    """Task slots: one per worker thread."""
    return sum(w.nthreads for w in workers)


def kill_headroom_bytes(workers: list[WorkerMemory]) -> int | None:
    """The smallest kill headroom among the workers (None when no worker has a kill line)."""
    lines = [h for h in (w.kill_headroom_bytes for w in workers) if h is not None]
    return min(lines) if lines else None


def task_budget(workers: list[WorkerMemory], target_fraction: float) -> int:
    """Memory one task may use above its worker's resting level, ``target_fraction`` of each limit (bytes)."""
    return min(task_budget_bytes(w.memory_limit_bytes, w.nthreads, target_fraction=target_fraction,
                                        resting_bytes=w.resting_bytes, kill_fraction=w.kill_fraction)
               for w in workers)


@dataclass(frozen=True)
class Budget:
    """What one task may use above its worker's resting memory, and how that was decided.

    ``budget_bytes``: the smallest over the workers; ``resting_bytes``: each
    worker's resting memory as read (by worker address), so a run's start can be
    compared with what the budget assumed; ``headroom_bytes``: each worker's kill
    line less its resting memory, per thread (what a task killed there had, so
    what it needed more than); ``touched_bytes``: each worker's high-water mark less its resting memory, per
    thread, where it was read (what a task may use there without the kernel faulting in new memory:
    :attr:`WorkerMemory.touched_bytes`); ``reason``: the derivation in words. The cluster's shape as the
    budget read it, for a simulation of the run on another cluster: ``memory_limit_bytes``,
    ``threads_per_worker`` and ``kill_fraction`` of the worker that sets the budget (None where unknown).
    ``worker_budget_bytes``: what one task may use running alone on its worker (the kill line less the resting
    memory, not shared among threads, under the same caps), on the tightest worker; None where not derived, or
    where the workers have different thread counts.
    ``threads_per_core``: the workers' threads over the CPU cores they may run on (:func:`threads_per_core`;
    1.0 where each thread has a core of its own, or where that is not known); ``cores_read``: whether the cores
    any worker may run on were read (else 1.0 is assumed, not measured).
    """

    slots: int
    budget_bytes: int
    resting_bytes: dict[str, int]
    reason: str
    headroom_bytes: dict[str, int] = field(default_factory=dict)
    touched_bytes: dict[str, int] = field(default_factory=dict)
    memory_limit_bytes: int | None = None
    threads_per_worker: int | None = None
    kill_fraction: float | None = None
    worker_budget_bytes: int | None = None
    threads_per_core: float = 1.0
    cores_read: bool = False


def threads_per_core(nthreads: Mapping[str, int], placement: Mapping[str, tuple[str, Sequence[int]]]) -> float:
    """How many worker threads share each CPU core, over the workers whose host and usable cores are known
    (``placement``: by worker address, its host name and the cores it may run on, as the worker read them:
    ``os.sched_getaffinity``); at least 1.0, and 1.0 where none is known.

    A host's threads count against the cores any of its workers may use: 2 workers x 2 threads on a machine of
    2 cores run 4 chunks at once on 2 cores, each at half speed, so 4 chunks take as long as 2 twice the size
    and pay twice the per-task cost (:func:`memchunk_prefect.core.estimates.estimate_seconds`).

    >>> threads_per_core({"a": 2, "b": 2}, {"a": ("n1", [0, 1]), "b": ("n1", [0, 1])})
    2.0
    >>> threads_per_core({"a": 2, "b": 2, "c": 4}, {"a": ("n1", [0, 1]), "b": ("n1", [2, 3]), "c": ("n2", range(8))})
    1.0
    """
    threads: dict[str, int] = {}
    cores: dict[str, set[int]] = {}
    for address, n in nthreads.items():
        if address not in placement:
            continue
        host, cpus = placement[address]
        threads[host] = threads.get(host, 0) + max(1, int(n))
        cores.setdefault(host, set()).update(int(c) for c in cpus)
    usable = sum(min(threads[h], len(cores[h])) for h in threads if cores[h])
    total = sum(threads[h] for h in threads if cores[h])
    return max(1.0, total / usable) if usable else 1.0


@dataclass(frozen=True)
class GpuBudget:
    """What one task of a map on the GPU may use of its worker's device memory, and how that was decided.

    ``budget_bytes``: the smallest over the workers; ``free_bytes``: what each worker could allocate on its
    device when read (by worker address); ``reason``: the derivation in words.
    """

    budget_bytes: int
    free_bytes: dict[str, int]
    reason: str


def gpu_budget(statuses: Mapping[str, Any], nthreads: Mapping[str, int], *,
               target_fraction: float | None = None) -> GpuBudget:
    """The GPU budget per task: ``target_fraction`` of what each worker could allocate on its device now
    (:func:`memchunk_prefect.core.budget.gpu_task_budget_bytes`), per thread; the smallest over the workers.

    ``statuses``: each worker's :class:`memchunk_prefect.operators.device.GpuStatus` (by address), read at the
    map's start (what is not free to it is its CUDA context and other processes' use; its own pool counts as free). A
    worker without a usable GPU is a :class:`BudgetError` (the map's device was resolved from the same
    statuses, so this is a GPU lost in between).

    >>> from memchunk_prefect.operators.device import GpuStatus
    >>> g = gpu_budget({"tcp://w:1": GpuStatus(True, "H100", total_bytes=80 * 2**30, free_bytes=79 * 2**30)},
    ...                {"tcp://w:1": 1})
    >>> round(g.budget_bytes / 2**30, 3)
    71.1
    >>> print(g.reason)  # doctest: +NORMALIZE_WHITESPACE
    GPU budget 71.1 GiB per task: 0.9 x 79.0 GiB free of the device's 80.0 GiB (1.0 GiB held: CUDA context,
    other processes), 1 thread(s) on tcp://w:1
    """
    if not statuses:
        raise BudgetError("no workers to derive a GPU budget from")
    fraction = GPU_TARGET_FRACTION if target_fraction is None else target_fraction
    per_worker: list[tuple[int, str]] = []
    free: dict[str, int] = {}
    for address, st in sorted(statuses.items()):
        if not getattr(st, "usable", False) or st.free_bytes is None:
            raise BudgetError(f"the worker {address} has no usable GPU any more ({getattr(st, 'why', st)!r}), "
                              "though the map was to run on the GPU: rerun with device='auto' to use the CPU where "
                              "a worker has no GPU, or restore the worker's GPU")
        threads = max(1, int(nthreads.get(address, 1)))
        free[address] = int(st.free_bytes)
        b = gpu_task_budget_bytes(st.free_bytes, threads, target_fraction=target_fraction)
        held = max(0, int(st.total_bytes or st.free_bytes) - int(st.free_bytes))
        per_worker.append((b, f"GPU budget {format_bytes(b)} per task: {fraction:g} x {format_bytes(st.free_bytes)} "
                              f"free of the device's {format_bytes(st.total_bytes)} ({format_bytes(held)} held: CUDA "
                              f"context, other processes), {threads} thread(s) on {address}"))
    b, reason = min(per_worker)
    if b <= 0:
        raise BudgetError(f"no GPU memory to plan for: {reason}. Free the GPU (other processes hold it: "
                          "nvidia-smi lists them) or run this map with device='cpu'")
    return GpuBudget(budget_bytes=b, free_bytes=free, reason=reason)


def budget(workers: list[WorkerMemory], *, target_fraction: float | None = None,
           memory_budget: int | None = None) -> Budget:
    """The budget per task: the kill line minus the resting memory, per thread; a user's figure caps it.

    The line a task must stay under is where the nanny kills the worker
    (``kill_fraction x memory_limit``; the limit itself where nothing kills).
    The safety margin under it is not a fixed fraction: it is the model's, in the
    upper bound every plan must fit (learned from the operator's own prediction
    errors and from how far runs started above the resting memory read here).
    ``target_fraction`` (of the limit) and ``memory_budget`` (bytes), when given,
    cap the budget.

    >>> w = WorkerMemory("tcp://w:1", 1, 1000 * 2**20, 200 * 2**20, 0.95)
    >>> b = budget([w])
    >>> b.budget_bytes // 2**20, b.reason
    (750, 'budget 750.0 MiB per task: the kill line 950.0 MiB (0.95 x memory_limit 1000.0 MiB) less 200.0 MiB resting')
    >>> budget([w], target_fraction=0.5).budget_bytes // 2**20
    300
    """
    if not workers:
        raise BudgetError("no workers to derive a budget from")
    resting = {x.address: x.resting_bytes for x in workers}
    headrooms = {x.address: int((x.kill_headroom_bytes or 0) / max(1, x.nthreads)) for x in workers
                 if x.kill_headroom_bytes is not None}
    touched = {x.address: t for x in workers if (t := x.touched_bytes) is not None}
    if memory_budget is not None and not all(w.line[1] != NONE for w in workers):
        return Budget(slots=slots(workers), budget_bytes=int(memory_budget), resting_bytes=resting,
                      headroom_bytes=headrooms, touched_bytes=touched, threads_per_worker=max(1, workers[0].nthreads),
                      reason=f"budget {format_bytes(memory_budget)} per task (memory_budget; workers without a "
                             "memory_limit have no line to derive one from)")
    per_worker = []
    alone = []  # what a task may use alone on each worker
    for w in workers:
        line, by = w.line
        if by == NONE:
            raise BudgetError(
                f"the worker {w.address} has no memory limit (memory_limit={w.memory_limit_bytes!r}), so there is "
                "no budget to plan for: give the cluster a memory_limit, or pass memory_budget= to MemoryAwareRunner")
        threads = max(1, w.nthreads)
        b = int((line - w.resting_bytes) / threads)
        a = int(line - w.resting_bytes)
        if target_fraction is not None and w.memory_limit_bytes:
            b = min(b, task_budget_bytes(w.memory_limit_bytes, threads, target_fraction=target_fraction,
                                         resting_bytes=w.resting_bytes, kill_fraction=w.kill_fraction))
            a = min(a, int(w.memory_limit_bytes * target_fraction) - w.resting_bytes)
        per_worker.append((b, w, line, threads))
        alone.append(a)
    worker_budget = min(alone) if memory_budget is None else min(min(alone), int(memory_budget))
    uniform = len({max(1, x.nthreads) for x in workers}) == 1  # alone is one task per worker only if all are alike
    b, w, line, threads = min(per_worker, key=lambda t: t[0])
    if b <= 0:
        raise BudgetTooSmallError(
            f"the worker {w.address} rests at {format_bytes(w.resting_bytes)}, at or above the line it is killed at: "
            f"{w.describe_line()}: give workers more memory (memory_limit, and the job's memory: --mem) or fewer "
            "threads per worker")
    reason = (f"budget {format_bytes(b)} per task: {w.describe_line()} less {format_bytes(w.resting_bytes)} resting"
              + (f", over {threads} threads" if threads > 1 else ""))
    if target_fraction is not None and b < int((line - w.resting_bytes) / threads):
        reason += f", capped by target_fraction {target_fraction:g}"
    if memory_budget is not None and memory_budget < b:
        b = int(memory_budget)
        reason = f"budget {format_bytes(b)} per task (memory_budget; the cluster's line allows more)"
    return Budget(slots=slots(workers), budget_bytes=int(b), resting_bytes=resting, reason=reason,
                  headroom_bytes=headrooms, touched_bytes=touched, memory_limit_bytes=int(w.memory_limit_bytes),
                  threads_per_worker=threads, kill_fraction=w.kill_fraction,
                  worker_budget_bytes=max(0, worker_budget) if uniform else None)


def planned_slots(nthreads: dict[str, int], requested: int | None) -> int:
    """The slots a map plans for: the threads of the workers there, or, when more workers were requested than
    have joined (batch jobs still queued, an adaptive cluster still growing), the requested workers at the
    joined ones' threads each. Planning for what was asked keeps enough chunks in flight for the jobs that
    join later, and for an adaptive cluster to see the load that makes it grow.

    >>> planned_slots({"a": 2}, 8), planned_slots({"a": 2, "b": 2}, None), planned_slots({"a": 1}, 1)
    (16, 4, 1)
    """
    present = sum(nthreads.values())
    if not requested or requested <= len(nthreads) or not nthreads:
        return present
    return max(present, int(round(requested * present / len(nthreads))))


def task_budget_bytes(memory_limit_bytes: int, threads: int = 1, *, target_fraction: float = 0.75,
                      resting_bytes: int = 0, kill_fraction: float | None = None) -> int:
    """Memory one task may use above the worker's resting level, in bytes.

    ``target_fraction`` of the worker's ``memory_limit``, less what the idle worker
    process already holds (once per process, not per thread), shared among its
    threads. ``kill_fraction`` is the
    fraction of the limit at which the worker's nanny kills it (Dask's
    ``distributed.worker.memory.terminate``, read from the cluster; None when the
    nanny does not kill): a target at or above it is refused. With Dask's defaults
    (pause 0.80, terminate 0.95) the default 0.75 stays below both.

    >>> task_budget_bytes(4 * 2**30, 1, target_fraction=0.75, resting_bytes=2**30)
    2147483648
    """
    if not memory_limit_bytes or memory_limit_bytes <= 0:
        raise BudgetError(
            f"the workers have no memory limit (memory_limit={memory_limit_bytes!r}), so there is no budget to "
            "plan for: give the cluster a memory_limit, or pass memory_budget= to MemoryAwareRunner"
        )
    ceiling = 1.0 if kill_fraction is None else float(kill_fraction)
    if not 0 < target_fraction <= ceiling:
        raise BudgetError(
            f"target_fraction must be in (0, {ceiling:g}], got {target_fraction}"
            + (f": the workers' nanny kills a worker at {ceiling:g} of its memory_limit "
               "(distributed.worker.memory.terminate)" if kill_fraction is not None else ""))
    threads = max(1, int(threads))
    budget = int((memory_limit_bytes * target_fraction - int(resting_bytes)) / threads)
    if budget <= 0:
        raise BudgetTooSmallError(
            f"a worker's memory_limit of {format_bytes(memory_limit_bytes)} x target_fraction {target_fraction} "
            f"leaves nothing above its resting {format_bytes(resting_bytes)} for its {threads} thread(s): give "
            "workers more memory"
        )
    return budget


#: The share of a GPU's free memory one worker's tasks may plan for when no ``target_fraction`` is set: the rest
#: is left for what the model does not see (cuFFT plans and cuSOLVER workspaces made inside a call, the pool's
#: fragmentation). A GPU has no nanny killing at a line, so the fraction is the only margin besides the model's.
GPU_TARGET_FRACTION = 0.9


def gpu_task_budget_bytes(free_bytes: int, threads: int = 1, *, target_fraction: float | None = None) -> int:
    """What one task may use of a GPU's memory, bytes: ``target_fraction`` (default :data:`GPU_TARGET_FRACTION`)
    of what the worker could allocate there (``free_bytes``: free memory plus its own pool, so its CUDA context
    and other processes' use are left out), shared by the worker's ``threads``.

    >>> gpu_task_budget_bytes(80 * 2**30) / 2**30
    72.0
    >>> gpu_task_budget_bytes(80 * 2**30, 2, target_fraction=0.5) / 2**30
    20.0
    """
    fraction = GPU_TARGET_FRACTION if target_fraction is None else target_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1):
        raise BudgetError(f"target_fraction must be a number in (0, 1], got {target_fraction!r}")
    return int(fraction * max(0, int(free_bytes)) / max(1, int(threads)))


def allowed_failures_warning(allowed_failures: int | None, address: str) -> str | None:
    """What to tell the user about the scheduler's ``allowed-failures`` setting, or None when it is fine.

    Dask retries a task whose worker died on another worker up to ``allowed-failures``
    times (default 3) before reporting ``KilledWorker``. For a task killed for memory
    each retry kills another worker, and the runner only learns of it (and splits the
    chunk) after the last one. The runner sets 0 on clusters it starts; a scheduler
    started elsewhere is a shared setting it reads but never changes.

    >>> allowed_failures_warning(0, "tcp://s:8786") is None
    True
    """
    if allowed_failures is None or allowed_failures <= 0:
        return None
    return (f"the Dask scheduler at {address} retries a task whose worker died up to {allowed_failures} times "
            f"(allowed-failures={allowed_failures}): a chunk that runs out of memory kills up to "
            f"{allowed_failures + 1} workers before memchunk can split it. Start that scheduler with "
            "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=0")


def is_memory_kill(upper_bytes: float | None, kill_headroom_bytes: int, attempt: int,
                   settings: PolicySettings = DEFAULT_SETTINGS) -> bool:
    """Whether a worker's death while running a chunk is taken as the nanny killing it for memory.

    Yes when the model had no ready bound for the chunk, when its bound was
    above ``settings.memory_kill_fraction`` of the kill headroom (the chunk may
    well have crossed the kill line), or when the same chunk already died once.
    A chunk predicted far below the kill line whose worker died was most likely
    lost for another reason (a node lost, a SIGKILL): it runs again once.

    >>> is_memory_kill(None, 1000, 0), is_memory_kill(600.0, 1000, 0), is_memory_kill(100.0, 1000, 0)
    (True, True, False)
    >>> is_memory_kill(100.0, 1000, attempt=1)
    True
    """
    return upper_bytes is None or upper_bytes > settings.memory_kill_fraction * kill_headroom_bytes or attempt > 0
