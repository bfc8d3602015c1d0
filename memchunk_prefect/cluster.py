"""What the Dask cluster says about memory: worker slots, memory limits, resting memory, the nanny's kill line.

Read from the live cluster at every chunked map (workers' resting memory grows
once Prefect and the operators are imported on them; adaptive clusters change
size), through the client. The arithmetic over what was read is pure
(:func:`workers_from_info`, :func:`kill_headroom_bytes`, :func:`task_budget`) and
tested with plain dicts.

The kill line. A worker's nanny kills it when its process memory crosses
``distributed.worker.memory.terminate`` (default 0.95) of its ``memory_limit``,
checked every ``distributed.worker.memory.monitor-interval`` (100 ms). That
fraction is the nanny's own setting: on a cluster the runner starts it is this
process's Dask configuration (:func:`configured_kill_fraction`); on a cluster
started elsewhere it is read from each nanny (:func:`read_kill_fractions`) and
this process's value is used only where a nanny cannot be asked. ``False``
(the nanny never kills) reads as None.

What it does not cover: choosing a budget from these figures (``policy.py``)
and starting clusters (``runner.py``).
"""

from __future__ import annotations

import inspect
import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping

import dask

from . import policy
from .errors import RunnerConfigError
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
    value = dask.config.get(TERMINATE_KEY, default=None)
    if value is None or value is False:
        return None
    return float(value)


def read_kill_fractions(client: Any) -> dict[str, float | None]:
    """Each nanny's own kill fraction, by nanny address (empty when the nannies cannot be asked).

    The function runs on the nannies by value (a lambda), so they need not have
    memchunk installed.
    """
    try:
        found = client.run(lambda dask_worker: dask_worker.memory_manager.memory_terminate_fraction, nanny=True)
    except Exception as exc:  # noqa: BLE001 - workers without nannies, or a cluster that refuses client.run
        logger.info("could not read the nannies' kill fraction: %r", exc)
        return {}
    return {str(k): (None if v is None or v is False else float(v)) for k, v in found.items()}


def workers_from_info(info: Mapping[str, Any], kill_fractions: Mapping[str, float | None],
                      default_fraction: float | None) -> list[WorkerMemory]:
    """The workers of a ``client.scheduler_info()`` answer, with their nanny's kill fraction.

    A worker without a nanny has no kill line (None); one whose nanny was not
    asked takes ``default_fraction``.

    >>> info = {"workers": {"tcp://w:1": {"nthreads": 1, "memory_limit": 1000, "metrics": {"memory": 100},
    ...                                    "nanny": "tcp://n:1"}}}
    >>> [w.kill_headroom_bytes for w in workers_from_info(info, {"tcp://n:1": 0.9}, 0.95)]
    [800]
    """
    out = []
    for address, w in (info.get("workers") or {}).items():
        nanny = w.get("nanny")
        if not nanny:
            fraction = None
        else:
            fraction = kill_fractions[nanny] if nanny in kill_fractions else default_fraction
        out.append(WorkerMemory(
            address=str(address), nthreads=int(w.get("nthreads", 1) or 1),
            memory_limit_bytes=int(w.get("memory_limit") or 0),
            resting_bytes=int((w.get("metrics") or {}).get("memory", 0) or 0), kill_fraction=fraction))
    return out


def slots(workers: list[WorkerMemory]) -> int:
    """Task slots: one per worker thread."""
    return sum(w.nthreads for w in workers)


def kill_headroom_bytes(workers: list[WorkerMemory]) -> int | None:
    """The smallest kill headroom among the workers (None when no worker has a kill line)."""
    lines = [h for h in (w.kill_headroom_bytes for w in workers) if h is not None]
    return min(lines) if lines else None


def task_budget(workers: list[WorkerMemory], target_fraction: float) -> int:
    """Memory one task may use above its worker's resting level: the smallest over the workers (bytes)."""
    return min(policy.task_budget_bytes(w.memory_limit_bytes, w.nthreads, target_fraction=target_fraction,
                                        resting_bytes=w.resting_bytes, kill_fraction=w.kill_fraction)
               for w in workers)


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


def read_allowed_failures(client: Any) -> int | None:
    """The scheduler's ``allowed-failures`` (None when it cannot be read). Read by value: no memchunk needed there."""
    try:
        return client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.allowed_failures)
    except Exception as exc:  # noqa: BLE001 - a scheduler that refuses run_on_scheduler: nothing to say
        logger.info("could not read the scheduler's allowed-failures: %r", exc)
        return None
