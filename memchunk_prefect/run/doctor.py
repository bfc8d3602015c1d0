"""What the runner relies on, checked before anything runs: ``memchunk doctor`` and the demo's preflight.

Each check returns a :class:`Check`: ``ok``, ``warn`` (the run works, less well:
say why and the fix) or ``fail`` (a run cannot work: stop before starting
anything). :func:`run_checks` is ``memchunk doctor``; :func:`preflight` runs the
checks a run cannot do without (Prefect home and database, the API when one is
configured, the store, the output directory) and raises
:class:`~memchunk_prefect.core.errors.EnvironmentProblemError` naming each failure and its fix,
in seconds, instead of Prefect retrying a temporary server that cannot start for
minutes.

>>> Check("store", FAIL, "read-only", "set MEMCHUNK_STORE").line()
'FAIL  store: read-only -> set MEMCHUNK_STORE'
"""

from __future__ import annotations

import os
import platform
import sys
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from memchunk_prefect.core.errors import EnvironmentProblemError, MemchunkError, format_bytes
from memchunk_prefect.core.sharing import SLOT_RESOURCE
from memchunk_prefect.operators.device import INSTALL_HINT, gpu_status
from memchunk_prefect.run.prefect_api import startup_timeout_seconds

OK, WARN, FAIL = "ok", "warn", "fail"
DISTRIBUTION = "memchunk-prefect"
#: Seconds to wait for a configured Prefect API's health endpoint or a Dask scheduler before calling it unreachable.
REACH_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True)
class Check:
    """One thing the runner relies on: ``status`` ok / warn / fail, what was found, and the fix (empty when ok)."""

    name: str
    status: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        return f"{self.status.upper():<4}  {self.name}: {self.detail}" + (f" -> {self.fix}" if self.fix else "")

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def blocking(checks: Iterable[Check]) -> list[Check]:
    """The checks that stop a run."""
    return [c for c in checks if c.status == FAIL]


# --------------------------------------------------------------------------- files


def writable_dir(path: Path, parents: bool = True) -> str | None:
    """None when files can be written in directory ``path`` (or it can be created), else why not.

    Changes nothing: an existing directory is tested by creating and removing a
    file in it (``os.access`` says yes to root on a read-only mount); a missing one
    by the same test in its nearest existing ancestor. ``parents=False``: ``path``
    may be created only where its parent exists (as Prefect creates its home).
    """
    if path.exists():
        return None if _can_write_in(path) is None else f"cannot write in it ({_can_write_in(path)})"
    if not parents and not path.parent.is_dir():
        return f"cannot create it: {path.parent} does not exist" if not path.parent.exists() else \
            f"cannot create it: {path.parent} is not a directory"
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    problem = _can_write_in(ancestor)
    return None if problem is None else f"cannot create it: {ancestor}: {problem}"


def _can_write_in(directory: Path) -> str | None:
    if not directory.is_dir():
        return "not a directory"
    probe = directory / f".memchunk-write-check-{uuid.uuid4().hex}"
    try:
        probe.touch()
        probe.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def check_path(name: str, directory: Path, fix: str, what: str = "", parents: bool = True) -> Check:
    problem = writable_dir(directory, parents)
    if problem:
        return Check(name, FAIL, f"{directory}: {problem}", fix)
    return Check(name, OK, f"{directory} is writable" + (f" ({what})" if what else ""))


# --------------------------------------------------------------------------- versions


