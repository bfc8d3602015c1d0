"""What one task run used, measured in the process that runs it: memory, time, GPU, energy.

Use it anywhere (a Dask worker, a notebook, a profiling script)::

    >>> import numpy as np
    >>> from memchunk_prefect.run.monitor import measure
    >>> result, m = measure(np.ones, 1_000_000)          # kwargs go to the function
    >>> m.method in ("vmhwm", "psutil"), m.seconds >= 0, m.error is None
    (True, True, True)

or wrap a block of code (the runner does this around each task run)::

    >>> from memchunk_prefect.run.monitor import Monitor
    >>> with Monitor(method="auto").track() as run:
    ...     block = np.zeros(100_000)
    >>> run.measurement.peak_bytes >= 0
    True

**The figure decisions use** is :attr:`Measurement.peak_bytes`: the highest *resident
set size* (RSS) of the process during the run, minus its RSS just before the run
(the resting level). RSS is what a Dask nanny compares with ``memory_limit`` when it
kills a worker (``psutil.Process().memory_info().rss``), so RSS above the resting
level is what a chunk must fit under. The Python-heap view (``tracemalloc=True``)
misses memory allocated outside Python's allocators (FFTW plans, BLAS buffers, C
extensions) and counts memory the OS never made resident, so it is reported
separately (``python_heap_peak_bytes``) and never used to decide anything.

How memory is read: through one seam, :class:`MemoryProbe`. Implementations:

- :class:`VmHWMProbe` (``method="vmhwm"``, Linux): writing ``5`` to
  ``/proc/self/clear_refs`` resets the kernel's high-water mark of RSS (``VmHWM`` in
  ``/proc/self/status``); reading it after the run gives the exact peak, with no
  sampling gap. About 0.08 ms per run on the build machine (``python -m benchmarks.measure_overhead``).
- :class:`SamplingProbe` (``method="psutil"``, anywhere): psutil RSS sampled on a
  background thread every ``interval_seconds`` (default 5 ms). It can miss a spike
  shorter than the interval (allocate, touch, free within 5 ms) and a peak reached
  while the sampling thread waits for the GIL; it sees the RSS at the start and end
  of the run, and everything held for longer than an interval.
- ``method="auto"`` (the default): VmHWM where ``/proc/self/clear_refs`` is
  writable, else sampling. Decided once per process.

Tests substitute a probe returning numbers (``Monitor(probe=...)``), so the logic
above the seam is checked without allocating gigabytes.

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
gives the resting level itself while runs are open (what the budget reads).

**Time**: ``seconds`` is wall time (``time.perf_counter``); ``cpu_seconds`` is the
CPU time of the *calling thread* (``time.thread_time``), which other tasks in the
same process do not inflate but which excludes helper threads the task itself
starts (BLAS/FFT pools); ``process_cpu_seconds`` is the whole process's CPU time
(``time.process_time``) over the run, which includes those and everything else the
process did. ``sys_seconds`` is the part of the calling thread's CPU time spent in the
kernel (``getrusage(RUSAGE_THREAD)``, Linux; None elsewhere): page faults and zeroing of
memory the run touched. Memory a process holds for the first time costs far more there
than memory it held before (one trace_correlation block: 0.36-0.99 s of system CPU on a
fresh process's first call, 0.05-0.06 s on later ones, the same user time;
``python -m benchmarks.first_touch``), and that cost lands in this figure, not in user time.

**GPU** (``gpu=True``, the default): when ``pynvml`` (package ``nvidia-ml-py``)
imports and ``nvmlInit()`` succeeds, this process's GPU memory (the sum over all
devices of ``nvmlDeviceGetComputeRunningProcesses`` entries whose pid is
``os.getpid()``) is sampled on a thread every ``gpu_interval_seconds`` during the
run; ``gpu_peak_bytes`` is the highest sum seen (absolute, not above a resting
level: CUDA contexts and memory pools stay allocated between runs). In a container
with its own PID namespace NVML may report host pids and the process then shows
0 bytes. No NVML, no GPU, or ``NVMLError`` at init gives ``None`` GPU fields; that
is decided once per process and cached, and never raises or warns.
*Verification*: no NVIDIA GPU was available where this was built; the GPU path is
tested with a fake ``pynvml`` module (tests/test_monitor.py) that reports a process
using a known number of bytes and an energy counter.

**Energy** (``energy=True``, the default): ``energy_joules`` is the difference of
whole-device counters over the run, not a per-process share: NVML
``nvmlDeviceGetTotalEnergyConsumption`` (millijoules, every GPU) and Intel RAPL
``/sys/class/powercap/intel-rapl:N/energy_uj`` (microjoules, every CPU package;
wrap-around handled with ``max_energy_range_uj``). ``energy_source`` names what was
summed: ``"nvml"``, ``"rapl"``, ``"nvml+rapl"``, or ``None`` where neither is
readable (``energy_uj`` is root-only on kernels >= 5.10).

**Failures**: the measurement is filled in even when the body raises (MemoryError
included). :func:`measure` and ``track()`` re-raise the original exception with the
measurement attached as ``exc.memchunk_measurement`` (it survives pickling, so it
reaches the flow process from a Dask worker). A worker killed by its nanny leaves no
measurement: the flow side records that death (see memchunk_prefect.core.records).

Not covered here: cgroup memory (page cache and kernel memory make it 4-9% higher
than RSS), per-task figures with several threads per process, and recording the
measurement as an :class:`~memchunk_prefect.core.records.Observation` (the runner does
that, with :meth:`Measurement.observation_fields`).
"""

