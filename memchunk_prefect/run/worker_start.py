"""How the workers of a local cluster the runner starts itself come to life: forked from one server process that
imported what a chunk's task run needs, instead of each spawned as a fresh interpreter that imports it all again.

Dask's nanny starts each worker process with ``distributed.worker.multiprocessing-method``, ``spawn`` by
default: a new interpreter that imports Dask, then, at its first task run, Prefect's task engine, the runner
and the volume layer (about 1.3 s of one core per worker on a 2-core machine). Every worker pays that again,
all at once, while the flow's process opens the model bank beside them, so on a machine where the workers take
every core the imports are what the first chunk waits for. With ``forkserver`` one server process, started
once by the first nanny, imports those modules (:data:`PRELOAD`) and forks each worker from itself: one
import for the whole cluster, and a worker that starts in tens of milliseconds (Python's
``multiprocessing`` "forkserver" start method; Dask documents the option for its nannies).

What a forked worker gets, and how it matches a spawned one:

- Dask's ``distributed.nanny.pre-spawn-environ`` (one BLAS/OpenMP thread, ``MALLOC_TRIM_THRESHOLD_``, a fixed
  ``PYTHONHASHSEED``) must be in a process's environment before it starts and before numpy is imported. The
  nanny puts them in this process's environment before it starts its first worker, and that start is what
  starts the server, so the server and every worker forked from it have them.
- The rest of the environment is the server's, which is this process's when the server started: a later
  flow run of the same process (a notebook, a scheduler loop) may have changed it. Each nanny is given this
  process's environment as it is when the cluster starts (``distributed.nanny.environ``, under any the user
  configured), which it sets in its worker, as a spawned worker would have it.
- Modules the server imported read their settings at import from its environment (Prefect's logging level,
  for one); a task run's Prefect settings travel with it, as they do to a spawned worker.
- The server lives as long as this process and holds what it imported (about 150 MiB); workers share those
  pages with it until they write to them.

Only where the runner starts the cluster itself, with worker processes, on a platform with ``forkserver``
(Linux, macOS), and only while that cluster starts: a worker the nanny restarts later (after an out-of-memory
kill) is started the way Dask's own configuration says. A method the user configured other than Dask's default
is kept. ``$MEMCHUNK_WORKER_START=spawn`` starts them as Dask does by default.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from typing import Any, Iterator, Mapping

import dask

from memchunk_prefect.core.errors import RunnerConfigError

START_ENV = "MEMCHUNK_WORKER_START"
FORKSERVER = "forkserver"
SPAWN = "spawn"
METHODS = (FORKSERVER, SPAWN)
METHOD_KEY = "distributed.worker.multiprocessing-method"
ENVIRON_KEY = "distributed.nanny.environ"

#: What the server imports before it forks a worker: Dask's worker, and what every chunk's task run imports on
#: its worker (:data:`memchunk_prefect.run.cluster.WORKER_MODULES`, and the module whose functions the runner
#: runs on the workers to read their memory). An operator's own module is imported by the worker, as before.
PRELOAD = ("distributed", "memchunk_prefect.run.cluster", "memchunk_prefect.run.worker",
           "memchunk_prefect.run.runner", "prefect.task_engine")


def requested_method(environ: Mapping[str, str] = os.environ) -> str:
    """The start method ``$MEMCHUNK_WORKER_START`` asks for (``forkserver`` when unset); RunnerConfigError
    naming the value for anything else.

    >>> requested_method({}), requested_method({"MEMCHUNK_WORKER_START": "Spawn"})
    ('forkserver', 'spawn')
    """
    value = (environ.get(START_ENV) or FORKSERVER).strip().lower()
    if value not in METHODS:
        raise RunnerConfigError(
            f"${START_ENV} is {environ.get(START_ENV)!r}: it must be 'forkserver' (fork the runner's local workers "
            "from one process that imported Prefect's task engine once) or 'spawn' (Dask's default: a fresh "
            f"interpreter per worker); unset it for the default")
    return value


def starts_workers(address: str | None, cluster_class: Any, cluster_kwargs: Mapping[str, Any] | None) -> bool:
    """Whether the runner starts this cluster's worker processes here, as plain Dask workers it may fork: no
    scheduler address, no cluster class but Dask's ``LocalCluster``, worker processes (``processes`` not
    False), and no worker ``preload`` (one runs first in a spawned worker, and may set what must be set before
    anything is imported, as the runner's own GPU pinning sets ``CUDA_VISIBLE_DEVICES``; a forked worker has
    imported :data:`PRELOAD` before it).

    >>> starts_workers(None, None, {"n_workers": 2}), starts_workers("tcp://h:8786", None, None)
    (True, False)
    >>> starts_workers(None, None, {"processes": False}), starts_workers(None, "dask_jobqueue.SLURMCluster", {})
    (False, False)
    >>> starts_workers(None, None, {"preload": ["memchunk_prefect.run.pinning"]})
    False
    """
    if address is not None:
        return False
    if cluster_class is not None:
        name = cluster_class if isinstance(cluster_class, str) else \
            f"{getattr(cluster_class, '__module__', '')}.{getattr(cluster_class, '__qualname__', '')}"
        if name not in ("distributed.LocalCluster", "distributed.deploy.local.LocalCluster"):
            return False
    kwargs = cluster_kwargs or {}
    return kwargs.get("processes", True) is not False and not kwargs.get("preload")


def method_for(address: str | None, cluster_class: Any, cluster_kwargs: Mapping[str, Any] | None,
               environ: Mapping[str, str] = os.environ) -> str | None:
    """The start method to set while the runner starts this cluster, or None to leave Dask's configuration as it
    is: a cluster the runner does not start, a method the user configured (anything but Dask's default,
    ``spawn``), ``$MEMCHUNK_WORKER_START=spawn``, or no ``forkserver`` on this platform."""
    if not starts_workers(address, cluster_class, cluster_kwargs):
        return None
    wanted = requested_method(environ)
    if wanted != FORKSERVER or dask.config.get(METHOD_KEY, SPAWN) != SPAWN:
        return None
    return FORKSERVER if FORKSERVER in multiprocessing.get_all_start_methods() else None


@contextlib.contextmanager
def starting_workers(address: str | None, cluster_class: Any, cluster_kwargs: Mapping[str, Any] | None) -> Iterator[
        str | None]:
    """Around the start of a cluster: its workers forked from a server that preloaded :data:`PRELOAD`, each given
    this process's environment (see the module's docstring); yields the method set, or None (nothing changed)."""
    method = method_for(address, cluster_class, cluster_kwargs)
    if method is None:
        yield None
        return
    environ = {**os.environ, **(dask.config.get(ENVIRON_KEY, None) or {})}
    with dask.config.set({METHOD_KEY: method, ENVIRON_KEY: environ}):
        _preload()
        yield method


def _preload() -> None:
    """Make the server import :data:`PRELOAD` when it starts (a server already running keeps what it imported).

    Dask sets a list of its own the first time it asks for the forkserver context in a process, importing
    every package it names here first to see which are installed: pandas among them, half a second of this
    process's time while its workers start. Its flag that the list is set is set here too, so it keeps this one.
    """
    from distributed import utils

    multiprocessing.get_context(FORKSERVER).set_forkserver_preload(list(PRELOAD))
    if hasattr(utils, "_forkserver_preload_set"):
        utils._forkserver_preload_set = True
