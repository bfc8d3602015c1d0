"""What the process as a whole holds while runs are tracked in it: the runs open, its resting level, its peak.

**Several threads in one process** (a Dask worker with ``nthreads > 1``, or several
``track()`` blocks open at once in threads) share one RSS: the process peak mixes
their tasks. Such a measurement is marked ``shared=True`` and a
:class:`SharedMeasurementWarning` is issued once per process saying that one thread
per worker process gives clean figures. Concurrent runs never corrupt each other:
the peak is reset only when no other run in the process is being tracked, so every
open run's window starts after the last reset and its ``process_peak_bytes`` is an
upper bound of the process's true peak during that run (it errs on the safe side).
A shared ``peak_bytes`` is *not* a per-task figure: others' allocations inflate it,
and others freeing memory during the run can hide part of this task's use (its
resting level included their memory). Learn from unshared figures. A run that starts
while others are open records what they held above the process's resting level
(``others_bytes``: the baseline less the RSS read when no run was last open), so its
start is not mistaken for memory the worker gained; :func:`process_resting_bytes`
gives the resting level itself while runs are open (what the budget reads), and
:func:`high_water_bytes` the most the process has held. Bytes throughout.

The state is one object per process (``_ACTIVE``); :mod:`memchunk_prefect.run.monitor`
updates it under its lock as runs start and finish.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Protocol

__all__ = ["SharedMeasurementWarning", "high_water_bytes", "process_resting_bytes", "runs_open"]


class SharedMeasurementWarning(UserWarning):
    """Tasks shared one process while being measured: their peaks are mixed (issued once per process)."""


class _OpenRun(Protocol):
    """A tracked run as the process's state sees it (:class:`memchunk_prefect.run.monitor.Tracker`)."""

    #: The most tracked runs open at once during the run, itself included.
    _overlap: int


class _Active:
    """Tracked runs open in this process; the lock orders peak resets against every open run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: set[_OpenRun] = set()
        self.tracemalloc_users = 0
        self.tracemalloc_started_here = False
        #: The process's RSS the last time it was read with no tracked run open (bytes; None: never).
        self.resting: int | None = None
        #: The most memory the process has held, as far as the runs saw it (bytes; None: no run yet).
        self.high_water: int | None = None


_ACTIVE = _Active()
_WARNED_SHARED: set[int] = set()  # pids that have been told once


def runs_open() -> int:
    """How many tracked runs are open in this process now."""
    with _ACTIVE.lock:
        return len(_ACTIVE.runs)


def process_resting_bytes(rss_bytes: int, grown_bytes: int = 0) -> int:
    """This process's resting memory given its RSS now (bytes).

    With no tracked run open, the RSS *is* the resting level (and is remembered
    as such). With runs open (a Dask worker's other threads mid-task, perhaps
    another flow's), the RSS includes what they hold, which is not resting: the
    level read the last time no run was open is returned instead, plus
    ``grown_bytes`` (what the caller knows the process gained since, e.g. the
    imports it just made). A budget read while other flows' tasks peak on the
    worker is then the worker's, not the moment's.

    >>> process_resting_bytes(500)
    500
    """
    with _ACTIVE.lock:
        if not _ACTIVE.runs or _ACTIVE.resting is None:
            if not _ACTIVE.runs:
                _ACTIVE.resting = int(rss_bytes)
            return int(rss_bytes)
        return min(int(rss_bytes), _ACTIVE.resting + max(0, int(grown_bytes)))


def high_water_bytes() -> int | None:
    """The most memory this process has held as far as its tracked runs saw it (bytes; None: no run yet).

    A run that takes the process above it pays the kernel for faulting in and zeroing the new pages
    (``Observation.grew_bytes``); one that stays under it does not, though the memory was handed back between
    (``python -m benchmarks.studies.first_touch`` measures both).

    >>> v = high_water_bytes()
    >>> v is None or v > 0
    True
    """
    with _ACTIVE.lock:
        return _ACTIVE.high_water


def _dask_nthreads() -> int | None:
    """The current Dask worker's thread count, or None outside a Dask worker task."""
    if "distributed" not in sys.modules:  # not imported: certainly not in a worker
        return None
    try:
        from distributed.worker import get_worker

        return int(get_worker().state.nthreads)
    except Exception:
        return None


def _warn_shared_once(threads: int) -> None:
    """Issue the :class:`SharedMeasurementWarning` for ``threads`` threads, once per process.

    Called by the monitor when a run finishes shared (``threads`` > 1).
    """
    pid = os.getpid()
    if pid in _WARNED_SHARED:
        return
    _WARNED_SHARED.add(pid)
    warnings.warn(
        f"memchunk: {threads} threads run tasks in this process (pid {pid}), so each task's measured "
        "peak memory includes the others' (marked shared=True). One thread per worker process gives "
        "clean per-task figures: e.g. LocalCluster(threads_per_worker=1) or `dask worker --nthreads 1`. "
        "This is said once per process.",
        SharedMeasurementWarning,
        stacklevel=4,
    )