def check_versions() -> list[Check]:
    """Python, and every installed requirement of memchunk-prefect against its declared range (the prefect and
    fastapi pins among them: Prefect's server does not import with fastapi >= 0.151)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    checks = []
    py = platform.python_version()
    checks.append(Check("python", OK if sys.version_info >= (3, 10) else FAIL, f"{py} ({sys.executable})",
                        "" if sys.version_info >= (3, 10) else "use Python 3.10 or newer"))
    try:
        requires = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return [*checks, Check("packages", FAIL, f"{DISTRIBUTION} is not installed in this environment",
                               "pip install -e . (from the repository)")]
    wrong, seen = [], []
    for text in requires:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra's requirement
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{req.name} missing (needs {req.specifier or 'any'})")
            continue
        seen.append(f"{req.name} {have}")
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            wrong.append(f"{req.name} {have} (needs {req.specifier})")
    if wrong:
        checks.append(Check("packages", FAIL, "; ".join(wrong),
                            f"pip install -e . (or pip install '{DISTRIBUTION}') for the versions it was tested with"))
    else:
        key = [s for s in seen if s.split()[0] in ("prefect", "prefect-dask", "fastapi", "dask", "distributed")]
        checks.append(Check("packages", OK, f"{len(seen)} requirements in range ({', '.join(key)})"))
    return checks


# --------------------------------------------------------------------------- Prefect


def _prefect_settings() -> Any:
    from prefect.settings import get_current_settings

    return get_current_settings()


def sqlite_path(connection_url: str) -> Path | None:
    """The file of a SQLite connection URL (None for another database or an in-memory one).

    >>> sqlite_path("sqlite+aiosqlite:////home/u/.prefect/prefect.db")
    PosixPath('/home/u/.prefect/prefect.db')
    >>> sqlite_path("postgresql+asyncpg://u:p@db/prefect") is None
    True
    """
    if not connection_url.startswith("sqlite"):
        return None
    _, _, rest = connection_url.partition(":///")
    rest = rest.split("?", 1)[0]
    if not rest or rest == ":memory:":
        return None
    return Path(rest)


def check_prefect_home(settings: Any = None) -> Check:
    settings = settings or _prefect_settings()
    return check_path("prefect home", Path(settings.home),
                      "set PREFECT_HOME to a directory you can write (e.g. export PREFECT_HOME=$PWD/.prefect)",
                      "PREFECT_HOME: profiles, the temporary server's database, the default store", parents=False)


def check_prefect_api(settings: Any = None, timeout: float = REACH_TIMEOUT_SECONDS) -> Check:
    """A configured API answers its health endpoint; with none, the temporary server's database can be written."""
    settings = settings or _prefect_settings()
    url = settings.api.url
    if not url:
        db = sqlite_path(str(settings.server.database.connection_url.get_secret_value()
                             if hasattr(settings.server.database.connection_url, "get_secret_value")
                             else settings.server.database.connection_url))
        where = f"its database {db}" if db else "its database"
        if db is not None:
            problem = writable_dir(db.parent, parents=db.parent != Path(settings.home))
            if problem is None and db.exists() and not os.access(db, os.W_OK):
                problem = "the database file is read-only"
            if problem:
                return Check("prefect api", FAIL,
                             f"no PREFECT_API_URL, so each flow starts a temporary Prefect server, and {where} "
                             f"cannot be written: {db.parent}: {problem}",
                             "set PREFECT_HOME to a writable directory, or point PREFECT_API_URL at a running server "
                             "(memchunk ui)")
        timeout_s = startup_timeout_seconds()
        return Check("prefect api", OK,
                     f"no PREFECT_API_URL: each flow starts a temporary Prefect server ({where}, startup timeout "
                     f"{timeout_s:g} s); to watch runs live, run `memchunk ui` and set "
                     "PREFECT_API_URL=http://127.0.0.1:4200/api")
    import httpx

    health = f"{str(url).rstrip('/')}/health"
    headers, auth = {}, None
    key = settings.api.key.get_secret_value() if getattr(settings.api, "key", None) else None
    if key:  # Prefect Cloud
        headers["Authorization"] = f"Bearer {key}"
    auth_string = getattr(settings.api, "auth_string", None)
    auth_string = auth_string.get_secret_value() if auth_string else None
    if auth_string and ":" in auth_string:  # a self-hosted server with basic auth (PREFECT_API_AUTH_STRING)
        auth = tuple(auth_string.split(":", 1))
    try:
        response = httpx.get(health, timeout=timeout, headers=headers, auth=auth)
        response.raise_for_status()
    except Exception as exc:  # noqa: BLE001 - any failure to reach it is the finding
        return Check("prefect api", FAIL, f"PREFECT_API_URL={url} does not answer ({type(exc).__name__}: {exc})",
                     "start that server (`memchunk ui`, or `prefect server start`), or unset PREFECT_API_URL to "
                     "use a temporary server per flow")
    return Check("prefect api", OK, f"{url} answers")


