"""Measuring one strategy of the side-by-side benchmark (``python -m benchmarks``) on the benchmark's cluster.

:class:`Bench` holds the shared local cluster, the memory :class:`Sampler` and the :class:`AttemptLog`, and runs
one strategy at a time from a clean slate (:meth:`Bench.fresh`), measuring it into a :class:`StrategyResult`
as :mod:`benchmarks.strategies` describes (wall, peak memory over the limit, out-of-memory events, lost
worker-seconds). Importable by Dask workers (the attempt log is a worker plugin).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# =========================================================================== results


@dataclass
class StrategyResult:
    name: str
    wall_seconds: float
    completed: bool
    oom_events: int
    tasks: int
    lost_worker_seconds: float
    peak_memory_fraction: float | None
    notes: str = ""
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["wall_seconds"] = round(d["wall_seconds"], 3)
        d["lost_worker_seconds"] = round(d["lost_worker_seconds"], 3)
        if d["peak_memory_fraction"] is not None:
            d["peak_memory_fraction"] = round(d["peak_memory_fraction"], 4)
        return d


# =========================================================================== measuring


def _is_worker_process(p) -> bool:
    try:
        return any("spawn_main" in part for part in p.cmdline())
    except Exception:
        return False


class Sampler:
    """Samples the RSS of this process's Dask worker children every ``interval`` seconds on a thread.

    ``window()`` starts a measurement window: its peak RSS, the worker pids seen
    in it, and when each one vanished (a death).
    """

    def __init__(self, interval: float = 0.02):
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()
        self.interval = interval
        self.lock = threading.Lock()
        self._procs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._reset()
        self._refresh_at = 0.0
        self.thread = threading.Thread(target=self._loop, name="benchmark-rss-sampler", daemon=True)
        self.thread.start()

    def _reset(self) -> None:
        self.peak_rss = 0
        self.seen: set[int] = set()
        self.vanished: dict[int, float] = {}

    def _refresh(self) -> None:
        try:
            children = self.me.children(recursive=False)
        except Exception:
            return
        alive = {c.pid for c in children}
        for pid in list(self._procs):
            if pid not in alive:
                self._gone(pid)
        for c in children:
            if c.pid not in self._procs and _is_worker_process(c):
                self._procs[c.pid] = c

    def _gone(self, pid: int) -> None:
        self._procs.pop(pid, None)
        with self.lock:
            if pid in self.seen and pid not in self.vanished:
                self.vanished[pid] = time.time()

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= self._refresh_at:
                self._refresh()
                self._refresh_at = now + 0.2
            for pid, p in list(self._procs.items()):
                try:
                    rss = p.memory_info().rss
                except Exception:
                    self._gone(pid)
                    continue
                with self.lock:
                    self.seen.add(pid)
                    self.peak_rss = max(self.peak_rss, rss)
            self._stop.wait(self.interval)

    def window(self) -> None:
        with self.lock:
            self._reset()

    def snapshot(self) -> tuple[int, set[int], dict[int, float]]:
        self._refresh()
        with self.lock:
            return self.peak_rss, set(self.seen), dict(self.vanished)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)


try:
    from distributed import WorkerPlugin
except Exception:  # pragma: no cover
    WorkerPlugin = object  # type: ignore[misc,assignment]


class AttemptLog(WorkerPlugin):
    """A worker plugin that appends ``S key time`` / ``E key time`` when a task starts / stops executing.

    One file per worker process (``<directory>/<pid>.log``), flushed at once, so
    the start of an attempt survives the worker's death.
    """

    name = "memchunk-benchmark-attempts"

    def __init__(self, directory: str):
        self.directory = directory
        self._fh = None

    def setup(self, worker) -> None:
        os.makedirs(self.directory, exist_ok=True)
        self._fh = open(os.path.join(self.directory, f"{os.getpid()}.log"), "a", buffering=1)

    def transition(self, key, start, finish, **kwargs) -> None:
        if self._fh is None:
            return
        if finish == "executing":
            self._fh.write(f"S\t{key!r}\t{time.time():.6f}\n")
        elif start == "executing":
            self._fh.write(f"E\t{key!r}\t{time.time():.6f}\n")

    def teardown(self, worker) -> None:
        if self._fh is not None:
            self._fh.close()


def killed_attempt_seconds(directory: str, vanished: dict[int, float], since: float) -> float:
    """Seconds from start to death of every attempt that was executing on a worker that died (after ``since``)."""
    total = 0.0
    for pid, died in vanished.items():
        path = os.path.join(directory, f"{pid}.log")
        if not os.path.exists(path):
            continue
        open_starts: dict[str, float] = {}
        with open(path) as fh:
            for line in fh:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 3:
                    continue
                kind, key, t = parts[0], parts[1], float(parts[2])
                if kind == "S":
                    open_starts[key] = t
                else:
                    open_starts.pop(key, None)
        total += sum(max(0.0, died - t) for t in open_starts.values() if t >= since)
    return total


# =========================================================================== the cluster


def warm_worker() -> int:
    """Import what every strategy's tasks import, and hand freed heap back (glibc); returns the pid."""
    import ctypes
    import gc

    import prefect  # noqa: F401
    import prefect_dask  # noqa: F401
    import scipy.ndimage
    import scipy.signal  # noqa: F401
    import zarr  # noqa: F401

    import memchunk_prefect.run.runner  # noqa: F401
    import tasks  # noqa: F401

    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return os.getpid()


