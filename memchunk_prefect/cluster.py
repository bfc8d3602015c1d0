"""What the Dask cluster says about memory: worker slots, memory limits, resting memory, the nanny's kill line.

Read from the live cluster at every chunked map (workers' resting memory grows
once Prefect and the operators are imported on them; adaptive clusters change
size), through the client. The arithmetic over what was read is pure
(:func:`workers_from_info`, :func:`kill_headroom_bytes`, :func:`task_budget`) and
tested with plain dicts.

The kill line. A worker's nanny kills it when its process memory crosses
``distributed.worker.memory.terminate`` (default 0.95) of its ``memory_limit``,
checked every ``distributed.worker.memory.monitor-interval`` (100 ms). That
fraction is the nanny's own setting, and a nanny starts its worker process with
its own Dask configuration, so each worker's value is read from the worker
(:func:`read_kill_fractions`); this process's configuration
(:func:`configured_kill_fraction`) is used only where a worker cannot be asked.
``False`` (the nanny never kills) reads as None. Asking the workers rather than
the nannies (``client.run(..., nanny=True)``) keeps the nannies out of it: they
are the processes that restart killed workers.

What it does not cover: choosing a budget from these figures (``policy.py``)
and starting clusters (``runner.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import dask

from . import policy
from .errors import BudgetError, BudgetTooSmallError, RunnerConfigError, format_bytes
from .settings import RUNNER_SETTINGS, RunnerSettings

logger = logging.getLogger("memchunk_prefect.cluster")

TERMINATE_KEY = "distributed.worker.memory.terminate"


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
    #: The most the worker's process has held (:func:`memchunk_prefect.monitor.high_water_bytes`; its resting
    #: memory where no run has been measured there), bytes; None where not read.
    high_water_bytes: int | None = None

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
        """What a task may use above the resting memory before the nanny kills the worker (None: no kill line)."""
        if not self.memory_limit_bytes or self.kill_fraction is None:
            return None
        return int(self.kill_fraction * self.memory_limit_bytes) - self.resting_bytes


def configured_kill_fraction() -> float | None:
    """This process's ``distributed.worker.memory.terminate`` (None when the nanny does not kill).

    >>> with dask.config.set({TERMINATE_KEY: 0.9}):
    ...     configured_kill_fraction()
    0.9
    """
    return _fraction(dask.config.get(TERMINATE_KEY, default=None))


def read_kill_fractions(client: Any, workers: Sequence[str] | None = None) -> dict[str, object]:
    """Each worker's ``distributed.worker.memory.terminate``, by worker address (empty when they cannot be asked).

    The raw setting (a fraction, or False); :func:`workers_from_info` reads it.
    The function travels by value (a lambda), so workers need not have memchunk installed.
    """
    try:
        return {str(k): v for k, v in client.run(
            lambda: __import__("dask").config.get("distributed.worker.memory.terminate", None),
            workers=list(workers) if workers is not None else None).items()}
    except Exception as exc:  # noqa: BLE001 - a cluster that refuses client.run: this process's setting is used
        logger.info("could not read the workers' kill fraction: %r", exc)
        return {}


#: What every chunk's task run imports on its worker before its measurement starts (the task's own module is
#: added per map): imported before the resting memory is read, so the budget sees it.
WORKER_MODULES = ("memchunk_prefect.worker", "memchunk_prefect.runner", "prefect.task_engine")


def resting_after_imports(modules: Sequence[str]) -> int:
    """Run on a worker: import ``modules`` (as its first task run would), return its RSS (bytes).

    The RSS is what the nanny compares with the kill line. A fresh worker rests
    ~100 MiB lower than after its first task run, which imports Prefect's task
    engine, the runner, the volume layer and the operator: a budget read from a
    fresh worker's heartbeat would not see that memory.

    A worker may be busy when this runs: another flow's chunks (or this flow's,
    on a worker another map is using) mid-peak on its other threads. Their memory
    is theirs, budgeted in their own slots, not the worker's resting level: while
    tracked runs are open the level read when none was is returned, plus what
    these imports added (:func:`memchunk_prefect.monitor.process_resting_bytes`).
    """
    import ctypes
    import importlib

    import psutil

    from .monitor import process_resting_bytes

    before = int(psutil.Process().memory_info().rss)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module the worker cannot import fails its task, not this read
            pass
    # No gc.collect(): it took ~130 ms per worker with Prefect loaded, at every map, and a task's arrays are
    # freed by reference counting. Heap an earlier task freed but glibc kept would read as resting memory:
    # hand it back first, as Dask's documentation suggests for "memory not released back to the OS"
    # (worker-memory.html).
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    after = int(psutil.Process().memory_info().rss)
    return process_resting_bytes(after, grown_bytes=after - before)


def marks_after_imports(modules: Sequence[str]) -> tuple[int, int]:
    """Run on a worker: its resting memory after importing ``modules`` (:func:`resting_after_imports`) and the
    most its process has held (:func:`memchunk_prefect.monitor.high_water_bytes`, at least the resting memory),
    bytes: one call, so a map's start pays one round trip for both."""
    from .monitor import high_water_bytes

    resting = resting_after_imports(modules)
    return resting, max(resting, high_water_bytes() or 0)