from __future__ import annotations

import contextlib
import glob
import os
import sys
import threading
import time
import tracemalloc as _tracemalloc
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Protocol, TypeVar, runtime_checkable

from memchunk_prefect.core.errors import MeasurementError

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

__all__ = [
    "DEFAULT_GPU_INTERVAL_SECONDS",
    "DEFAULT_INTERVAL_SECONDS",
    "DEFAULT_METHOD",
    "METHODS",
    "Measurement",
    "MemoryProbe",
    "Monitor",
    "SamplingProbe",
    "SharedMeasurementWarning",
    "Tracker",
    "VmHWMProbe",
    "configure",
    "default_monitor",
    "measure",
    "thread_sys_seconds",
    "track",
]

T = TypeVar("T")

# ----------------------------------------------------------------------------- settings (one place)

#: How memory is read: "auto" (VmHWM where /proc/self/clear_refs is writable, else "psutil"),
#: "vmhwm" (exact kernel high-water mark, Linux) or "psutil" (RSS sampled on a thread).
DEFAULT_METHOD = "auto"
METHODS = ("auto", "vmhwm", "psutil")
#: Seconds between two RSS samples on the sampling path (<= 10 ms keeps misses under ~0.3%
#: of a multi-GiB peak in the memory-aware-chunking study).
DEFAULT_INTERVAL_SECONDS = 0.005
#: Seconds between two NVML queries of this process's GPU memory (each costs ~0.1-1 ms).
DEFAULT_GPU_INTERVAL_SECONDS = 0.01
#: Also record the Python-heap peak with tracemalloc (slows allocation-heavy code ~2x).
DEFAULT_TRACEMALLOC = False
#: Sample GPU memory and read the NVML energy counter when NVML is present.
DEFAULT_GPU = True
#: Read energy counters (NVML, Intel RAPL) before and after each run.
DEFAULT_ENERGY = True

_STATUS_PATH = "/proc/self/status"
_CLEAR_REFS_PATH = "/proc/self/clear_refs"
_RAPL_GLOB = "/sys/class/powercap/intel-rapl:*"


class SharedMeasurementWarning(UserWarning):
    """Tasks shared one process while being measured: their peaks are mixed (issued once per process)."""


# ----------------------------------------------------------------------------- the measurement