# --------------------------------------------------------------------------- store and outputs


def check_store(path: str | os.PathLike | None = None) -> Check:
    """The observation store: where it is, that it can be written, its size, schema version and keys.

    Read-only: the file is opened with SQLite's ``mode=ro`` (a run would migrate an
    older schema; the doctor only says so).
    """
    import sqlite3

    from memchunk_prefect.learn.store import SCHEMA_VERSION, default_store_path

    p = Path(path).expanduser() if path is not None else default_store_path()
    fix = "set MEMCHUNK_STORE (or the runner's store=, or --store) to a file in a directory you can write"
    problem = writable_dir(p.parent)
    if problem:
        return Check("store", FAIL, f"{p}: {p.parent}: {problem}", fix)
    if not p.exists():
        return Check("store", OK, f"{p} (new: created at the first run; schema {SCHEMA_VERSION})")
    if p.is_dir():
        return Check("store", FAIL, f"{p} is a directory", fix)
    if not os.access(p, os.W_OK):
        return Check("store", FAIL, f"{p} is read-only", fix)
    size = format_bytes(p.stat().st_size)
    error: sqlite3.Error | None = None
    try:
        # Without a -wal file beside it, immutable=1: no lock and no -wal / -shm files left behind (a WAL store
        # opened read-only still makes them). With one (a flow has it open, or did not checkpoint), a plain
        # read-only open, which reads what the WAL holds; its -wal / -shm exist already.
        wal = Path(f"{p}-wal")
        flags = "mode=ro" if wal.exists() and wal.stat().st_size > 0 else "mode=ro&immutable=1"
        con = sqlite3.connect(f"file:{p}?{flags}", uri=True, timeout=5.0)
        try:
            tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            version = int(con.execute("PRAGMA user_version").fetchone()[0])
            n = (con.execute("SELECT COUNT(DISTINCT operator_key) FROM observations").fetchone()[0]
                 if "observations" in tables else None)
        finally:
            con.close()
    except sqlite3.Error as exc:
        tables, version, n, error = set(), 0, None, exc
    if n is None:
        if not tables and error is None:
            # Empty: another flow is creating it at this moment (a run waits its turn), or it was never used.
            return Check("store", OK, f"{p} ({size}, empty: a run creates its tables)")
        # Not a memchunk store (corrupt, or another program's database): a run moves it aside, keeps it, and
        # starts a new store there (store.StoreMovedAsideWarning); nothing stops the run.
        why = f"({error})" if error is not None else f"(its tables: {', '.join(sorted(tables))})"
        return Check("store", WARN, f"{p} is not a memchunk store {why}: a run moves it aside and starts a new one "
                     "there", "point MEMCHUNK_STORE at the right file if this is not expected")
    if version > SCHEMA_VERSION:
        return Check("store", FAIL, f"{p} has schema {version}, newer than the {SCHEMA_VERSION} this version reads",
                     "upgrade memchunk-prefect, or point MEMCHUNK_STORE at another file")
    note = "" if version == SCHEMA_VERSION else f", migrated to {SCHEMA_VERSION} at the next run"
    return Check("store", OK, f"{p} ({size}, schema {version}{note}, {n} operator key(s))")


def check_output_dir(path: str | os.PathLike | None = None) -> Check:
    from memchunk_prefect.run.outputs import default_output_dir

    return check_path("outputs", default_output_dir(path),
                      "set MEMCHUNK_OUTPUT_DIR (or the runner's output_dir=, or chunked(..., output=)) to a "
                      "writable directory", "where chunked maps write their zarr stores by default")