def read_marks(client: Any, modules: Sequence[str] = WORKER_MODULES) -> dict[str, tuple[int, int]]:
    """Each worker's (resting memory after the imports a task run makes, high-water mark), bytes, by worker
    address (empty if refused): see :func:`marks_after_imports`."""
    try:
        return {str(k): (int(v[0]), int(v[1])) for k, v in client.run(marks_after_imports, list(modules)).items()}
    except Exception as exc:  # noqa: BLE001 - the heartbeat's figure is used instead
        logger.info("could not read the workers' resting memory: %r", exc)
        return {}


def read_resting(client: Any, modules: Sequence[str] = WORKER_MODULES) -> dict[str, int]:
    """Each worker's resting memory after the imports a task run makes, by worker address (empty if refused)."""
    return {k: resting for k, (resting, _) in read_marks(client, modules).items()}


def machine_info() -> dict[str, Any]:
    """What this machine is, for traces (WfFormat's ``machines``): runs on a worker.

    Host name, system, architecture, kernel release, CPU cores / speed (MHz) /
    vendor and total memory (bytes). Values that cannot be read are left out.
    """
    import platform
    import socket

    import psutil

    info: dict[str, Any] = {"nodeName": socket.gethostname(), "system": platform.system().lower(),
                            "architecture": platform.machine(), "release": platform.release(),
                            "memoryInBytes": int(psutil.virtual_memory().total)}
    cpu: dict[str, Any] = {"coreCount": int(psutil.cpu_count(logical=True) or 1)}
    with contextlib.suppress(Exception):
        freq = psutil.cpu_freq()
        if freq is not None and freq.max > 0:
            cpu["speedInMHz"] = int(freq.max)
        elif freq is not None and freq.current > 0:
            cpu["speedInMHz"] = int(freq.current)
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name.strip() in ("vendor_id", "model name") and value.strip():
                    cpu["vendor" if name.strip() == "vendor_id" else "model"] = value.strip()
                if "vendor" in cpu and "model" in cpu:
                    break
    info["cpu"] = cpu
    return info


def read_machines(client: Any) -> dict[str, dict[str, Any]]:
    """``{host: machine_info()}`` for the hosts of the cluster's workers (empty if the cluster refuses)."""
    try:
        infos = client.run(machine_info)
    except Exception as exc:  # noqa: BLE001 - a trace without machine details is still a trace
        logger.info("could not read the workers' machine descriptions: %r", exc)
        return {}
    return {str(i["nodeName"]): i for i in infos.values() if isinstance(i, dict) and i.get("nodeName")}


