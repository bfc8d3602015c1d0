"""What the Dask cluster says about memory: worker slots, memory limits, resting memory, the nanny's kill line.

Read from the live cluster at every chunked map (workers' resting memory grows
once Prefect and the operators are imported on them; adaptive clusters change
size), through the client. The arithmetic over what was read is pure and lives in
:mod:`memchunk_prefect.core.budget`. :class:`ClusterView` is what a chunked map sees of
its cluster: slots, budgets, kill headroom, device, read when the map asks.

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

What it does not cover: the budget arithmetic (:mod:`memchunk_prefect.core.budget`)
and starting clusters (prefect-dask's ``DaskTaskRunner``, which the runner extends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import dask

from memchunk_prefect.core import budget as _budget
from memchunk_prefect.core.budget import Budget, GpuBudget, WorkerMemory, memory_fraction
from memchunk_prefect.core.deaths import DeathEvidence
from memchunk_prefect.core.errors import RunnerConfigError
from memchunk_prefect.core.settings import RUNNER_SETTINGS, RunnerSettings
from memchunk_prefect.core.sharing import SLOT_RESOURCE
from memchunk_prefect.operators.device import GpuStatus, check_device, gpu_status, resolve_for_workers
from memchunk_prefect.run import batch
from memchunk_prefect.run.job_memory import job_limits, job_memory, read_job_memory, run_on_nanny
from memchunk_prefect.run.prefect_api import flow_logger
from memchunk_prefect.run.standings import StandingBoard

logger = logging.getLogger("memchunk_prefect.run.cluster")
#: What a user hears about a map's cluster goes out on the runner's logger, as the rest of what the runner says.
runner_logger = logging.getLogger("memchunk_prefect.run.runner")

TERMINATE_KEY = "distributed.worker.memory.terminate"
#: Where a local cluster's dashboard listens unless the caller says otherwise: loopback only, a free port.
LOOPBACK_DASHBOARD = "127.0.0.1:0"


def default_cluster_kwargs() -> dict[str, Any]:
    """A local cluster sized to the machine: one single-thread worker process per core.

    One thread per worker process gives clean per-task memory figures (each
    process's peak is one task's peak); memory is split evenly among workers.
    The dashboard listens on loopback only, on a free port.
    """
    n = max(1, os.cpu_count() or 1)
    return {"n_workers": n, "threads_per_worker": 1, "processes": True, "dashboard_address": LOOPBACK_DASHBOARD}


def local_cluster_kwargs(cluster_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``cluster_kwargs`` of a local cluster the runner starts from the caller's: its workers offering one unit of
    :data:`~memchunk_prefect.core.sharing.SLOT_RESOURCE` per thread where they have several threads (and the
    caller gave no ``resources`` of its own, nor a thread count to size it by): a map that runs one task per
    worker then asks for all of a worker's units, and Dask runs no other chunk beside it.

    The dashboard listens on loopback, on a free port, unless the caller named an address: Dask's own default,
    port 8787 on every interface, shows the cluster to the network, and a second flow's cluster on the same
    machine finds the port taken.

    >>> local_cluster_kwargs({"n_workers": 2, "threads_per_worker": 2})["resources"]
    {'memchunk-slots': 2}
    >>> "resources" in local_cluster_kwargs({"threads_per_worker": 1})
    False
    >>> local_cluster_kwargs({"n_workers": 2})["dashboard_address"], local_cluster_kwargs({"dashboard_address": None})
    ('127.0.0.1:0', {'dashboard_address': None})
    """
    out = dict(cluster_kwargs)
    out.setdefault("dashboard_address", LOOPBACK_DASHBOARD)
    threads = out.get("threads_per_worker")
    if isinstance(threads, int) and threads > 1 and "resources" not in out:
        out["resources"] = {SLOT_RESOURCE: threads}
    return out