@dataclass(frozen=True)
class Measurement:
    """What one run used. Plain data: pickles, and ``to_dict()`` gives JSON-ready values.

    Memory in bytes, time in seconds, energy in joules. ``None`` means "not available
    on this machine", never zero.
    """

    #: Highest process RSS during the run minus ``baseline_bytes`` (>= 0). The decision figure
    #: (mixes other tasks' memory when ``shared``: see the module docstring).
    peak_bytes: int
    #: Process RSS just before the run (the resting level), bytes.
    baseline_bytes: int
    #: Highest process RSS during the run, bytes (an upper bound when ``shared``).
    process_peak_bytes: int
    #: Wall time of the run, seconds.
    seconds: float
    #: CPU time of the calling thread over the run (``time.thread_time``), seconds.
    cpu_seconds: float
    #: How memory was read: "vmhwm" (exact), "psutil" (sampled), or a test probe's name.
    method: str
    #: CPU time of the whole process over the run (``time.process_time``), seconds.
    process_cpu_seconds: float = 0.0
    #: Kernel CPU time of the calling thread over the run (page faults, zeroing), seconds; None where the
    #: platform has no per-thread figure (``resource.RUSAGE_THREAD`` is Linux's).
    sys_seconds: float | None = None
    #: Peak of Python-heap allocations above their level at the start (tracemalloc), bytes; None unless asked.
    python_heap_peak_bytes: int | None = None
    #: Highest GPU memory this process held during the run, all devices summed, bytes; None without NVML.
    gpu_peak_bytes: int | None = None
    #: Name(s) of the GPU(s) this process used (else of every GPU present); None without NVML.
    gpu_name: str | None = None
    #: Energy of the whole devices over the run (GPUs by NVML and/or CPU packages by RAPL), joules.
    energy_joules: float | None = None
    #: What ``energy_joules`` summed: "nvml", "rapl", "nvml+rapl", or None.
    energy_source: str | None = None
    #: True when other tasks ran in the same process during the run: the peak mixes them.
    shared: bool = False
    #: Threads that can run tasks in this process: the Dask worker's nthreads, else the most
    #: tracked runs open at once during this run (1 = alone).
    threads: int = 1
    #: Memory other tracked runs in this process held when this run started, bytes: ``baseline_bytes`` less
    #: the process's resting level then (see :func:`process_resting_bytes`); 0 when the run started alone.
    others_bytes: int = 0
    #: How far the process's peak during the run rose above the most the process had held before it (its
    #: high-water mark over earlier runs and between them), bytes (>= 0): memory faulted in for the first time.
    grew_bytes: int = 0
    #: Process memory at the run's end above ``baseline_bytes`` (>= 0), bytes: what the run left held in the
    #: process (a library's first use: a CUDA context, a JIT compiler's code, a cache), which the next run on
    #: it starts above. None when another tracked run overlapped this one (its memory would be counted too).
    retained_bytes: int | None = None
    #: ``repr`` of the exception the run raised, or None.
    error: str | None = None
    #: "ok", "memory_error" (MemoryError or a subclass: the run needed *more* than it reached) or "error".
    outcome: str = "ok"

    @property
    def censored(self) -> bool:
        """True when the run died of MemoryError: ``peak_bytes`` is a lower bound of what it needed."""
        return self.outcome == "memory_error"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def observation_fields(self) -> dict[str, Any]:
        """The fields an :class:`~memchunk_prefect.core.records.Observation` takes from this measurement.

        >>> m = Measurement(peak_bytes=10, baseline_bytes=5, process_peak_bytes=15, seconds=1.0,
        ...                 cpu_seconds=0.5, method="vmhwm", outcome="memory_error", error="MemoryError()")
        >>> sorted(m.observation_fields().items())[:4]
        [('baseline_bytes', 5), ('censored', True), ('cpu_seconds', 0.5), ('energy_joules', None)]
        """
        return {
            "peak_bytes": self.peak_bytes,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "outcome": self.outcome,
            "censored": self.censored,
            "gpu_peak_bytes": self.gpu_peak_bytes,
            "energy_joules": self.energy_joules,
            "energy_source": self.energy_source,
            "shared": self.shared,
            "method": self.method,
            "baseline_bytes": self.baseline_bytes,
            "others_bytes": self.others_bytes,
            "grew_bytes": self.grew_bytes,
            "retained_bytes": self.retained_bytes,
            "sys_seconds": self.sys_seconds,
        }


# ----------------------------------------------------------------------------- the seam: memory probes


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


# ----------------------------------------------------------------------------- GPU (NVML) and energy (RAPL)