def workers_from_info(info: Mapping[str, Any], kill_fractions: Mapping[str, object],
                      default_fraction: float | None, resting: Mapping[str, int] | None = None,
                      high_water: Mapping[str, int] | None = None) -> list[WorkerMemory]:
    """The workers of a ``client.scheduler_info()`` answer, with the kill fraction each one's nanny applies.

    ``kill_fractions``: each worker's own ``distributed.worker.memory.terminate``
    by worker address (see :func:`read_kill_fractions`); a worker not in it takes
    ``default_fraction``. A worker without a nanny has no kill line (None).
    ``resting``: each worker's resting memory as read by :func:`read_resting`; the
    heartbeat's process memory for a worker not in it. ``high_water``: each worker's high-water mark as read
    by :func:`read_marks` (None for a worker not in it).

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
            fraction = _fraction(kill_fractions[address])
        else:
            fraction = default_fraction
        hw = (high_water or {}).get(address)
        out.append(WorkerMemory(
            address=str(address), nthreads=int(w.get("nthreads", 1) or 1),
            memory_limit_bytes=int(w.get("memory_limit") or 0),
            resting_bytes=int((resting or {}).get(address) or (w.get("metrics") or {}).get("memory", 0) or 0),
            kill_fraction=fraction,
            high_water_bytes=None if hw is None else int(hw)))
    return out


def _fraction(value: object) -> float | None:
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
    return min(policy.task_budget_bytes(w.memory_limit_bytes, w.nthreads, target_fraction=target_fraction,
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
    :attr:`WorkerMemory.touched_bytes`); ``reason``: the derivation in words.
    """

    slots: int
    budget_bytes: int
    resting_bytes: dict[str, int]
    reason: str
    headroom_bytes: dict[str, int] = field(default_factory=dict)
    touched_bytes: dict[str, int] = field(default_factory=dict)


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
    (:func:`memchunk_prefect.policy.gpu_task_budget_bytes`), per thread; the smallest over the workers.

    ``statuses``: each worker's :class:`memchunk_prefect.device.GpuStatus` (by address), read at the map's start
    (what is not free to it is its CUDA context and other processes' use; its own pool counts as free). A
    worker without a usable GPU is a :class:`BudgetError` (the map's device was resolved from the same
    statuses, so this is a GPU lost in between).

    >>> from memchunk_prefect.device import GpuStatus
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
    fraction = policy.GPU_TARGET_FRACTION if target_fraction is None else target_fraction
    per_worker: list[tuple[int, str]] = []
    free: dict[str, int] = {}
    for address, st in sorted(statuses.items()):
        if not getattr(st, "usable", False) or st.free_bytes is None:
            raise BudgetError(f"the worker {address} has no usable GPU any more ({getattr(st, 'why', st)!r}), "
                              "though the map was to run on the GPU: rerun with device='auto' to use the CPU where "
                              "a worker has no GPU, or restore the worker's GPU")
        threads = max(1, int(nthreads.get(address, 1)))
        free[address] = int(st.free_bytes)
        b = policy.gpu_task_budget_bytes(st.free_bytes, threads, target_fraction=target_fraction)
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
    if memory_budget is not None and not all(w.memory_limit_bytes for w in workers):
        return Budget(slots=slots(workers), budget_bytes=int(memory_budget), resting_bytes=resting,
                      headroom_bytes=headrooms, touched_bytes=touched,
                      reason=f"budget {format_bytes(memory_budget)} per task (memory_budget; workers without a "
                             "memory_limit have no line to derive one from)")
    per_worker = []
    for w in workers:
        if not w.memory_limit_bytes:
            raise BudgetError(
                f"the worker {w.address} has no memory limit (memory_limit={w.memory_limit_bytes!r}), so there is "
                "no budget to plan for: give the cluster a memory_limit, or pass memory_budget= to MemoryAwareRunner")
        threads = max(1, w.nthreads)
        fraction = 1.0 if w.kill_fraction is None else w.kill_fraction
        line = fraction * w.memory_limit_bytes
        headroom = int((line - w.resting_bytes) / threads)
        b = headroom
        if target_fraction is not None:
            b = min(b, policy.task_budget_bytes(w.memory_limit_bytes, threads, target_fraction=target_fraction,
                                                resting_bytes=w.resting_bytes, kill_fraction=w.kill_fraction))
        per_worker.append((b, w, line, threads))
    b, w, line, threads = min(per_worker, key=lambda t: t[0])
    if b <= 0:
        raise BudgetTooSmallError(
            f"the worker {w.address} rests at {format_bytes(w.resting_bytes)}, at or above the line its nanny kills "
            f"at ({format_bytes(line)}): give workers more memory (memory_limit) or fewer threads per worker")
    what = (f"the kill line {format_bytes(line)} ({w.kill_fraction:g} x memory_limit "
            f"{format_bytes(w.memory_limit_bytes)})" if w.kill_fraction is not None
            else f"memory_limit {format_bytes(line)} (no nanny kills this worker)")
    reason = (f"budget {format_bytes(b)} per task: {what} less {format_bytes(w.resting_bytes)} resting"
              + (f", over {threads} threads" if threads > 1 else ""))
    if target_fraction is not None and b < int((line - w.resting_bytes) / threads):
        reason += f", capped by target_fraction {target_fraction:g}"
    if memory_budget is not None and memory_budget < b:
        b = int(memory_budget)
        reason = f"budget {format_bytes(b)} per task (memory_budget; the cluster's line allows more)"
    return Budget(slots=slots(workers), budget_bytes=int(b), resting_bytes=resting, reason=reason,
                  headroom_bytes=headrooms, touched_bytes=touched)


def scheduler_info(client: Any) -> dict:
    """``client.scheduler_info()`` listing every worker (newer distributed lists 5 unless asked for all)."""
    try:
        all_workers = "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):  # pragma: no cover
        all_workers = False
    return client.scheduler_info(n_workers=-1) if all_workers else client.scheduler_info()


def wait_for_workers(client: Any, settings: RunnerSettings = RUNNER_SETTINGS) -> dict:
    """The scheduler's info once it has at least one worker; RunnerConfigError after ``workers_wait_seconds``."""
    info = scheduler_info(client)
    deadline = time.monotonic() + settings.workers_wait_seconds
    while not info.get("workers") and time.monotonic() < deadline:  # an adaptive or external cluster still starting
        time.sleep(settings.workers_poll_seconds)
        info = scheduler_info(client)
    if not info.get("workers"):
        raise RunnerConfigError(
            f"the Dask cluster at {client.scheduler.address} has no workers after "
            f"{settings.workers_wait_seconds:g} s: start workers (`dask worker ADDRESS --memory-limit 4GiB "
            "--nthreads 1`) or check adapt_kwargs")
    return info


# --------------------------------------------------------------------------- restarting one worker

# A worker whose CUDA context is broken is restarted through its nanny (Scheduler.restart_workers kills the process;
# the nanny starts a new one). The nanny may not be there to do it: distributed's SpecCluster (LocalCluster) closes
# a worker's nanny when no worker of that name is registered `distributed.deploy.lost-worker-timeout` (15 s) after
# one was removed, and that timer does not look at later removals; a worker restarted twice within 15 s can have
# its nanny closed in the gap of the second restart (seen on an H100, distributed 2026.8). A deployment that stops
# a nanny, or a lost host, looks the same. Waiting for such a worker the whole timeout, then failing the map while
# other workers are there, would throw away a run that can go on.


@dataclass(frozen=True)
class Restarted:
    """What came of restarting one worker.

    ``outcome``: ``back`` (its nanny started a new process, registered at
    ``address``), ``gone`` (its nanny answered before the restart and no longer
    does: it was closed, or its host lost) or ``late`` (no new process within
    the time allowed). ``workers_left``: the workers registered when it was
    decided; ``seconds``: how long the restart took.
    """

    outcome: str
    address: str | None
    workers_left: int
    seconds: float


def nanny_answers(client: Any, nanny: str, timeout_s: float = 1.0) -> bool:
    """Whether the nanny at ``nanny`` answers a call within ``timeout_s`` seconds (an address that refuses
    connections is retried by distributed until the timeout)."""
    from distributed.core import rpc

    async def identity() -> None:
        async with rpc(nanny, timeout=timeout_s, connection_args=client.connection_args) as r:
            await r.identity()

    try:
        client.sync(identity)
        return True
    except Exception:  # noqa: BLE001 - closed, unreachable or timed out: it does not answer
        return False


def restart_worker(client: Any, address: str, timeout_s: float, poll_s: float = 0.2) -> Restarted:
    """Restart the worker at ``address`` through its nanny and wait for its new process (at most ``timeout_s``).

    Stops waiting as soon as the nanny is seen gone (it answered before the restart, and no longer does). Raises
    RunnerConfigError for a worker without a nanny (nothing would start it again).
    """
    start = time.monotonic()
    nanny = scheduler_info(client).get("workers", {}).get(address, {}).get("nanny")
    if not nanny:
        raise RunnerConfigError(f"worker {address} has no nanny, so it cannot be restarted: start the workers "
                                "with nannies (the default of `dask worker` and LocalCluster)")
    answered = nanny_answers(client, nanny)
    # The scheduler's own handler (what Client.restart_workers calls), told not to wait for the worker count: the
    # wait is done here, where a nanny that went away ends it.
    client.sync(client.scheduler.restart_workers, workers=[address], timeout=timeout_s, wait_for_workers=False,
                on_error="return", stimulus_id=f"memchunk-restart-{time.time()}")
    while True:
        workers = scheduler_info(client).get("workers", {})
        new = [a for a, w in workers.items() if a != address and w.get("nanny") == nanny]
        elapsed = time.monotonic() - start
        if new:
            return Restarted("back", new[0], len(workers), elapsed)
        if answered and not nanny_answers(client, nanny):
            return Restarted("gone", None, len(scheduler_info(client).get("workers", {})),
                             time.monotonic() - start)
        if elapsed > timeout_s:
            return Restarted("late", None, len(workers), elapsed)
        time.sleep(poll_s)


def read_nthreads(client: Any) -> dict[str, int] | None:
    """Each worker's threads now (the scheduler's ``nthreads`` answer: one number per worker, small at any
    scale); None when it cannot be read."""
    try:
        return {str(k): int(v) for k, v in client.nthreads().items()}
    except Exception as exc:  # noqa: BLE001 - a busy or lost scheduler: keep the slots there were
        logger.info("could not read the cluster's worker threads: %r", exc)
        return None


def requested_workers(cluster: Any) -> int | None:
    """How many workers the runner's own cluster was asked for: its spec (``SpecCluster.plan``: what ``scale``
    asked; dask-jobqueue's jobs times their processes) or its adaptive maximum, whichever is larger. None for a
    scheduler started elsewhere (the runner has no cluster object) or a cluster that says neither.

    The adaptive maximum is read from ``cluster._adaptive.maximum`` (distributed keeps the Adaptive object
    there; dask-jobqueue converts ``maximum_jobs`` into it): a private attribute, read defensively.
    """
    if cluster is None:
        return None
    counts = []
    try:
        counts.append(len(cluster.plan))
    except Exception:  # noqa: BLE001 - not a SpecCluster
        pass
    maximum = getattr(getattr(cluster, "_adaptive", None), "maximum", None)
    if isinstance(maximum, (int, float)) and math.isfinite(maximum):
        counts.append(int(maximum))
    return max(counts) if counts and max(counts) > 0 else None


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


def read_allowed_failures(client: Any) -> int | None:
    """The scheduler's ``allowed-failures`` (None when it cannot be read). Read by value: no memchunk needed there."""
    try:
        return client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.allowed_failures)
    except Exception as exc:  # noqa: BLE001 - a scheduler that refuses run_on_scheduler: nothing to say
        logger.info("could not read the scheduler's allowed-failures: %r", exc)
        return None