def read_slot_units(client: Any) -> float | None:
    """The units of :data:`~memchunk_prefect.core.sharing.SLOT_RESOURCE` each worker offers, where every worker
    offers the same units over the same threads; None elsewhere, or when the scheduler cannot be asked."""
    try:
        workers = (scheduler_info(client).get("workers") or {}).values()
    except Exception as exc:  # noqa: BLE001 - placement then falls back to choosing the least busy worker
        logger.info("could not read the workers' resources: %r", exc)
        return None
    offers = {(float((w.get("resources") or {}).get(SLOT_RESOURCE, 0) or 0), int(w.get("nthreads", 1) or 1))
              for w in workers}
    # One offer for all: a share asked of workers of different sizes would let a larger one run two alone.
    return next(iter(offers))[0] if len(offers) == 1 and next(iter(offers))[0] > 0 else None


def configured_kill_fraction() -> float | None:
    """This process's ``distributed.worker.memory.terminate`` (None when the nanny does not kill).

    >>> with dask.config.set({TERMINATE_KEY: 0.9}):
    ...     configured_kill_fraction()
    0.9
    """
    return memory_fraction(dask.config.get(TERMINATE_KEY, default=None))


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
WORKER_MODULES = ("memchunk_prefect.run.worker", "memchunk_prefect.run.runner", "prefect.task_engine")


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
    these imports added (:func:`memchunk_prefect.run.process_memory.process_resting_bytes`).
    """
    import ctypes
    import importlib

    import psutil

    from memchunk_prefect.run.process_memory import process_resting_bytes

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
    most its process has held (:func:`memchunk_prefect.run.process_memory.high_water_bytes`, at least the resting
    memory), bytes: one call, so a map's start pays one round trip for both."""
    from memchunk_prefect.run.process_memory import high_water_bytes

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
# its nanny closed in the gap of the second restart. A deployment that stops a nanny, or a lost host, looks the
# same. Waiting for such a worker the whole timeout, then failing the map while other workers are there, would
# throw away a run that can go on.


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


def jobqueue_job(cluster: Any, name: str | None) -> tuple[str | None, str | None]:
    """The batch job id of the worker called ``name`` in a dask-jobqueue cluster, and its batch system
    (``"slurm"`` for SLURMCluster, else the class's name, lower case); (None, None) elsewhere. dask-jobqueue keeps
    each job under the worker's name in ``cluster.workers`` (``Job.job_id``) until it is closed."""
    job = getattr(cluster, "workers", {}).get(name) if cluster is not None and name else None
    job_id = getattr(job, "job_id", None)
    if not job_id:
        return None, None
    kind = type(cluster).__name__.lower()
    return str(job_id), "slurm" if kind.startswith("slurm") else kind.removesuffix("cluster")


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


def read_started(client: Any, since: float) -> frozenset[str] | None:
    """The Prefect task runs whose chunk began on a worker, as the workers logged them on the scheduler
    (:data:`memchunk_prefect.run.worker.STARTED_TOPIC`); None when the log cannot be read, or when it is full
    (``distributed.admin.low-level-log-length`` events, on the scheduler) and its oldest event is later than
    ``since`` (epoch s, less a second for the clocks): a start logged after ``since`` may have been dropped."""
    from memchunk_prefect.run.worker import STARTED_TOPIC

    try:
        events = client.get_events(STARTED_TOPIC)
        if events and events[0][0] > since - 1.0:
            if len(events) >= int(client.run_on_scheduler(_log_length)):
                return None
    except Exception as exc:  # noqa: BLE001 - no scheduler to ask: nothing known
        logger.info("could not read which chunks had begun: %r", exc)
        return None
    return frozenset(str(msg["task_run"]) for _, msg in events if isinstance(msg, dict) and msg.get("task_run"))


def _log_length() -> int:
    """The scheduler's event log length per topic (run there)."""
    return int(dask.config.get("distributed.admin.low-level-log-length"))


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
    from memchunk_prefect.core.records import PausedIdle, WorkerNow

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
    return memory_fraction(value) or DEFAULT_PAUSE_FRACTION


