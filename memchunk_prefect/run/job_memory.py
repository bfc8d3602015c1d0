"""The memory a worker's job may hold and who else holds some of it: its memory cgroup, its batch system's
request, the kernel's OOM kills there, read on the worker (or its nanny) and summed up for the budget.

Where a job's limit is lower than Dask's ``memory_limit`` the kernel or the batch system kills the worker
before its nanny does, so the budget is derived from it (:func:`memchunk_prefect.core.budget.kill_line`).
:func:`job_memory` runs on a worker; :func:`read_job_memory` asks every worker from the flow's process;
:func:`run_on_nanny` asks a dead worker's nanny (:mod:`memchunk_prefect.run.batch`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from typing import Any, Callable, Mapping, Sequence

logger = logging.getLogger("memchunk_prefect.run.cluster")

#: A cgroup limit at or above this many bytes is no limit (cgroup v1 writes 2**63 less a page for "none").
NO_LIMIT_BYTES = 2**60

#: Environment variables that name the batch job a worker runs in, by batch system (what ``job_id`` reads).
JOB_ID_VARIABLES = (("slurm", "SLURM_JOB_ID"), ("pbs", "PBS_JOBID"), ("lsf", "LSB_JOBID"), ("sge", "JOB_ID"))


def memory_cgroup_dirs(proc_cgroup: str, root: str = "/sys/fs/cgroup") -> list[str]:
    """The directories of a process's memory cgroup and its ancestors, its own first, from the text of its
    ``/proc/PID/cgroup`` (cgroup v1: the ``memory`` line, under ``root/memory``; v2: the ``0::`` line, under
    ``root`` where it has a ``memory.max`` hierarchy). Empty where neither is mounted there."""
    v1 = v2 = None
    for line in proc_cgroup.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    if v1 is not None and os.path.isdir(os.path.join(root, "memory")):
        base, path = os.path.join(root, "memory"), v1
    elif v2 is not None and os.path.isfile(os.path.join(root, "cgroup.controllers")):
        base, path = root, v2
    else:
        return []
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    dirs = [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _read_first(directory: str, names: Sequence[str]) -> str | None:
    for name in names:
        with contextlib.suppress(OSError):
            with open(os.path.join(directory, name)) as fh:
                return fh.read()
    return None


def cgroup_limit(directory: str) -> int | None:
    """A memory cgroup's own limit, bytes (``memory.max`` in v2, ``memory.limit_in_bytes`` in v1); None: none."""
    text = _read_first(directory, ("memory.max", "memory.limit_in_bytes"))
    if text is None or text.strip() in ("", "max"):
        return None
    try:
        value = int(text.strip())
    except ValueError:
        return None
    return value if 0 < value < NO_LIMIT_BYTES else None


def cgroup_oom_kills(directory: str) -> int | None:
    """How many processes the kernel's OOM killer killed in a memory cgroup (the ``oom_kill`` line of
    ``memory.events`` in v2, of ``memory.oom_control`` in v1, where the kernel counts it); None: not readable."""
    text = _read_first(directory, ("memory.events", "memory.oom_control"))
    for line in (text or "").splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _rss_bytes(pid: int, proc: str) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(os.path.join(proc, str(pid), "statm")) as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0


def _cgroup_pids(directory: str) -> set[int]:
    pids: set[int] = set()
    for d, _, _ in os.walk(directory):
        text = _read_first(d, ("cgroup.procs",)) or ""
        pids.update(int(p) for p in text.split() if p.isdigit())
    return pids