# --------------------------------------------------------------------------- cluster


def check_cluster(address: str | None, timeout: float = REACH_TIMEOUT_SECONDS,
                  memory_reuse: bool = False) -> list[Check]:
    """What the runner reads from a Dask cluster: memory limits, threads, kill and pause lines, allowed-failures,
    resting memory, and with ``memory_reuse`` what reusing freed memory costs its machines
    (:func:`check_memory_reuse_on_workers`; a warning where the checks stop before it). Without ``address``: what
    the runner would start locally (``memory_reuse`` is then :func:`run_checks`' to measure here)."""
    if address is None:
        from distributed.system import MEMORY_LIMIT

        from memchunk_prefect.run.cluster import default_cluster_kwargs

        kw = default_cluster_kwargs()
        # LocalCluster's memory_limit="auto": the machine's memory (or cgroup limit) split evenly among workers.
        each = kw.get("memory_limit") or MEMORY_LIMIT // kw["n_workers"]
        return [Check("cluster", OK, f"no --address: the runner starts a local cluster of {kw['n_workers']} "
                      f"worker process(es) x {kw['threads_per_worker']} thread, {format_bytes(each)} memory limit "
                      "each; check an existing scheduler with --address tcp://HOST:8786")]
    from distributed import Client


    try:
        client = Client(address, timeout=timeout, set_as_default=False)
    except Exception as exc:  # noqa: BLE001 - unreachable is the finding
        unreachable = [Check("cluster", FAIL, f"cannot connect to {address} ({type(exc).__name__}: {exc})",
                             "start the scheduler (dask scheduler) or correct --address / the runner's address=")]
        return unreachable + (_unmeasured_reuse(unreachable, address) if memory_reuse else [])
    checks: list[Check] = []
    try:
        checks = _cluster_checks(client, address, memory_reuse)
    except Exception as exc:  # noqa: BLE001 - a scheduler or worker that refuses: the finding, not a traceback
        checks.append(Check("cluster", FAIL, f"{address} answered, then failed while being checked "
                            f"({type(exc).__name__}: {exc})", "check the scheduler's and workers' logs"))
    finally:
        client.close()
    return checks + (_unmeasured_reuse(checks, address) if memory_reuse else [])