class ClusterView:
    """What a chunked map sees of its cluster, read through the client when the map asks.

    One per runner entered for a flow run, shared by its maps (they run in threads of
    their own: what is cached is read under a lock). Caches what does not change
    while a worker lives: each worker's kill fraction and GPU status.

    ``client``: returns the runner's Dask client (made on first use); ``cluster``:
    returns the cluster object the runner started (None on a scheduler started
    elsewhere); ``target_fraction`` and ``memory_budget`` cap the budget
    (:func:`memchunk_prefect.core.budget.budget`); ``adaptive``: the cluster may add
    workers while tasks wait.
    """

    def __init__(self, client: Callable[[], Any], cluster: Callable[[], Any], *,
                 target_fraction: float | None = None, memory_budget: int | None = None, adaptive: bool = False):
        self._client = client
        self._cluster = cluster
        self.target_fraction = target_fraction
        self.memory_budget = memory_budget
        self.adaptive = adaptive
        self._lock = threading.RLock()
        self._death_lock = threading.Lock()  # held while a death is read (seconds): not the budget's lock
        self._kill_fractions: dict[str, object] = {}
        self._jobs: dict[str, dict[str, Any]] = {}  # worker address -> job_memory() read there (once per worker)
        self._nannies: dict[str, str] = {}  # worker address -> its nanny's address
        self._oom_seen: dict[str, int] = {}  # nanny address -> the OOM kill count last read in its cgroup
        self._deaths: dict[str, DeathEvidence] = {}  # worker address -> what was read about its death (once)
        self._worker_gpus: dict[str, GpuStatus] | None = None
        self._checked = False
        self._machines_recorded = False
        self.standings = StandingBoard()  # what the maps tell each other of where their workers stand

    @property
    def client(self) -> Any:
        return self._client()

    def workers(self, modules: Sequence[str] = ()) -> list[WorkerMemory]:
        """The cluster's workers as the budget sees them: kill fraction (read once per worker), resting memory,
        high-water mark.

        The resting memory is read on each worker after importing what a task run
        of this map imports there (``modules`` besides the runner's own), so a fresh
        worker's first task does not start above what the budget assumed.
        """
        client = self.client
        info = wait_for_workers(client)
        with self._lock:
            new = [a for a in info["workers"] if a not in self._kill_fractions]
        if new:
            fractions = read_kill_fractions(client, new)
            jobs = read_job_memory(client, new)
            with self._lock:
                self._kill_fractions.update(fractions)
                self._jobs.update(jobs)
                for a in new:
                    nanny = info["workers"][a].get("nanny")
                    if nanny:
                        self._nannies[a] = str(nanny)
                        if jobs.get(a, {}).get("oom_kills") is not None:
                            self._oom_seen.setdefault(str(nanny), int(jobs[a]["oom_kills"]))
        marks = read_marks(client, (*WORKER_MODULES, *modules))
        with self._lock:
            limits = job_limits({a: j for a, j in self._jobs.items() if a in info["workers"]})
        return _budget.workers_from_info(info, dict(self._kill_fractions), configured_kill_fraction(),
                                         {a: r for a, (r, _) in marks.items()}, {a: h for a, (_, h) in marks.items()},
                                         limits)

    def death_evidence(self, worker: str, nanny: str | None = None, name: str | None = None) -> DeathEvidence | None:
        """What the nanny, the kernel and the batch system say about the death of the worker at ``worker``
        (:func:`memchunk_prefect.run.batch.death_evidence`), read once per dead worker (its chunks in flight share
        it); None for an unnamed worker. ``nanny`` and ``name``: as Dask's report of the death gives them (a worker
        that joined mid-map was never read here: its nanny is asked, and its job looked up by name in the runner's
        dask-jobqueue cluster)."""
        if not worker:
            return None
        with self._death_lock:  # one reading at a time (the OOM count read is compared with the last one)
            with self._lock:
                if worker in self._deaths:
                    return self._deaths[worker]
                job, nanny = self._jobs.get(worker), self._nannies.get(worker) or nanny
                seen = self._oom_seen.get(nanny) if nanny else None
            job_id, system = jobqueue_job(self._cluster(), name)
            client = self.client
            at_nanny = None if not nanny else functools.partial(run_on_nanny, client, nanny, job_memory)
            kills = functools.partial(read_memory_kills, client)
            evidence, now = batch.death_evidence(worker, kills, at_nanny, job, seen, job_id=job_id, batch=system)
            with self._lock:
                self._deaths[worker] = evidence
                if nanny and now is not None:
                    self._oom_seen[nanny] = int(now)
            return evidence

    def budget(self, modules: Sequence[str] = ()) -> Budget:
        """Task slots, the per-task memory budget and how it was derived, read from the live cluster.

        Read afresh at every chunked map: between maps the workers are idle, so
        their process memory is their resting level (which grows once Prefect and
        the operators are imported on them), and the budget is what lies above it
        up to the kill line (see :func:`memchunk_prefect.core.budget.budget`).
        """
        workers = self.workers(modules)
        self._check_once()
        b = _budget.budget(workers, target_fraction=self.target_fraction, memory_budget=self.memory_budget)
        requested = self.requested_workers()
        planned = _budget.planned_slots({w.address: w.nthreads for w in workers}, requested)
        if planned != b.slots:
            b = dataclasses.replace(b, slots=planned, reason=f"{b.reason}; planned for {planned} slots: "
                                                              f"{requested} workers requested, {len(workers)} joined")
        with self._lock:
            placement = {a: (str(j.get("host") or ""), j["cpus"]) for a, j in self._jobs.items() if j.get("cpus")}
        per_core = _budget.threads_per_core({w.address: w.nthreads for w in workers}, placement)
        if any(w.address in placement for w in workers):
            b = dataclasses.replace(b, cores_read=True)
        if per_core > 1.0:
            b = dataclasses.replace(b, threads_per_core=per_core,
                                    reason=f"{b.reason}; {per_core:g} worker threads per CPU core")
        return b

    def requested_workers(self) -> int | None:
        """Workers the runner's own cluster was asked for (None on a scheduler started elsewhere): see
        :func:`requested_workers`."""
        return requested_workers(self._cluster())

    def slots_now(self) -> int | None:
        """The slots a running map should plan for now (the workers there, or the requested ones; see
        :func:`memchunk_prefect.core.budget.planned_slots`); None when the scheduler cannot be asked."""
        nthreads = read_nthreads(self.client)
        return _budget.planned_slots(nthreads, self.requested_workers()) if nthreads else None

    def kill_headroom_bytes(self) -> int | None:
        """What a task may use above its worker's resting memory before the nanny kills it (smallest over workers)."""
        return _budget.kill_headroom_bytes(self.workers())

    def map_device(self, requested: str) -> str:
        """The device (``"cpu"`` or ``"cuda"``) a map asking for ``requested`` runs on, from what the cluster's
        workers report (:func:`memchunk_prefect.operators.device.resolve_for_workers`; read once per set of
        workers)."""
        requested = check_device(requested)
        if requested == "cpu":
            return "cpu"
        with self._lock:
            client = self.client
            addresses = set(wait_for_workers(client)["workers"])
            if self._worker_gpus is None or set(self._worker_gpus) != addresses:
                self._worker_gpus = {str(k): v for k, v in client.run(gpu_status).items()}
            return resolve_for_workers(requested, self._worker_gpus)

    def gpu_budget(self) -> GpuBudget:
        """The GPU memory one task may use, read from the workers' devices now (at every map on the GPU, as the
        host budget is): see :func:`memchunk_prefect.core.budget.gpu_budget`."""
        client = self.client
        statuses = {str(k): v for k, v in client.run(gpu_status).items()}
        return _budget.gpu_budget(statuses, read_nthreads(client) or {}, target_fraction=self.target_fraction)

    def record_machines(self, store: Any) -> None:
        """Store what the cluster's hosts are (CPU, memory, system) once per view, for traces."""
        with self._lock:
            if self._machines_recorded:
                return
            self._machines_recorded = True
        try:
            machines = read_machines(self.client)
            if store is not None and machines:
                store.put_machines(machines)
        except Exception as exc:  # noqa: BLE001 - never stops a run
            logger.warning("could not record the cluster's machines: %r", exc)

    def _check_once(self) -> None:
        """Warn once when the scheduler retries dead workers' tasks (:func:`_budget.allowed_failures_warning`)."""
        with self._lock:  # two maps' threads read the budget at once
            if self._checked:
                return
            self._checked = True
        client = self.client
        message = _budget.allowed_failures_warning(read_allowed_failures(client), client.scheduler.address)
        if message:
            runner_logger.warning("%s", message)
            flow_logger(runner_logger).warning("memchunk: %s", message)