class _Nvml:
    """NVML, initialised once per process; ``handles`` is empty when there is no usable NVIDIA GPU."""

    def __init__(self) -> None:
        self.pynvml: Any = None
        self.handles: list[Any] = []
        self.names: list[str] = []
        self.energy_ok = False
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            names = []
            for h in handles:
                name = pynvml.nvmlDeviceGetName(h)
                names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception:  # ImportError, NVMLError (no driver / no GPU), anything odd: no GPU metrics
            return
        self.pynvml, self.handles, self.names = pynvml, handles, names
        try:
            for h in handles:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
            self.energy_ok = bool(handles)
        except Exception:  # pre-Volta GPUs have no energy counter
            self.energy_ok = False

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def process_bytes(self, pid: int) -> tuple[int, set[int]]:
        """GPU memory (bytes) held by ``pid`` summed over devices, and the device indices holding it."""
        total, used_on = 0, set()
        for i, h in enumerate(self.handles):
            try:
                procs = self.pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:
                continue
            for p in procs:
                if p.pid == pid and p.usedGpuMemory:  # None when the driver cannot tell
                    total += int(p.usedGpuMemory)
                    used_on.add(i)
        return total, used_on

    def energy_millijoules(self) -> int | None:
        if not self.energy_ok:
            return None
        try:
            return sum(int(self.pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self.handles)
        except Exception:
            return None


_NVML: dict[int, _Nvml] = {}
_NVML_LOCK = threading.Lock()


def _nvml() -> _Nvml:
    pid = os.getpid()
    with _NVML_LOCK:
        n = _NVML.get(pid)
        if n is None:
            n = _NVML[pid] = _Nvml()
    return n


class _GpuWatch:
    """Samples this process's GPU memory on a thread for one run."""

    def __init__(self, nvml: _Nvml, interval_seconds: float) -> None:
        self.nvml, self.interval_seconds = nvml, interval_seconds
        self.pid = os.getpid()
        self.peak, self.devices = nvml.process_bytes(self.pid)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memchunk-gpu-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        used, devices = self.nvml.process_bytes(self.pid)
        with self._lock:
            self.peak = max(self.peak, used)
            self.devices |= devices

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self._sample()

    def finish(self) -> tuple[int, str]:
        self._stop.set()
        self._thread.join()
        self._sample()
        names = self.nvml.names
        chosen = [names[i] for i in sorted(self.devices)] or names
        return self.peak, ", ".join(dict.fromkeys(chosen))


class _Rapl:
    """Intel RAPL package counters (microjoules), once per process; empty when unreadable."""

    def __init__(self) -> None:
        self.zones: list[tuple[str, int]] = []  # (energy_uj path, max_energy_range_uj)
        for zone in sorted(glob.glob(_RAPL_GLOB)):
            if os.path.basename(zone).count(":") != 1:  # intel-rapl:0:0 are sub-zones of package 0
                continue
            try:
                with open(os.path.join(zone, "max_energy_range_uj")) as f:
                    top = int(f.read())
                with open(os.path.join(zone, "energy_uj")) as f:
                    int(f.read())
            except (OSError, ValueError):  # root-only since Linux 5.10
                continue
            self.zones.append((os.path.join(zone, "energy_uj"), top))

    def read(self) -> list[int] | None:
        if not self.zones:
            return None
        try:
            out = []
            for path, _ in self.zones:
                with open(path) as f:
                    out.append(int(f.read()))
            return out
        except (OSError, ValueError):
            return None

    def joules(self, before: list[int] | None, after: list[int] | None) -> float | None:
        if before is None or after is None:
            return None
        return sum(rapl_delta_uj(b, a, top) for b, a, (_, top) in zip(before, after, self.zones)) / 1e6


def rapl_delta_uj(before_uj: int, after_uj: int, max_energy_range_uj: int) -> int:
    """Energy (µJ) between two RAPL readings; the counter wraps to 0 after ``max_energy_range_uj``.

    >>> rapl_delta_uj(100, 250, 1000), rapl_delta_uj(900, 50, 1000)
    (150, 150)
    """
    if after_uj >= before_uj:
        return after_uj - before_uj
    return after_uj + max_energy_range_uj - before_uj


_RAPL: dict[int, _Rapl] = {}


def _rapl() -> _Rapl:
    pid = os.getpid()
    r = _RAPL.get(pid)
    if r is None:
        r = _RAPL[pid] = _Rapl()
    return r


# ----------------------------------------------------------------------------- who else is in this process


class _Active:
    """Tracked runs open in this process; the lock orders peak resets against every open run."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.runs: set[Tracker] = set()
        self.tracemalloc_users = 0
        self.tracemalloc_started_here = False
        #: The process's RSS the last time it was read with no tracked run open (bytes; None: never).
        self.resting: int | None = None
        #: The most memory the process has held, as far as the runs saw it (bytes; None: no run yet).
        self.high_water: int | None = None


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


_ACTIVE = _Active()
_WARNED_SHARED: set[int] = set()  # pids that have been told once


def high_water_bytes() -> int | None:
    """The most memory this process has held as far as its tracked runs saw it (bytes; None: no run yet).

    A run that takes the process above it pays the kernel for faulting in and zeroing the new pages
    (``Observation.grew_bytes``); one that stays under it does not, though the memory was handed back between
    (``python -m benchmarks.first_touch``: 0.8-1.4 s for a first 545 MiB call, 0.3 s for the same call again).

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


def thread_sys_seconds() -> float | None:
    """Kernel CPU time of the calling thread so far, seconds; None where the platform has no per-thread figure.

    >>> t = thread_sys_seconds()
    >>> t is None or t >= 0.0
    True
    """
    who = getattr(resource, "RUSAGE_THREAD", None) if resource is not None else None
    if who is None:
        return None
    try:
        return float(resource.getrusage(who).ru_stime)
    except OSError:  # pragma: no cover - a kernel refusing the query
        return None


# ----------------------------------------------------------------------------- the monitor


class Tracker:
    """Handle of one tracked run; ``measurement`` is set when the ``track()`` block exits."""

    __slots__ = ("_monitor", "_probe", "measurement", "_overlap", "_baseline", "_others", "_high_water", "_t0",
                 "_cpu0", "_pcpu0", "_sys0", "_heap0", "_gpu", "_nvml_mj0", "_rapl0", "_tracemalloc", "__weakref__")

    # Set when the run starts (Monitor._start): the probe, its resting bytes, and the clocks (seconds).
    _probe: "MemoryProbe"
    _baseline: int
    _t0: float
    _cpu0: float
    _pcpu0: float
    _sys0: float | None
    _heap0: int | None

    def __init__(self, monitor: "Monitor") -> None:
        self._monitor = monitor
        self.measurement: Measurement | None = None
        self._overlap = 1  # most tracked runs open at once during this run, this one included
        self._others = 0  # bytes other tracked runs held above the process's resting level at this run's start
        self._high_water = 0  # bytes: the most the process had held when this run started
        self._gpu: _GpuWatch | None = None
        self._nvml_mj0: int | None = None
        self._rapl0: list[int] | None = None
        self._heap0: int | None = None
        self._tracemalloc = False

    def __repr__(self) -> str:
        return f"Tracker(measurement={self.measurement!r})"


class Monitor:
    """Measures runs with fixed settings; ``track()`` around code, ``measure(fn, ...)`` around a call.

    Parameters (defaults are the module's ``DEFAULT_*`` constants):

    - ``method``: "auto", "vmhwm" or "psutil" (see the module docstring);
    - ``interval_seconds``: seconds between RSS samples on the sampling path;
    - ``tracemalloc``: also record ``python_heap_peak_bytes`` (slower allocations);
    - ``gpu``: sample GPU memory through NVML when present;
    - ``gpu_interval_seconds``: seconds between GPU samples;
    - ``energy``: read NVML / RAPL energy counters before and after;
    - ``probe``: a :class:`MemoryProbe` to use instead of ``method`` (tests pass fakes).
    """

    def __init__(
        self,
        method: str = DEFAULT_METHOD,
        *,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        tracemalloc: bool = DEFAULT_TRACEMALLOC,
        gpu: bool = DEFAULT_GPU,
        gpu_interval_seconds: float = DEFAULT_GPU_INTERVAL_SECONDS,
        energy: bool = DEFAULT_ENERGY,
        probe: MemoryProbe | None = None,
    ) -> None:
        if method not in METHODS:
            raise MeasurementError(f"method must be one of {METHODS}, got {method!r}")
        for name, value in (("interval_seconds", interval_seconds), ("gpu_interval_seconds", gpu_interval_seconds)):
            if not 0 < float(value) <= 1:
                raise ValueError(f"`{name}` must be in (0, 1] seconds, got {value!r}")
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError(
                f"`probe` must implement MemoryProbe (method, start, stop, reset_peak, current_bytes, "
                f"peak_bytes), got {type(probe).__name__}"
            )
        self.method = method
        self.interval_seconds = float(interval_seconds)
        self.tracemalloc = bool(tracemalloc)
        self.gpu = bool(gpu)
        self.gpu_interval_seconds = float(gpu_interval_seconds)
        self.energy = bool(energy)
        self._probe = probe

    @property
    def probe(self) -> MemoryProbe:
        """The probe in use (created on first use, so a Monitor pickles to a worker and resolves there)."""
        if self._probe is None:
            return make_probe(self.method, self.interval_seconds)
        return self._probe

    def __repr__(self) -> str:
        return (f"Monitor(method={self.method!r}, interval_seconds={self.interval_seconds}, "
                f"tracemalloc={self.tracemalloc}, gpu={self.gpu}, energy={self.energy}"
                + (f", probe={self._probe!r})" if self._probe is not None else ")"))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Monitor) and self.__dict__ == other.__dict__

    # -- the context manager --------------------------------------------------------------------

    @contextlib.contextmanager
    def track(self) -> Iterator[Tracker]:
        """Measure the ``with`` block; the yielded handle's ``.measurement`` is set on exit.

        On an exception (``MemoryError`` included) the measurement is still set,
        attached to the exception as ``exc.memchunk_measurement``, and the
        exception propagates unchanged.
        """
        run = self._start()
        try:
            yield run
        except BaseException as exc:
            self._finish(run, exc)
            with contextlib.suppress(Exception):  # an exception type with __slots__ cannot carry it
                exc.memchunk_measurement = run.measurement  # type: ignore[attr-defined]
            raise
        else:
            self._finish(run, None)

    def measure(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> tuple[T, Measurement]:
        """Run ``fn(*args, **kwargs)``; return ``(result, measurement)``.

        On an exception, re-raises it with ``exc.memchunk_measurement`` set.
        """
        with self.track() as run:
            result = fn(*args, **kwargs)
        assert run.measurement is not None
        return result, run.measurement

    # -- internals ------------------------------------------------------------------------------

    def _start(self) -> Tracker:
        run = Tracker(self)
        probe = run._probe = self.probe
        if self.gpu:
            nvml = _nvml()
            if nvml.available:
                run._gpu = _GpuWatch(nvml, self.gpu_interval_seconds)
        if self.energy:
            if self.gpu:
                run._nvml_mj0 = _nvml().energy_millijoules()
            run._rapl0 = _rapl().read()
        probe.start()
        with _ACTIVE.lock:
            if _ACTIVE.runs:
                # Someone else is measuring: resetting the peak would ruin their figure.
                n = len(_ACTIVE.runs) + 1
                run._overlap = n
                for other in _ACTIVE.runs:
                    other._overlap = max(other._overlap, n)
            else:
                # The peak since the last reset (the previous run and what came after it) joins the process's
                # high-water mark before this reset forgets it (a sampling probe saw only its samples of it).
                _ACTIVE.high_water = max(_ACTIVE.high_water or 0, int(probe.peak_bytes()))
                probe.reset_peak()
            run._baseline = probe.current_bytes()
            run._high_water = max(_ACTIVE.high_water or 0, run._baseline)
            if _ACTIVE.runs:
                # What the others hold above the process's resting level is not this run's start: the budget
                # knew a slot would be theirs (a drift read from it would shrink every plan while they run).
                run._others = max(0, run._baseline - _ACTIVE.resting) if _ACTIVE.resting is not None else 0
            else:
                _ACTIVE.resting = run._baseline
            if self.tracemalloc:
                run._tracemalloc = True
                if _ACTIVE.tracemalloc_users == 0:
                    if _tracemalloc.is_tracing():
                        _tracemalloc.reset_peak()
                    else:
                        _tracemalloc.start()
                        _ACTIVE.tracemalloc_started_here = True
                _ACTIVE.tracemalloc_users += 1
                run._heap0 = _tracemalloc.get_traced_memory()[0]
            _ACTIVE.runs.add(run)
        run._pcpu0 = time.process_time()
        run._sys0 = thread_sys_seconds()
        run._cpu0 = time.thread_time()
        run._t0 = time.perf_counter()
        return run

    def _finish(self, run: Tracker, exc: BaseException | None) -> None:
        seconds = time.perf_counter() - run._t0
        cpu_seconds = time.thread_time() - run._cpu0
        process_cpu_seconds = time.process_time() - run._pcpu0
        sys1 = thread_sys_seconds()
        sys_seconds = None if sys1 is None or run._sys0 is None else max(0.0, sys1 - run._sys0)
        probe = run._probe
        heap_peak = None
        end: int | None = None  # the process's memory at the run's end, bytes (read only when the run was alone)
        try:
            with _ACTIVE.lock:
                try:
                    process_peak = int(probe.peak_bytes())
                    # Read before this run leaves the open set: alone, the process's memory now is the baseline plus
                    # what the run left behind; with another run open it is theirs too, and not this run's to say.
                    alone = run._overlap == 1 and len(_ACTIVE.runs) == 1
                    end = int(probe.current_bytes()) if alone else None
                finally:
                    _ACTIVE.runs.discard(run)
                grew = max(0, process_peak - run._high_water)
                _ACTIVE.high_water = max(_ACTIVE.high_water or 0, process_peak)
                if run._tracemalloc:
                    heap_peak = max(0, _tracemalloc.get_traced_memory()[1] - (run._heap0 or 0))
                    _ACTIVE.tracemalloc_users -= 1
                    if _ACTIVE.tracemalloc_users == 0 and _ACTIVE.tracemalloc_started_here:
                        _tracemalloc.stop()
                        _ACTIVE.tracemalloc_started_here = False
        finally:
            probe.stop()
        gpu_peak = gpu_name = None
        if run._gpu is not None:
            gpu_peak, gpu_name = run._gpu.finish()
        energy, sources = 0.0, []
        if run._nvml_mj0 is not None:
            mj1 = _nvml().energy_millijoules()
            if mj1 is not None:
                energy += (mj1 - run._nvml_mj0) / 1e3
                sources.append("nvml")
        if run._rapl0 is not None:
            j = _rapl().joules(run._rapl0, _rapl().read())
            if j is not None:
                energy += j
                sources.append("rapl")
        nthreads = _dask_nthreads()
        threads = max(run._overlap, nthreads or 1)
        shared = threads > 1
        if shared:
            _warn_shared_once(threads)
        if exc is None:
            outcome = "ok"
        elif isinstance(exc, MemoryError):
            outcome = "memory_error"
        else:
            outcome = "error"
        run.measurement = Measurement(
            peak_bytes=max(0, process_peak - run._baseline),
            baseline_bytes=int(run._baseline),
            process_peak_bytes=process_peak,
            seconds=seconds,
            cpu_seconds=cpu_seconds,
            process_cpu_seconds=process_cpu_seconds,
            sys_seconds=sys_seconds,
            method=probe.method,
            python_heap_peak_bytes=heap_peak,
            gpu_peak_bytes=gpu_peak,
            gpu_name=gpu_name,
            energy_joules=energy if sources else None,
            energy_source="+".join(sources) if sources else None,
            shared=shared,
            threads=threads,
            others_bytes=int(run._others),
            grew_bytes=int(grew),
            retained_bytes=None if end is None or shared else max(0, end - int(run._baseline)),
            error=None if exc is None else _safe_repr(exc),
            outcome=outcome,
        )


def _safe_repr(exc: BaseException) -> str:
    try:
        return repr(exc)[:2000]
    except Exception:
        return f"<{type(exc).__name__}>"


# ----------------------------------------------------------------------------- module-level defaults

_DEFAULT: Monitor | None = None


def default_monitor() -> Monitor:
    """The Monitor that :func:`measure` and :func:`track` use (module defaults unless :func:`configure` d)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Monitor()
    return _DEFAULT


def configure(**settings: Any) -> Monitor:
    """Replace the default Monitor, e.g. ``configure(method="psutil", tracemalloc=True)``; returns it.

    ``configure()`` with no arguments restores the module defaults.
    """
    global _DEFAULT
    _DEFAULT = Monitor(**settings)
    return _DEFAULT


def track() -> contextlib.AbstractContextManager[Tracker]:
    """``with track() as run: ...`` using the default Monitor; ``run.measurement`` after the block."""
    return default_monitor().track()


def measure(fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> tuple[T, Measurement]:
    """Run ``fn(*args, **kwargs)`` under the default Monitor; return ``(result, measurement)``.

    Every keyword goes to ``fn``; settings live on the Monitor (:func:`configure`,
    or ``Monitor(...).measure(fn, ...)``). If ``fn`` raises, the same exception is
    re-raised with the measurement attached as ``exc.memchunk_measurement``.
    ``measurement.peak_bytes`` (bytes above the resting RSS) and ``.seconds`` (wall)
    are the figures the runner records for task runs.
    """
    return default_monitor().measure(fn, *args, **kwargs)