class Bench:
    """The shared cluster, sampler and attempt log; runs one strategy at a time from a clean slate."""

    def __init__(self, n_workers: int, memory_limit: str, workdir: Path):
        self.workdir = workdir
        self.n_workers = n_workers
        self.memory_limit_setting = memory_limit
        self.attempts_dir = str(workdir / "attempts")
        self.fresh_seconds: dict[str, float] = {}  # the last fresh(): seconds per phase
        self._start_cluster()
        info = self.client.scheduler_info(n_workers=-1)
        self.memory_limit = min(int(w["memory_limit"]) for w in info["workers"].values())
        self.slots = sum(int(w["nthreads"]) for w in info["workers"].values())
        self.sampler = Sampler()

    def _start_cluster(self) -> None:
        from distributed import Client

        from memchunk_prefect.testing import start_local_cluster

        self.cluster = start_local_cluster(n_workers=self.n_workers, memory_limit=self.memory_limit_setting)
        self.address = self.cluster.scheduler_address
        self.client = Client(self.address, set_as_default=False)
        self.client.wait_for_workers(self.n_workers, timeout=120)
        self.client.register_plugin(AttemptLog(self.attempts_dir))

    def _replace_cluster(self) -> None:
        """A worker that does not come back after a restart (seen under heavy load): start a new cluster.

        Records the seconds to close the old cluster and to start the new one in ``fresh_seconds``.
        """
        t = time.perf_counter()
        with contextlib.suppress(Exception):
            self.client.close()
        with contextlib.suppress(Exception):
            self.cluster.close()
        self.fresh_seconds["close"] = time.perf_counter() - t
        t = time.perf_counter()
        self._start_cluster()
        self.fresh_seconds["start"] = time.perf_counter() - t

    def close(self) -> None:
        self.sampler.stop()
        with contextlib.suppress(Exception):
            self.client.close()
        with contextlib.suppress(Exception):
            self.cluster.close()

    def fresh(self) -> None:
        """A new cluster with warmed workers for every strategy (the same resting memory for each).

        Not ``client.restart()``: about one benchmark run in three, with a Prefect
        server running beside it, the restarted worker processes never came back
        (a 120 s timeout), or came back and vanished before the next strategy's
        first task, which then waited forever; starting a new cluster never did.
        Its phases' seconds (close, start, warm imports, heartbeat wait) are left in ``fresh_seconds``
        (``python -m benchmarks.studies.setup_costs`` prints them).
        """
        self.fresh_seconds = {}
        for attempt in range(3):
            try:
                self._replace_cluster()
                self.client.wait_for_workers(self.n_workers, timeout=60)
                break
            except Exception:
                if attempt == 2:
                    raise
                print(f"  (the new cluster did not get its workers: another one, try {attempt + 2} of 3)", flush=True)
        t = time.perf_counter()
        self.client.run(warm_worker)
        self.fresh_seconds["warm"] = time.perf_counter() - t
        t = time.perf_counter()
        time.sleep(1.0)  # let heartbeats report the resting memory the runner budgets from
        self.fresh_seconds["heartbeats"] = time.perf_counter() - t

    def measure(self, name: str, fn: Callable[[], dict], *, fresh: bool = True) -> StrategyResult:
        """Run ``fn`` (returns completed, tasks, memory_errors, notes, extra) and measure it."""
        if fresh:
            self.fresh()
        self.sampler.window()
        t0 = time.time()
        t = time.perf_counter()
        try:
            out = fn()
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            out = {"completed": False, "tasks": 0, "memory_errors": 0,
                   "notes": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"}
        outer = time.perf_counter() - t
        # The strategy's own time, from its flow's first line to its last: the same for every strategy, and
        # free of Prefect's flow-run creation and of the heartbeat thread joined at flow exit (it sleeps in
        # 1 s steps, which quantized every outer wall to whole seconds). A failed run keeps the outer time.
        inner = out.get("seconds") if out.get("completed") else None
        wall = float(inner) if inner else outer
        time.sleep(0.5)  # a killed worker's pid vanishes within the sampler's refresh
        with contextlib.suppress(Exception):
            self.client.wait_for_workers(self.n_workers, timeout=60)
        peak, seen, vanished = self.sampler.snapshot()
        deaths = len(vanished)
        completed = bool(out.get("completed"))
        lost = killed_attempt_seconds(self.attempts_dir, vanished, t0)
        if not completed:
            lost = wall * self.slots
        res = StrategyResult(name=name, wall_seconds=wall, completed=completed,
                             oom_events=deaths + int(out.get("memory_errors", 0)), tasks=int(out.get("tasks", 0)),
                             lost_worker_seconds=lost, peak_memory_fraction=peak / self.memory_limit if peak else None,
                             notes=out.get("notes", ""), extra=dict(out.get("extra", {}), worker_deaths=deaths,
                                                                    outer_seconds=round(outer, 3)))
        print(f"  {name:<18} {'ok    ' if completed else 'FAILED'} {wall:8.1f} s  oom {res.oom_events}  "
              f"tasks {res.tasks}  lost {res.lost_worker_seconds:.1f} s  peak "
              f"{(res.peak_memory_fraction or 0):.2f} of limit  {res.notes}", flush=True)
        return res
