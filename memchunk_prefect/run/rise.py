"""When in its run a task's memory rises to its peak: a light sampler of the process's resident set.

The kernel's high-water mark (:class:`~memchunk_prefect.run.probes.VmHWMProbe`) gives a run's exact peak but
not when it came. How soon a task reaches its peak decides what a task that will not fit costs before its worker
dies: a Gram matrix filled by BLAS reaches 90% of its peak 0.8-0.9 of the way through its run, an autocorrelation
holding one product at a time 0.03-0.3 (``python -m benchmarks.studies.peak_time``), and a simulation that takes
every task to peak half way through its run mistimes both (:mod:`memchunk_prefect.sim.cluster`).

:class:`RiseWatch` reads the process's resident set from ``/proc/self/statm`` (psutil where there is none) on a
thread while one run is tracked: every ``interval_seconds`` (default 10 ms) at first, then every
1/:data:`SAMPLES_PER_RUN` of the time the run has taken so far, so a run of any length is timed to about 4% of its
length in at most a few hundred reads (an hour's in under 300). :func:`rise_shares` turns the samples into two fractions
of the run's wall time: when memory above the resting level first reached half of its sampled peak, and 90% of
it. A run shorter than :data:`MIN_SAMPLES` intervals, or whose sampled peak missed most of the exact one (a spike
shorter than an interval), has none. What it costs is the thread's waking: about 80 us of CPU a read on the
build machines, under 1% of one core over a run of a second or more
(``python -m benchmarks.studies.measure_overhead`` reports it).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Sequence

__all__ = ["DEFAULT_RISE_INTERVAL_SECONDS", "MIN_SAMPLES", "RISE_LEVELS", "RiseWatch", "rise_shares"]

#: Seconds between two reads of the resident set while a run is watched, at least.
DEFAULT_RISE_INTERVAL_SECONDS = 0.01
#: Fewest samples a run needs for its rise to be read (shorter runs: None).
MIN_SAMPLES = 8
#: Reads per run so far: once the run has taken ``SAMPLES_PER_RUN x interval``, reads come every 1/SAMPLES_PER_RUN
#: of its time so far.
SAMPLES_PER_RUN = 25
#: The shares of its peak at which a run's rise is timed.
RISE_LEVELS = (0.5, 0.9)
#: A run whose sampled peak is below this share of its exact one has no rise (the peak fell between samples).
MIN_SEEN_SHARE = 0.8

_STATM = "/proc/self/statm"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rise_shares(samples: Sequence[tuple[float, int]], baseline: int, seconds: float,
                exact_peak: int | None = None) -> tuple[float, float] | None:
    """The fractions of a run's ``seconds`` after which its memory above ``baseline`` first reached 50% and 90%
    of its sampled peak, from ``samples`` of (seconds since the run started, resident bytes).

    None when the samples cannot tell: fewer than :data:`MIN_SAMPLES`, no memory above the baseline, or a sampled
    peak below :data:`MIN_SEEN_SHARE` of ``exact_peak`` (bytes above the baseline, where known).

    >>> rise_shares([(0.1 * i, 1000 + 100 * i) for i in range(21)], 1000, 2.0)
    (0.5, 0.9)
    """
    if len(samples) < MIN_SAMPLES or seconds <= 0:
        return None
    peak = max(r for _, r in samples) - baseline
    if peak <= 0 or (exact_peak is not None and peak < MIN_SEEN_SHARE * exact_peak):
        return None
    shares = []
    for level in RISE_LEVELS:
        t = next(t for t, r in samples if r - baseline >= level * peak)
        shares.append(min(1.0, max(0.0, t / seconds)))
    return shares[0], shares[1]


def _rss_reader() -> tuple[Callable[[], int], Callable[[], None]]:
    """A function returning this process's resident bytes, and one closing what it holds: ``/proc/self/statm`` read
    again from an open descriptor where it exists (3 us a read), else psutil."""
    try:
        fd = os.open(_STATM, os.O_RDONLY)
    except OSError:
        import psutil

        info = psutil.Process().memory_info
        return (lambda: int(info().rss)), (lambda: None)
    return (lambda: int(os.pread(fd, 128, 0).split()[1]) * _PAGE), (lambda: os.close(fd))


class RiseWatch:
    """Samples the process's resident set on a thread from :meth:`start` to :meth:`stop` (one run)."""

    def __init__(self, interval_seconds: float = DEFAULT_RISE_INTERVAL_SECONDS) -> None:
        self.interval_seconds = float(interval_seconds)
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, args=(_rss_reader(),), name="memchunk-rise", daemon=True)
        self._thread.start()

    def _loop(self, reader: tuple[Callable[[], int], Callable[[], None]]) -> None:
        read, close = reader
        samples, clock, t0, wait, least = self.samples, time.perf_counter, self._t0, self._stop.wait, \
            self.interval_seconds
        try:
            while True:
                at = clock() - t0
                samples.append((at, read()))
                if wait(max(least, at / SAMPLES_PER_RUN)):
                    return
        except Exception:  # the process is going away
            return
        finally:
            close()

    def stop(self, baseline: int, seconds: float, exact_peak: int | None = None) -> tuple[float, float] | None:
        """Stop sampling; the run's rise (:func:`rise_shares`)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        return rise_shares(self.samples, baseline, seconds, exact_peak)