def _cluster_checks(client: Any, address: str, memory_reuse: bool = False) -> list[Check]:
    from memchunk_prefect.core.budget import allowed_failures_warning
    from memchunk_prefect.run import cluster as _cluster

    checks: list[Check] = []
    info = _cluster.scheduler_info(client)
    workers = info.get("workers", {})
    if not workers:
        return [Check("cluster", FAIL, f"{address} has no workers",
                      f"start workers: dask worker {address} --nthreads 1 --memory-limit 4GiB")]
    checks.append(Check("cluster", OK, f"{address}: {len(workers)} worker(s)"))
    no_limit = sorted(a for a, w in workers.items() if not w.get("memory_limit"))
    checks.append(Check("memory limits", FAIL, f"{len(no_limit)} of {len(workers)} worker(s) have no memory_limit "
                        f"({', '.join(no_limit[:3])}{', ...' if len(no_limit) > 3 else ''}): the runner has "
                        "no budget to plan within, and nothing stops a worker before the kernel's OOM killer",
                        "start workers with --memory-limit (e.g. dask worker ADDR --memory-limit 4GiB) or "
                        "LocalCluster(memory_limit=...)") if no_limit else
                  Check("memory limits", OK, ", ".join(sorted({format_bytes(w["memory_limit"])
                                                               for w in workers.values()})) + " per worker"))
    threads = sorted({int(w.get("nthreads", 1)) for w in workers.values()})
    offer = sorted({str((w.get("resources") or {}).get(SLOT_RESOURCE)) for w in workers.values()})
    checks.append(Check("threads", WARN, f"threads per worker {threads}: tasks sharing a worker share its "
                        "memory, so each one's peak cannot be told apart (figures are marked shared) and "
                        "the budget is split among them; an operator needing more than a thread's share runs "
                        f"one task per worker ({SLOT_RESOURCE} offered: {', '.join(offer)})",
                        "one thread per worker process (dask worker --nthreads 1, or "
                        "LocalCluster(threads_per_worker=1)); else start workers with --resources "
                        f"{SLOT_RESOURCE}=THREADS, so that no chunk runs beside one that runs alone")
                  if max(threads) > 1 else Check("threads", OK, "1 thread per worker"))
    fractions = client.run(lambda: {k: __import__("dask").config.get(f"distributed.worker.memory.{k}", None)
                                    for k in ("terminate", "pause")})
    terminate = sorted({str(f["terminate"]) for f in fractions.values()})
    pause = sorted({str(f["pause"]) for f in fractions.values()})
    never = [a for a, f in fractions.items() if f["terminate"] in (None, False)]
    checks.append(Check("kill line", WARN, f"{len(never)} worker(s) have no nanny kill line "
                        "(distributed.worker.memory.terminate false): the budget falls back to the memory "
                        "limit and a task over it meets the kernel's OOM killer",
                        "keep the nanny's terminate fraction (default 0.95)") if never else
                  Check("kill line", OK, f"nanny terminates at {', '.join(terminate)} of memory_limit; pauses "
                        f"at {', '.join(pause)}"))
    allowed = _cluster.read_allowed_failures(client)
    message = allowed_failures_warning(allowed, address)
    checks.append(Check("allowed-failures", WARN, message.split(". Start")[0],
                        "start that scheduler with DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=0") if message
                  else Check("allowed-failures", OK, f"{allowed if allowed is not None else 'unknown'}"))
    resting = _cluster.read_resting(client)
    if resting:
        worst = max(resting.items(), key=lambda kv: kv[1] / max(1, workers.get(kv[0], {}).get("memory_limit")
                                                                 or 1))
        limit = workers.get(worst[0], {}).get("memory_limit") or 0
        share = worst[1] / limit if limit else None
        status = WARN if share is not None and share > 0.5 else OK
        checks.append(Check("resting memory", status,
                            f"up to {format_bytes(worst[1])} per worker after the runner's imports"
                            + (f" ({share:.0%} of its limit)" if share is not None else ""),
                            "give workers more memory: more than half the limit is taken before any task runs"
                            if status == WARN else ""))
    if memory_reuse:
        checks.append(check_memory_reuse_on_workers(client, workers))
    return checks


def _unmeasured_reuse(checks: list[Check], address: str) -> list[Check]:
    """The memory reuse check's line where the cluster's checks stopped before it (no scheduler, no workers)."""
    if any(c.name == "memory reuse" for c in checks):
        return []
    return [Check("memory reuse", WARN, f"not measured: the checks of {address} stopped before it",
                  "fix what the cluster check says, then run doctor --memory-reuse again")]


# --------------------------------------------------------------------------- GPU and energy counters


def check_gpu() -> list[Check]:
    checks = []
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            n = pynvml.nvmlDeviceGetCount()
            names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(n)]
        finally:
            pynvml.nvmlShutdown()
        checks.append(Check("gpu (nvml)", OK, f"{n} GPU(s): {', '.join(map(str, names)) or 'none'}"))
    except Exception as exc:  # noqa: BLE001 - no driver, no library, no device
        checks.append(Check("gpu (nvml)", WARN, f"NVML not available ({type(exc).__name__}: {exc}): no GPU memory "
                            "or GPU energy is measured", "only needed on GPU workers: install the NVIDIA driver"))
    try:
        status = gpu_status()  # what device="auto" / "cuda" will find in this process (operators.device)
    except MemchunkError as exc:  # a malformed MEMCHUNK_FAKE_GPU_BYTES
        checks.append(Check("gpu (cupy)", FAIL, str(exc)))
        return checks
    if status.usable:
        checks.append(Check("gpu (cupy)", OK, f"operators can run with device='cuda': {status.why}"))
    else:
        why = status.why.replace(f"; {INSTALL_HINT}", "")
        checks.append(Check("gpu (cupy)", WARN, f"no usable GPU for operators: {why}; device='auto' runs "
                            "them on the CPU", "only needed for GPU operators: " + INSTALL_HINT))
    return checks