def read_memory_kills(client: Any) -> list[str] | None:
    """The workers their nanny killed for memory, as the scheduler logged them (the nanny's
    ``worker-restart-memory`` event, sent as it terminates a worker past ``distributed.worker.memory.terminate``);
    None when the log cannot be read. The kernel's OOM killer and other signals leave no such event."""
    try:
        events = client.get_events("worker-restart-memory")
    except Exception as exc:  # noqa: BLE001 - no scheduler to ask: nothing confirmed
        logger.info("could not read the nannies' memory kills: %r", exc)
        return None
    return [str(msg.get("worker")) for _, msg in events if isinstance(msg, dict) and msg.get("worker")]


# --------------------------------------------------------------------------- pauses

# A worker crossing ``distributed.worker.memory.pause`` (default 0.8 of its memory_limit) stops taking new tasks
# until its memory falls again; the scheduler logs each status change under the worker's address. The intervals
# are computed from the log by the pure ``records.pauses_from``.


def read_status_changes(client: Any) -> list[tuple[str, float, str]] | None:
    """The scheduler's log of worker status changes as ``(worker, time, status)`` (None when it cannot be read).

    A worker leaving the cluster (killed by its nanny, often while paused) or joining it is logged as status
    ``removed`` / ``added``: either ends a pause (``records.pauses_from``). Filtered on the scheduler by a nested
    function, which travels by value (the scheduler need not have memchunk installed), so only these few tuples
    come back.
    """
    def collect(dask_scheduler: Any) -> list[tuple[str, float, str]]:
        names = {"remove-worker": "removed", "add-worker": "added"}
        out = []
        for topic, events in dask_scheduler.get_events().items():
            for t, msg in events:
                if not isinstance(msg, dict) or topic == "all":
                    continue
                action = msg.get("action")
                if action == "worker-status-change":
                    out.append((str(topic), float(t), str(msg.get("status"))))
                elif action in names:
                    out.append((str(topic), float(t), names[action]))
        return out

    try:
        return client.run_on_scheduler(collect)
    except Exception as exc:  # noqa: BLE001 - a scheduler that refuses run_on_scheduler: no pause figures
        logger.info("could not read the workers' status changes: %r", exc)
        return None