def job_memory(root: str = "/sys/fs/cgroup", proc: str = "/proc",
               environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run on a worker: the memory its job may hold and who else holds some of it (bytes).

    - ``limit_bytes``: the lowest of its memory cgroup's limit (itself and its ancestors: a batch system sets it
      on the job's group, above the worker's) and the batch system's request (Slurm's ``SLURM_MEM_PER_NODE``, or
      ``SLURM_MEM_PER_CPU`` x ``SLURM_CPUS_ON_NODE``, MiB), None where neither is set; ``source``: which, in words;
    - ``others_bytes``: what the job's other processes hold (the nanny, the batch script): the resident memory of
      the other processes in the limiting cgroup, or, for a request with no cgroup, of this process's parent and
      its other children; they count against the same limit;
    - ``oom_kills``: the kernel's OOM kills in its cgroup (the largest count from its own group up to the limiting
      one; None where not counted); ``job_id`` / ``batch``: its batch job (:data:`JOB_ID_VARIABLES`), None outside
      one; ``cgroup``: the limiting group's directory; ``host``: this machine's name; ``cpus``: the cores this
      process may run on (its affinity), by number.

    Where the job's limit is lower than Dask's ``memory_limit`` the kernel or the batch system kills the worker
    before its nanny does: the budget is derived from it (:func:`memchunk_prefect.core.budget.kill_line`).
    ``root``, ``proc`` and ``environ`` are where it reads (a copy of those trees in tests).
    """
    env = os.environ if environ is None else environ
    try:
        with open(os.path.join(proc, "self", "cgroup")) as fh:
            dirs = memory_cgroup_dirs(fh.read(), root)
    except OSError:
        dirs = []
    limits = [(lim, d) for d in dirs if (lim := cgroup_limit(d)) is not None]
    limit, group = min(limits) if limits else (None, None)
    chain = dirs[:dirs.index(group) + 1] if group is not None else dirs[:1]
    counts = [c for d in chain if (c := cgroup_oom_kills(d)) is not None]
    out: dict[str, Any] = {"limit_bytes": limit, "source": "", "others_bytes": 0, "cgroup": group,
                           "oom_kills": max(counts) if counts else None, "job_id": None, "batch": None,
                           "host": socket.gethostname(), "cpus": _usable_cpus()}
    if limit is not None:
        name = "memory.max" if os.path.exists(os.path.join(str(group), "memory.max")) else "memory.limit_in_bytes"
        out["source"] = f"cgroup {name}"
    for system, variable in JOB_ID_VARIABLES:
        if env.get(variable):
            out["job_id"], out["batch"] = str(env[variable]), system
            break
    requested = _slurm_request_bytes(env)
    me = os.getpid()
    if requested is not None and (limit is None or requested < limit):
        out["limit_bytes"], out["source"], out["cgroup"] = requested, "Slurm --mem", None
        out["others_bytes"] = _family_rss(me)
    elif group is not None:
        out["others_bytes"] = sum(_rss_bytes(p, proc) for p in _cgroup_pids(group) if p != me)
    return out


def _slurm_request_bytes(env: Mapping[str, str]) -> int | None:
    """The memory a Slurm job asked for (``--mem``, ``--mem-per-cpu``), bytes; None outside a Slurm job."""
    with contextlib.suppress(ValueError):
        if env.get("SLURM_MEM_PER_NODE"):
            return int(env["SLURM_MEM_PER_NODE"]) * 2**20
        if env.get("SLURM_MEM_PER_CPU"):
            return int(env["SLURM_MEM_PER_CPU"]) * 2**20 * int(env.get("SLURM_CPUS_ON_NODE") or 1)
    return None


def _family_rss(me: int) -> int:
    """The resident memory of the process that started this worker (its nanny's) and that process's other
    descendants. A worker forked from a multiprocessing forkserver (:mod:`memchunk_prefect.run.worker_start`) is
    the server's child: the server's parent is the one that started it, and the server is among its descendants.
    """
    import psutil

    try:
        parent = psutil.Process(me).parent()
        if parent is not None and _is_forkserver(parent):
            parent = parent.parent() or parent
        if parent is None:
            return 0
        family = [parent, *(c for c in parent.children(recursive=True) if c.pid != me)]
    except psutil.Error:
        return 0
    total = 0
    for p in family:
        with contextlib.suppress(psutil.Error):
            total += int(p.memory_info().rss)
    return total


def _is_forkserver(process: Any) -> bool:
    """Whether ``process`` (a psutil process) is a multiprocessing forkserver (it runs ``forkserver.main``)."""
    import psutil

    try:
        return any("multiprocessing.forkserver" in part for part in process.cmdline())
    except psutil.Error:
        return False


def job_limits(jobs: Mapping[str, dict[str, Any]]) -> dict[str, tuple[int | None, int, str, int]]:
    """What :func:`memchunk_prefect.core.budget.workers_from_info` takes of the workers' :func:`job_memory`
    readings: ``(limit, others' bytes, source, workers sharing the limit)`` by worker address. Workers share a
    limit where they read the same cgroup on the same host (a job of several processes, a LocalCluster in a
    container), or the same batch job there where no cgroup limits it.

    >>> r = {"cgroup": "/sys/fs/cgroup/job_1", "host": "n1", "job_id": "1", "limit_bytes": 1000,
    ...      "others_bytes": 10, "source": "cgroup memory.max"}
    >>> job_limits({"a": r, "b": dict(r), "c": {**r, "host": "n2"}})["a"], job_limits({"c": r})["c"]
    ((1000, 10, 'cgroup memory.max', 2), (1000, 10, 'cgroup memory.max', 1))
    """
    def key(j: dict[str, Any]) -> tuple[Any, ...]:
        return (j.get("host"), j.get("cgroup") or ("job", j.get("job_id")))

    groups: dict[tuple[Any, ...], int] = {}
    for j in jobs.values():
        if j.get("limit_bytes") is not None:
            groups[key(j)] = groups.get(key(j), 0) + 1
    return {a: (j.get("limit_bytes"), int(j.get("others_bytes") or 0), str(j.get("source") or ""),
                groups.get(key(j), 1)) for a, j in jobs.items()}


def _usable_cpus() -> list[int]:
    """The CPU cores this process may run on (its affinity: a batch job's cpuset, ``taskset``), by number."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def read_job_memory(client: Any, workers: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`job_memory` of each worker (by address; empty when they cannot be asked)."""
    try:
        return {str(k): v for k, v in client.run(job_memory, workers=list(workers) if workers is not None
                                                  else None).items() if isinstance(v, dict)}
    except Exception as exc:  # noqa: BLE001 - no job limit read: the nanny's line is the budget's
        logger.info("could not read the workers' job memory: %r", exc)
        return {}


def run_on_nanny(client: Any, nanny: str, function: Callable[[], Any], timeout_s: float = 5.0) -> Any:
    """Call ``function()`` in the nanny process at ``nanny`` and return its result (its worker may be dead, so
    ``client.run(..., nanny=True)``, which goes through registered workers, cannot reach it). Raises what the
    call raised, or ``OSError`` / a timeout where the nanny does not answer."""
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps

    async def call() -> Any:
        async with rpc(nanny, timeout=timeout_s, connection_args=client.connection_args) as r:
            return await r.run(function=dumps(function))

    response = client.sync(call)
    if not isinstance(response, dict) or response.get("status") != "OK":
        raise RuntimeError(f"the nanny at {nanny} answered {response!r}")
    result = response.get("result")
    return getattr(result, "data", result)  # distributed's Serialize wrapper, where it arrives wrapped