def check_energy() -> Check:
    """RAPL (Linux powercap) readable: the CPU package energy counter per task."""
    import glob

    from memchunk_prefect.run.gpu_energy import _RAPL_GLOB

    zones = sorted(glob.glob(_RAPL_GLOB))
    readable = [z for z in zones if os.access(os.path.join(z, "energy_uj"), os.R_OK)]
    if readable:
        try:
            with open(os.path.join(readable[0], "energy_uj")) as fh:
                int(fh.read())
            return Check("energy (rapl)", OK, f"{len(readable)} RAPL zone(s) readable")
        except (OSError, ValueError):
            pass
    detail = ("no RAPL zones (/sys/class/powercap/intel-rapl:*)" if not zones
              else f"{len(zones)} RAPL zone(s), energy_uj not readable by this user")
    return Check("energy (rapl)", WARN, f"{detail}: no CPU energy is measured per task",
                 "" if not zones else "make energy_uj readable (chmod o+r /sys/class/powercap/intel-rapl:*/energy_uj)")


# --------------------------------------------------------------------------- memory reuse

#: Memory touched by the reuse check, bytes: large enough that the kernel's cost per byte shows, small enough that
#: a machine that pays the host 10 s per GiB spends about a second on it.
REUSE_BYTES = 128 * 2**20
#: Seconds the reuse check leaves its memory free: longer than the 2 s after which Linux reports free pages to a
#: VM's host (``page_reporting_delay`` in mm/page_reporting.c).
REUSE_GAP_SECONDS = 2.5
#: A touch after the gap that costs this many times more than one right after a release, and at least
#: :data:`REUSE_SECONDS_PER_GIB` per GiB, makes the check warn.
REUSE_RATIO = 5.0
REUSE_SECONDS_PER_GIB = 1.0
#: Gaps the reuse check times, the dearest counting: not every release has been handed to the host by the next
#: touch (the kernel reports free pages in passes, not page by page), so one gap of 2.5 s in a fresh process read
#: 0.16 s per GiB in 1 of 4 tries on a machine where the others read 4.9-7.2 (and 1 of 4 with a gap of 4 s).
REUSE_ROUNDS = 3


def touch_memory(nbytes: int) -> tuple[float, float]:
    """Wall seconds and the process's kernel CPU seconds to allocate, write and free ``nbytes`` (fresh pages: the
    kernel faults and zeroes them)."""
    import resource
    import time

    import numpy as np

    k0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    t0 = time.perf_counter()
    block = np.ones(int(nbytes), dtype=np.uint8)
    seconds = time.perf_counter() - t0
    kernel = resource.getrusage(resource.RUSAGE_SELF).ru_stime - k0
    del block
    return seconds, kernel


def measure_memory_reuse(nbytes: int = REUSE_BYTES, gap_seconds: float = REUSE_GAP_SECONDS,
                         touch: Callable[[int], tuple[float, float]] = touch_memory,
                         sleep: Callable[[float], None] | None = None,
                         rounds: int = REUSE_ROUNDS) -> tuple[float, float]:
    """Wall seconds per GiB to touch ``nbytes`` right after the same amount was released (the median of
    ``rounds``), and after it was left free ``gap_seconds`` (the dearest of ``rounds``): touches it once, then each
    round twice, once right after the previous touch released it and once after the gap. ``touch``
    (:func:`touch_memory`'s wall and kernel seconds for a number of bytes) and ``sleep`` are the seams a test
    replaces. Runs where it is called: in ``memchunk doctor``'s process, or as a task on a cluster's worker
    (:func:`check_memory_reuse_on_workers`)."""
    import statistics
    import time

    sleep = time.sleep if sleep is None else sleep
    gib = nbytes / 2**30
    touch(nbytes)
    recent, idle = [], []
    for _ in range(max(1, int(rounds))):
        recent.append(touch(nbytes)[0] / gib)
        sleep(gap_seconds)
        idle.append(touch(nbytes)[0] / gib)
    return statistics.median(recent), max(idle)


