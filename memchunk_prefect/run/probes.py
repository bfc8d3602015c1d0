"""Reading a process's memory: the peak seam (:class:`MemoryProbe`) and its two implementations. Bytes throughout.

What is read is the process's *resident set size* (RSS), the figure a Dask nanny
compares with ``memory_limit`` when it kills a worker; the monitor
(:mod:`memchunk_prefect.run.monitor`) turns it into a run's peak above its resting level.

- :class:`VmHWMProbe` (``method="vmhwm"``, Linux): writing ``5`` to
  ``/proc/self/clear_refs`` resets the kernel's high-water mark of RSS (``VmHWM`` in
  ``/proc/self/status``); reading it after the run gives the exact peak, with no
  sampling gap, at well under a millisecond per run (``python -m benchmarks.studies.measure_overhead``).
- :class:`SamplingProbe` (``method="psutil"``, anywhere): psutil RSS sampled on a
  background thread every ``interval_seconds`` (default 5 ms). It can miss a spike
  shorter than the interval (allocate, touch, free within 5 ms) and a peak reached
  while the sampling thread waits for the GIL; it sees the RSS at the start and end
  of the run, and everything held for longer than an interval.
- ``method="auto"`` (the default): VmHWM where ``/proc/self/clear_refs`` is
  writable, else sampling. Decided once per process (:func:`clear_refs_writable`).

:func:`make_probe` gives the one probe per setting per process. Tests substitute a
probe returning numbers (``Monitor(probe=...)``), so the logic above the seam is
checked without allocating gigabytes.
"""

from __future__ import annotations

import os
import threading
from typing import Protocol, runtime_checkable

from memchunk_prefect.core.errors import MeasurementError

__all__ = [
    "DEFAULT_INTERVAL_SECONDS",
    "DEFAULT_METHOD",
    "METHODS",
    "MemoryProbe",
    "SamplingProbe",
    "VmHWMProbe",
    "clear_refs_writable",
    "make_probe",
]

#: How memory is read: "auto" (VmHWM where /proc/self/clear_refs is writable, else "psutil"),
#: "vmhwm" (exact kernel high-water mark, Linux) or "psutil" (RSS sampled on a thread).
DEFAULT_METHOD = "auto"
METHODS = ("auto", "vmhwm", "psutil")
#: Seconds between two RSS samples on the sampling path (<= 10 ms keeps misses under ~0.3%
#: of a multi-GiB peak in the memory-aware-chunking study).
DEFAULT_INTERVAL_SECONDS = 0.005

_STATUS_PATH = "/proc/self/status"
_CLEAR_REFS_PATH = "/proc/self/clear_refs"


@runtime_checkable
class MemoryProbe(Protocol):
    """The one seam through which process memory is read. All figures in bytes.

    ``start()``/``stop()`` bracket every tracked run (nested and concurrent calls
    are balanced: a probe that runs a thread keeps it while any run is open).
    ``reset_peak()`` starts a new peak window at the current RSS; the monitor calls
    it only when no other run in the process is being tracked. ``peak_bytes()`` is
    the highest RSS since the last reset, the current RSS included.
    """

    method: str

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def reset_peak(self) -> None: ...

    def current_bytes(self) -> int: ...

    def peak_bytes(self) -> int: ...


def _read_status_kib(*keys: bytes) -> list[int]:
    """Values (KiB) of ``keys`` in /proc/self/status, in the order asked."""
    with open(_STATUS_PATH, "rb") as f:
        text = f.read()
    out = []
    for key in keys:
        i = text.find(key)
        if i < 0:
            raise MeasurementError(f"{_STATUS_PATH} has no {key.decode()!r} line; use method='psutil'")
        j = text.find(b"\n", i)
        out.append(int(text[i + len(key) + 1:j].split()[0]))
    return out


class VmHWMProbe:
    """Exact peak RSS from the Linux kernel: reset via /proc/self/clear_refs, read VmHWM.

    Raises :class:`~memchunk_prefect.core.errors.MeasurementError` at construction where
    clear_refs is not writable (not Linux, or a restricted container).
    """

    method = "vmhwm"

    def __init__(self) -> None:
        if not clear_refs_writable():
            raise MeasurementError(
                f"method='vmhwm' needs a writable {_CLEAR_REFS_PATH} (Linux); it is not writable "
                "in this process. Use method='psutil' (sampling) or method='auto'."
            )

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def reset_peak(self) -> None:
        # "5" resets only the high-water mark (VmHWM := VmRSS); "1".."4" would clear
        # page-referenced bits, which we must not touch.
        with open(_CLEAR_REFS_PATH, "wb", buffering=0) as f:
            f.write(b"5")

    def current_bytes(self) -> int:
        return _read_status_kib(b"VmRSS:")[0] * 1024

    def peak_bytes(self) -> int:
        hwm, rss = _read_status_kib(b"VmHWM:", b"VmRSS:")
        return max(hwm, rss) * 1024

    def __repr__(self) -> str:
        return "VmHWMProbe()"


