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

The parts, each in a module of its own:

- how memory is read: through one seam, :class:`~memchunk_prefect.run.probes.MemoryProbe`
  (exact kernel high-water mark, or RSS sampled on a thread; :mod:`memchunk_prefect.run.probes`);
- several runs in one process (a Dask worker with ``nthreads > 1``): ``shared`` figures, the
  process's resting level and high-water mark (:mod:`memchunk_prefect.run.process_memory`);
- GPU memory (``gpu=True``, the default) and energy (``energy=True``, the default) from NVML and
  Intel RAPL: ``gpu_peak_bytes`` is absolute, ``energy_joules`` whole-device, ``None`` where
  unreadable (:mod:`memchunk_prefect.run.gpu_energy`).

**Time**: ``seconds`` is wall time (``time.perf_counter``); ``cpu_seconds`` is the
CPU time of the *calling thread* (``time.thread_time``), which other tasks in the
same process do not inflate but which excludes helper threads the task itself
starts (BLAS/FFT pools); ``process_cpu_seconds`` is the whole process's CPU time
(``time.process_time``) over the run, which includes those and everything else the
process did. ``sys_seconds`` is the part of the calling thread's CPU time spent in the
kernel (``getrusage(RUSAGE_THREAD)``, Linux; None elsewhere): page faults and zeroing of
memory the run touched. Memory a process holds for the first time costs far more kernel
time than memory it held before, at the same user time (``python -m benchmarks.studies.first_touch``
measures it), and that cost lands in this figure, not in user time.

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
import time
import tracemalloc as _tracemalloc
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, TypeVar

from memchunk_prefect.core.errors import MeasurementError
from memchunk_prefect.run import process_memory
from memchunk_prefect.run.gpu_energy import _GpuWatch, _nvml, energy_readings, energy_since
from memchunk_prefect.run.probes import (
    DEFAULT_INTERVAL_SECONDS,
    DEFAULT_METHOD,
    METHODS,
    MemoryProbe,
    SamplingProbe,
    VmHWMProbe,
    make_probe,
)
from memchunk_prefect.run.process_memory import _ACTIVE, SharedMeasurementWarning, _warn_shared_once
from memchunk_prefect.run.rise import DEFAULT_RISE_INTERVAL_SECONDS, RiseWatch

try:
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]

# The probes' settings and classes and the shared-run warning are part of this module's interface too.
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

# ----------------------------------------------------------------------------- settings
# (how memory is read, DEFAULT_METHOD and DEFAULT_INTERVAL_SECONDS, is set in memchunk_prefect.run.probes)

#: Seconds between two NVML queries of this process's GPU memory (each costs ~0.1-1 ms).
DEFAULT_GPU_INTERVAL_SECONDS = 0.01
#: Also record the Python-heap peak with tracemalloc (slows allocation-heavy code ~2x).
DEFAULT_TRACEMALLOC = False
#: Sample GPU memory and read the NVML energy counter when NVML is present.
DEFAULT_GPU = True
#: Read energy counters (NVML, Intel RAPL) before and after each run.
DEFAULT_ENERGY = True


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
    #: The shares of the run's wall time (0-1) after which its memory above ``baseline_bytes`` first reached 50%
    #: and 90% of its peak (:mod:`memchunk_prefect.run.rise`); None when another tracked run overlapped this one,
    #: the run was too short to sample, or the monitor reads memory through a substitute probe.
    rise_50: float | None = None
    rise_90: float | None = None
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
            "rise_50": self.rise_50,
            "rise_90": self.rise_90,
        }


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
                 "_cpu0", "_pcpu0", "_sys0", "_heap0", "_gpu", "_nvml_mj0", "_rapl0", "_tracemalloc", "_rise",
                 "__weakref__")

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
        self._rise: RiseWatch | None = None  # samples its memory's rise while it runs alone (Monitor.rise)

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
    - ``probe``: a :class:`MemoryProbe` to use instead of ``method`` (tests pass fakes);
    - ``rise``: time when a run's memory rises to its peak (``Measurement.rise_50``/``rise_90``) with a thread
      reading the resident set every ``rise_interval_seconds`` while the run has its process to itself; not with
      a substitute ``probe`` (its figures are not the process's).
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
        rise: bool = True,
        rise_interval_seconds: float = DEFAULT_RISE_INTERVAL_SECONDS,
    ) -> None:
        if method not in METHODS:
            raise MeasurementError(f"method must be one of {METHODS}, got {method!r}")
        for name, value in (("interval_seconds", interval_seconds), ("gpu_interval_seconds", gpu_interval_seconds),
                            ("rise_interval_seconds", rise_interval_seconds)):
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
        self.rise = bool(rise)
        self.rise_interval_seconds = float(rise_interval_seconds)

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
            run._nvml_mj0, run._rapl0 = energy_readings(nvml=self.gpu)
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
            if self.rise and self._probe is None and run._overlap == 1:
                run._rise = RiseWatch(self.rise_interval_seconds)
        if run._rise is not None:
            run._rise.start()
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
        rise = None
        if run._rise is not None:
            rise = run._rise.stop(run._baseline, seconds, max(0, process_peak - run._baseline))
            if end is None:  # another run overlapped it: the samples hold their memory too
                rise = None
        gpu_peak = gpu_name = None
        if run._gpu is not None:
            gpu_peak, gpu_name = run._gpu.finish()
        energy, energy_source = energy_since(run._nvml_mj0, run._rapl0)
        # Through the module, so that a substitute put there (a test's) is the one asked.
        nthreads = process_memory._dask_nthreads()
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
            energy_joules=energy,
            energy_source=energy_source,
            shared=shared,
            threads=threads,
            others_bytes=int(run._others),
            grew_bytes=int(grew),
            # Read only when the run was alone in its process from start to end, whatever the worker's thread
            # count: a library's first use on a worker with several threads is then still told apart.
            retained_bytes=None if end is None else max(0, end - int(run._baseline)),
            rise_50=None if rise is None else rise[0],
            rise_90=None if rise is None else rise[1],
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