def judge_memory_reuse(recent: float, idle: float, nbytes: int = REUSE_BYTES,
                       gap_seconds: float = REUSE_GAP_SECONDS, where: str = "") -> Check:
    """The memory reuse check from :func:`measure_memory_reuse`'s figures (seconds per GiB right after a release,
    and the dearest after ``gap_seconds`` free): a warning where the touch after the gap costs :data:`REUSE_RATIO`
    times the other and at least :data:`REUSE_SECONDS_PER_GIB`. ``where`` names the machine measured ("" for this
    one)."""
    detail = (f"{where}{format_bytes(nbytes)} touched again took up to {idle:.2f} s per GiB after {gap_seconds:g} s "
              f"free, {recent:.2f} s per GiB right after its release")
    if idle >= REUSE_SECONDS_PER_GIB and idle >= REUSE_RATIO * recent:
        return Check("memory reuse", WARN,
                     f"{detail}: the machine gives freed memory back to its host, so a task's time depends on "
                     "what ran seconds before it, which no model sees",
                     "book deadlines with the margin `memchunk simulate --track-record` measures on your store, or "
                     "run on machines that keep freed memory (a VM without free page reporting on its balloon "
                     "device)")
    return Check("memory reuse", OK, f"{detail}: freed memory stays cheap to reuse")


def check_memory_reuse(nbytes: int = REUSE_BYTES, gap_seconds: float = REUSE_GAP_SECONDS,
                       touch: Callable[[int], tuple[float, float]] = touch_memory,
                       sleep: Callable[[float], None] | None = None, rounds: int = REUSE_ROUNDS) -> Check:
    """Whether memory freed a few seconds ago costs much more to touch again, on this machine, than memory freed an
    instant ago (:func:`measure_memory_reuse`, :func:`judge_memory_reuse`).

    A virtual machine whose kernel reports freed pages to its host (free page reporting on a virtio-balloon
    device) gives them up about 2 s after they are freed; touching that memory again pays the host. Where that
    happens a task's time depends on what ran on the machine seconds before it: the time model sees it as spread,
    and simulations of flows that build large blocks miss by more (``python -m benchmarks.studies.idle_memory``
    measures it by gap). About ``rounds`` x ``gap_seconds`` plus a few seconds; only on request (``memchunk doctor
    --memory-reuse``; with ``--address``, on the cluster's workers instead: :func:`check_memory_reuse_on_workers`)."""
    return judge_memory_reuse(*measure_memory_reuse(nbytes, gap_seconds, touch, sleep, rounds), nbytes, gap_seconds)