def read_paused_idle(client: Any) -> Any:
    """What the scheduler says of pauses now (``records.PausedIdle``): its transition count, how many workers it
    has, and the workers paused with no task running, with their memory (None when the scheduler cannot be
    asked). Collected and filtered on the scheduler by a nested function (it travels by value, so the scheduler
    need not have memchunk installed): only paused workers' figures come back, whatever the cluster's size.
    Tasks ``cancelled`` or ``resumed`` on a worker may still be running in its thread, so they count as running.
    """
    from .records import PausedIdle, WorkerNow

    def collect(dask_scheduler: Any) -> tuple[int, int, list[tuple[str, str, int, int, int, int]]]:
        rows = []
        for ws in dask_scheduler.workers.values():
            if ws.status.name != "paused":
                continue
            counts = ws.metrics.get("task_counts") or {}
            running = sum(int(counts.get(k, 0)) for k in ("executing", "long-running", "cancelled", "resumed"))
            if running == 0:
                rows.append((str(ws.address), "paused", 0, int(ws.metrics.get("memory") or 0),
                             int(ws.memory_limit or 0), int(ws.nbytes or 0)))
        return int(getattr(dask_scheduler, "transition_counter", 0)), len(dask_scheduler.workers), rows

    try:
        transitions, n_workers, rows = client.run_on_scheduler(collect)
    except Exception as exc:  # noqa: BLE001 - a scheduler that refuses run_on_scheduler: no pause check
        logger.info("could not read the workers' pauses (the stuck-pause check is off for this map): %r", exc)
        return None
    return PausedIdle(int(transitions), int(n_workers), tuple(WorkerNow(*row) for row in rows))


#: Dask's default ``distributed.worker.memory.pause`` (fraction of ``memory_limit``).
DEFAULT_PAUSE_FRACTION = 0.8


def read_pause_fraction(client: Any, address: str) -> float:
    """The fraction of its ``memory_limit`` at which the worker at ``address`` pauses, as its memory manager
    holds it (set when the worker started; Dask's default 0.8 where it cannot be read or pausing is off)."""
    def fraction(dask_worker: Any) -> Any:
        return getattr(getattr(dask_worker, "memory_manager", None), "memory_pause_fraction", None)

    try:
        value = client.run(fraction, workers=[address])[address]
    except Exception as exc:  # noqa: BLE001 - a worker that cannot be asked: Dask's default
        logger.info("could not read %s's pause fraction: %r", address, exc)
        return DEFAULT_PAUSE_FRACTION
    return _fraction(value) or DEFAULT_PAUSE_FRACTION