class SamplingProbe:
    """Peak RSS sampled by psutil on a background thread every ``interval_seconds``.

    Misses spikes shorter than the interval (see the module docstring). The thread
    runs only while at least one tracked run is open.
    """

    method = "psutil"

    def __init__(self, interval_seconds: float = DEFAULT_INTERVAL_SECONDS) -> None:
        interval_seconds = float(interval_seconds)
        if not 0 < interval_seconds <= 1:
            raise ValueError(
                f"interval_seconds must be in (0, 1] seconds, got {interval_seconds!r}; "
                f"the default is {DEFAULT_INTERVAL_SECONDS} s"
            )
        import psutil

        self.interval_seconds = interval_seconds
        self._process = psutil.Process()
        self._lock = threading.Lock()
        self._users = 0
        self._peak = 0
        self._stop_event: threading.Event | None = None
        self._thread: threading.Thread | None = None

    def current_bytes(self) -> int:
        rss = self._process.memory_info().rss
        with self._lock:
            if rss > self._peak:
                self._peak = rss
        return rss

    def reset_peak(self) -> None:
        rss = self._process.memory_info().rss
        with self._lock:
            self._peak = rss

    def peak_bytes(self) -> int:
        rss = self._process.memory_info().rss
        with self._lock:
            if rss > self._peak:
                self._peak = rss
            return self._peak

    def start(self) -> None:
        with self._lock:
            self._users += 1
            if self._users > 1:
                return
            stop = threading.Event()
            thread = threading.Thread(target=self._loop, args=(stop,), name="memchunk-rss-sampler", daemon=True)
            self._stop_event, self._thread = stop, thread
        thread.start()

    def stop(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self._stop_event is None:
                return
            stop, thread = self._stop_event, self._thread
            self._stop_event = self._thread = None
        stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _loop(self, stop: threading.Event) -> None:
        memory_info, interval = self._process.memory_info, self.interval_seconds
        while not stop.wait(interval):
            try:
                rss = memory_info().rss
            except Exception:  # the process is going away
                return
            if rss > self._peak:  # racy read is fine: rechecked under the lock
                with self._lock:
                    if rss > self._peak:
                        self._peak = rss

    def __repr__(self) -> str:
        return f"SamplingProbe(interval_seconds={self.interval_seconds})"


_CLEAR_REFS_OK: dict[int, bool] = {}  # pid -> writable (decided once per process)


def clear_refs_writable() -> bool:
    """Whether this process can reset its VmHWM (decided once per process, by trying)."""
    pid = os.getpid()
    ok = _CLEAR_REFS_OK.get(pid)
    if ok is None:
        try:
            with open(_CLEAR_REFS_PATH, "wb", buffering=0) as f:
                f.write(b"5")
            _read_status_kib(b"VmHWM:", b"VmRSS:")
            ok = True
        except (OSError, MeasurementError, ValueError):
            ok = False
        _CLEAR_REFS_OK[pid] = ok
    return ok


_PROBES: dict[tuple, MemoryProbe] = {}
_PROBES_LOCK = threading.Lock()


def make_probe(method: str = DEFAULT_METHOD, interval_seconds: float = DEFAULT_INTERVAL_SECONDS) -> MemoryProbe:
    """The process-wide probe for ``method`` ("auto", "vmhwm", "psutil"); one per setting per process."""
    if method not in METHODS:
        raise MeasurementError(f"method must be one of {METHODS}, got {method!r}")
    if method == "auto":
        method = "vmhwm" if clear_refs_writable() else "psutil"
    key = (os.getpid(), method, float(interval_seconds) if method == "psutil" else None)
    with _PROBES_LOCK:
        probe = _PROBES.get(key)
        if probe is None:
            probe = VmHWMProbe() if method == "vmhwm" else SamplingProbe(interval_seconds)
            _PROBES[key] = probe
    return probe