def machine_identity() -> str:
    """What tells one machine's memory from another's: the kernel's boot id (containers and workers under one kernel
    share its free pages, whatever address each binds to), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip() or platform.node()
    except OSError:
        return platform.node()


def check_memory_reuse_on_workers(client: Any, workers: dict[str, dict[str, Any]], nbytes: int = REUSE_BYTES,
                                  gap_seconds: float = REUSE_GAP_SECONDS,
                                  timeout: float = REUSE_ROUNDS * REUSE_GAP_SECONDS + 60.0) -> Check:
    """:func:`check_memory_reuse` where the tasks run: one worker of each machine among ``workers`` (the scheduler's
    ``workers`` info, by address; machines told apart by :func:`machine_identity`) measures as a task, the
    machines at once (two workers of one machine would take each other's freed memory). The check is the dearest
    machine's among those that warn, else among all (the highest cost after the gap), saying how many give freed
    memory back; a worker that did not measure within ``timeout`` seconds, or failed to (memchunk-prefect missing
    there, the worker gone), is named beside it."""
    identities = client.run(machine_identity, workers=sorted(workers))
    one_per_machine: dict[str, str] = {}
    for address in sorted(identities):
        one_per_machine.setdefault(identities[address], address)
    futures = {address: client.submit(measure_memory_reuse, nbytes, gap_seconds, workers=[address],
                                      allow_other_workers=False, pure=False)
               for address in one_per_machine.values()}
    judged: dict[str, Check] = {}  # by the measuring worker's address: two machines may share a host name
    figures: dict[str, tuple[float, float]] = {}
    failed: list[str] = []
    for address, future in futures.items():
        host = str(workers.get(address, {}).get("host") or address)
        try:
            figures[address] = future.result(timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot measure: the finding, not a traceback
            failed.append(f"{address} ({type(exc).__name__}: {exc})")
            continue
        judged[address] = judge_memory_reuse(*figures[address], nbytes, gap_seconds, where=f"on host {host}: ")
    unmeasured = (f"; not measured on {len(failed)} worker(s): {', '.join(failed)}" if failed else "")
    if not judged:
        return Check("memory reuse", WARN, f"no worker measured memory reuse{unmeasured}",
                     "check those workers' logs: each needs memchunk-prefect installed and a free thread")
    dearest = max(judged, key=lambda a: (judged[a].status == WARN, figures[a][1]))
    warned = sum(c.status == WARN for c in judged.values())
    check = judged[dearest]
    status = WARN if failed else check.status
    return Check(check.name, status, f"{warned} of {len(judged)} machine(s) give freed memory back; the dearest: "
                 f"{check.detail}{unmeasured}", check.fix or ("check the workers named: each needs memchunk-prefect "
                                                              "installed and a free thread" if failed else ""))


# --------------------------------------------------------------------------- together


def run_checks(*, address: str | None = None, store: str | os.PathLike | None = None,
               output_dir: str | os.PathLike | None = None, memory_reuse: bool = False) -> list[Check]:
    """Every check, in the order ``memchunk doctor`` prints them; the memory reuse check (about 10 s) only with
    ``memory_reuse``: on the cluster's machines with ``address`` (:func:`check_memory_reuse_on_workers`), else on
    this machine (:func:`check_memory_reuse`), which is where the runner's own local cluster runs."""
    checks = check_versions()
    settings = _prefect_settings()
    checks += [check_prefect_home(settings), check_prefect_api(settings), check_store(store),
               check_output_dir(output_dir)]
    checks += check_cluster(address, memory_reuse=memory_reuse)
    checks += check_gpu()
    checks.append(check_energy())
    if memory_reuse and address is None:
        checks.append(check_memory_reuse())
    return checks


def preflight(*, store: str | os.PathLike | None = None, output_dir: str | os.PathLike | None = None,
              extra: Sequence[Check] = ()) -> list[Check]:
    """The checks a run cannot do without; raises :class:`EnvironmentProblemError` naming every failure and fix."""
    settings = _prefect_settings()
    checks = [check_prefect_home(settings), check_prefect_api(settings), check_store(store),
              check_output_dir(output_dir), *extra]
    failed = blocking(checks)
    if failed:
        raise EnvironmentProblemError("cannot start, nothing was run:\n" + "\n".join(f"  {c.line()}" for c in failed))
    return checks


def fail_fast_without_a_database() -> None:
    """With no Prefect API configured, a flow starts a temporary server on a SQLite file under the Prefect home;
    where that cannot be written the server never starts and Prefect retries it for minutes with thousands of
    lines of tracebacks. Say so at once, with the path and the fix (:class:`EnvironmentProblemError`)."""
    from prefect.settings import get_current_settings

    if get_current_settings().api.url:
        return  # a configured server: reaching it is Prefect's to report (``memchunk doctor`` checks it)
    check = check_prefect_api()
    if check.status == FAIL:
        raise EnvironmentProblemError(f"{check.detail}; {check.fix}")
