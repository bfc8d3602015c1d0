"""Where an operator's arithmetic runs (the CPU, or an NVIDIA GPU through CuPy), and what a task used there.

Devices: ``"cpu"`` (numpy and scipy), ``"cuda"`` (CuPy and ``cupyx.scipy``: the
current CUDA device of the process), ``"auto"`` (``"cuda"`` where the process
sees a usable GPU, else ``"cpu"``: it never fails for want of a GPU). Operators
take host (numpy) blocks in and give host blocks back whatever the device:
``device=`` says where the arithmetic runs, and the copies to and from the GPU
are the operator's (they are part of what a GPU chunk holds).

A :class:`Backend` gives an operator the array module (``xp``), the
``ndimage`` functions, the Hilbert transform and a batched ``eigh``. The same
operator code runs on both: the scipy and ``cupyx.scipy`` functions used here
have the same signatures and, for the built-in operators, results equal
to float32 tolerance (measured on an NVIDIA H100 with CuPy 14.2: gst3d_dip's
dip differed by 0.0 degrees on 64 x 64 x 400 and 128 x 128 x 400 blocks).
``cupy.linalg.eigh`` on millions of 3 x 3 matrices in one call fails in
cusolver (``CUSOLVER_STATUS_INVALID_VALUE`` on 6.5 M matrices, syevjBatched):
:meth:`Backend.eigh` calls it on at most :data:`EIGH_BATCH` matrices at a time
(2^20 worked).

What a GPU task used (:meth:`Backend.track`): CuPy allocates device memory
through its memory pool, which keeps freed blocks for reuse; what the pool
holds at the end of a task is the most the task held at once (the pool only
grows while a task runs, unless an allocation fails and CuPy frees the cached
blocks to retry it), plus whatever fragmentation cost, which is real memory
too. So before a task the pool's free blocks are returned to the driver, and
after it ``pool.total_bytes()`` less what the pool held before (live arrays, and
memory that outlives a task such as a cached FFT plan's work area) is the task's
GPU peak above the worker's resting GPU memory (the CUDA context, ~0.5 GiB, is
outside the pool); then the blocks are freed again.
NVML's per-process figure (:mod:`memchunk_prefect.run.monitor`) is absolute,
includes the context and sees the pool's high-water until it is freed, so it is
kept beside this one, not instead. Both against allocations of known size, on an
NVIDIA H100 with CuPy 14.2 (``python -m benchmarks.studies.gpu_memory``): the pool's
figure was exact (1 GiB at once, 256 + 768 MiB together, 1 GiB freed then
512 MiB, 64 x 16 MiB: error 0.00%); NVML's read 0-2 MiB over (its 2 MiB steps).
Around the operators NVML read more than the pool only on a process's first call
(gst3d_dip: 114 MiB more, the cuSOLVER / cuBLAS handles; envelope: 15 MiB, cuFFT)
and at most 16 MiB after, and polled every 2 ms it missed a 7 ms peak entirely.
So the pool's figure is the task's: exact for what CuPy allocates, short by the
libraries' first-use memory (at most ~115 MiB measured, which stays resident and
is then part of the worker's resting GPU memory).

A fake device, for machines without a GPU (tests, CI): with the environment
variable ``MEMCHUNK_FAKE_GPU_BYTES`` set to a capacity in bytes, ``"cuda"``
is a numpy-backed device of that capacity. Its arrays are numpy arrays, its
"transfers" are copies, and its memory is what the task allocated through
numpy while it ran (``tracemalloc``, which numpy reports its buffers to): a
real measurement of a pretend device. A task whose peak went over the capacity
raises :class:`FakeGpuOutOfMemoryError` (a ``MemoryError``, as CuPy's
``OutOfMemoryError`` is) when it ends. Set it before a cluster starts, so its
workers inherit it. It exists to run the GPU paths where no GPU is; it says
nothing about a real GPU's speed or memory.

>>> resolve_device("cpu"), check_device("auto")
('cpu', 'auto')
>>> backend("cpu").xp.__name__
'numpy'
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from memchunk_prefect.core.errors import DeviceError, format_bytes

__all__ = ["CPU", "CUDA", "AUTO", "DEVICES", "FAKE_GPU_ENV", "EIGH_BATCH", "INSTALL_HINT", "Backend", "GpuUse",
           "GpuStatus", "FakeGpuOutOfMemoryError", "check_device", "gpu_status", "resolve_device",
           "resolve_for_workers", "backend", "is_gpu_out_of_memory", "is_gpu_context_error", "STICKY_CUDA_ERRORS",
           "FakeGpuContextError", "release_frames"]

CPU, CUDA, AUTO = "cpu", "cuda", "auto"
DEVICES = (CPU, CUDA, AUTO)
FAKE_GPU_ENV = "MEMCHUNK_FAKE_GPU_BYTES"
#: Matrices per ``eigh`` call on the GPU (cusolver's batched solver refused 6.5 M in one call; 2^20 worked).
EIGH_BATCH = 1 << 20
#: The extra that installs CuPy (a wheel built for CUDA 13; ``cupy-cuda12x`` for CUDA 12 drivers).
INSTALL_HINT = "pip install 'memchunk-prefect[gpu]' (CuPy for CUDA 13; cupy-cuda12x for CUDA 12 drivers)"


def check_device(device: object) -> str:
    """``device`` if it is one of :data:`DEVICES`; else a :class:`DeviceError` naming them.

    >>> check_device("gpu")
    Traceback (most recent call last):
    ...
    memchunk_prefect.core.errors.DeviceError: device must be one of 'cpu', 'cuda', 'auto', got 'gpu': ...
    """
    if not isinstance(device, str) or device not in DEVICES:
        raise DeviceError(f"device must be one of 'cpu', 'cuda', 'auto', got {device!r}: use 'cuda' for an NVIDIA "
                          "GPU through CuPy, 'auto' for the GPU where the worker has one (else the CPU)")
    return device


@dataclass(frozen=True)
class GpuStatus:
    """Whether this process can run operators on a GPU, and in words why (not)."""

    usable: bool
    why: str
    fake: bool = False
    total_bytes: int | None = None  # the device's memory, bytes (None when unusable)
    #: What a task of this process could allocate on the device, bytes: the driver's free memory plus all of
    #: CuPy's pool in this process (a running task's arrays are its own, freed when it ends), at most the pool's
    #: limit where one is set (``CUPY_GPU_MEMORY_LIMIT``). The rest of ``total_bytes`` is held: this process's
    #: CUDA context and any other process's use. None when unusable.
    free_bytes: int | None = None


def _fake_capacity() -> int | None:
    raw = os.environ.get(FAKE_GPU_ENV)
    if not raw:
        return None
    try:
        value = int(float(raw))
    except ValueError:
        raise DeviceError(f"{FAKE_GPU_ENV} must be a capacity in bytes, got {raw!r}: unset it, or set it to e.g. "
                          "268435456 (256 MiB) to run the GPU paths on the numpy-backed fake device") from None
    if value <= 0:
        raise DeviceError(f"{FAKE_GPU_ENV} must be a positive number of bytes, got {raw!r}")
    return value


def gpu_status() -> GpuStatus:
    """This process's GPU: the fake one when :data:`FAKE_GPU_ENV` is set, else CuPy's current device.

    Never raises for want of a GPU (that is an answer: ``usable=False`` and why).
    """
    capacity = _fake_capacity()
    if capacity is not None:
        return GpuStatus(True, f"fake GPU of {format_bytes(capacity)} ({FAKE_GPU_ENV}; numpy-backed, for tests)",
                         fake=True, total_bytes=capacity, free_bytes=capacity)
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CuPy built for another CUDA failing at import
        return GpuStatus(False, f"CuPy does not import ({type(exc).__name__}: {exc}); {INSTALL_HINT}")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        if count < 1:
            return GpuStatus(False, "CuPy sees no CUDA device (CUDA_VISIBLE_DEVICES empty?)")
        free, total = cupy.cuda.Device().mem_info
        pool = cupy.get_default_memory_pool()
        # The whole of this worker's pool, the arrays of a task running now included: maps of a pipeline start
        # while the upstream's last task runs, and one single-thread worker per GPU never runs two at once.
        pooled = int(pool.total_bytes())
        # A cap on the pool (CuPy's CUPY_GPU_MEMORY_LIMIT, or MemoryPool.set_limit: how a GPU is shared between
        # processes): CuPy raises OutOfMemoryError past it whatever the device has free. 0: none.
        limit = int(pool.get_limit())
    except Exception as exc:  # noqa: BLE001 - no driver, driver too old, device busy/prohibited
        return GpuStatus(False, f"CuPy cannot use a CUDA device ({type(exc).__name__}: {exc})")
    usable = min(int(total), int(free) + pooled)
    capped = f", CuPy's pool capped at {format_bytes(limit)}" if 0 < limit < usable else ""
    return GpuStatus(True, f"CUDA device {cupy.cuda.Device().id} of {count}, {format_bytes(total)}{capped}",
                     total_bytes=int(total), free_bytes=min(usable, limit) if limit > 0 else usable)


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for this process: ``"auto"`` picks the GPU when :func:`gpu_status` finds one;
    ``"cuda"`` without one is a :class:`DeviceError` saying why and what to do."""
    device = check_device(device)
    if device == CPU:
        return CPU
    status = gpu_status()
    if device == AUTO:
        return CUDA if status.usable else CPU
    if not status.usable:
        raise DeviceError(f"device='cuda' but this process has no usable GPU: {status.why}. Use device='auto' "
                          "to run on the GPU where there is one and on the CPU elsewhere, or device='cpu'")
    return CUDA


def resolve_for_workers(device: str, statuses: Mapping[str, GpuStatus]) -> str:
    """The one device a map's chunks run on, given each worker's :class:`GpuStatus` (pure).

    ``"auto"``: the GPU when every worker has one (a map is learned and planned for
    one device: chunks of one map on two kinds of device would teach one model two
    laws), else the CPU. ``"cuda"``: every worker must have one, else a
    :class:`DeviceError` naming those without and why.

    >>> ok, no = GpuStatus(True, "H100"), GpuStatus(False, "CuPy does not import")
    >>> resolve_for_workers("auto", {"w1": ok, "w2": ok}), resolve_for_workers("auto", {"w1": ok, "w2": no})
    ('cuda', 'cpu')
    """
    device = check_device(device)
    if device == CPU:
        return CPU
    without = {w: s.why for w, s in statuses.items() if not s.usable}
    if device == AUTO:
        return CUDA if statuses and not without else CPU
    if not statuses:
        raise DeviceError("device='cuda' but the cluster has no workers to run it on: start workers with a GPU")
    if without:
        listed = "; ".join(f"{w}: {why}" for w, why in sorted(without.items()))
        raise DeviceError(f"device='cuda' but {len(without)} of {len(statuses)} worker(s) have no usable GPU "
                          f"({listed}). One map runs on one kind of device: run GPU workers only (one worker per "
                          "GPU), or use device='auto' (the CPU unless every worker has a GPU) or device='cpu'")
    return CUDA


# ----------------------------------------------------------------------------- what a task used


@dataclass
class GpuUse:
    """A task's GPU memory: ``peak_bytes`` above what the device held when it started (None on the CPU)."""

    peak_bytes: int | None = None
    method: str = ""  # "cupy-pool" or "fake-tracemalloc"


class FakeGpuOutOfMemoryError(MemoryError):
    """The fake device's out-of-memory (see the module docstring), worded as CuPy's ``OutOfMemoryError``."""


#: CUDA error codes (the runtime's ``cudaError_t`` and the driver's ``CUresult`` agree on these) after which the
#: process's CUDA context is unusable: every later call fails the same way until the process exits (CUDA
#: Runtime API, "Error Handling": "sticky" errors). 214 ECC uncorrectable, 700 illegal address, 702 launch
#: timeout, 709 context destroyed, 710 device-side assert, 714-718 hardware stack / illegal instruction /
#: misaligned address / invalid address space / invalid PC, 719 launch failure.
STICKY_CUDA_ERRORS = frozenset({214, 700, 702, 709, 710, 714, 715, 716, 717, 718, 719})


class FakeGpuContextError(RuntimeError):
    """The fake device's stand-in for a CUDA error that breaks the context (CuPy raises ``CUDARuntimeError`` /
    ``CUDADriverError`` with a ``status`` code), for the tests of what follows one."""

    def __init__(self, message: str, status: int = 700):
        super().__init__(message)
        self.status = status

    def __reduce__(self):
        return (FakeGpuContextError, (self.args[0], self.status))


def is_gpu_context_error(exc: BaseException) -> bool:
    """Whether ``exc``, or an error it was raised from (``__cause__`` / ``__context__``: an operator that wraps
    CuPy's error in its own), is a CUDA error that leaves this process's CUDA context unusable (a code in
    :data:`STICKY_CUDA_ERRORS`, from CuPy's runtime or driver API, or the fake's): only a new process recovers.
    Told by name, so CuPy is not imported to ask."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if (type(e).__name__ in ("CUDARuntimeError", "CUDADriverError", "FakeGpuContextError")
                and getattr(e, "status", None) in STICKY_CUDA_ERRORS):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def is_gpu_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a GPU's out-of-memory (CuPy's ``OutOfMemoryError`` or the fake's), not the host's."""
    return isinstance(exc, MemoryError) and type(exc).__name__ in ("OutOfMemoryError", "FakeGpuOutOfMemoryError")


@dataclass(frozen=True)
class Backend:
    """The array library an operator computes with on one device (see the module docstring)."""

    name: str  # "cpu" or "cuda"
    xp: Any  # numpy or cupy
    fake_capacity: int | None = None  # bytes, for the fake device

    @property
    def on_gpu(self) -> bool:
        return self.name == CUDA

    @property
    def _scipy(self) -> bool:
        return self.name == CPU or self.fake_capacity is not None

    # scipy's (cupyx.scipy's) functions are loaded on first use, not with the backend: scipy.ndimage and
    # scipy.signal hold ~77 MiB, which an operator that needs only the array module (memory_hog) should not
    # pay. Where a first use would fall inside a task's measurement, :meth:`load` them before.
    @functools.cached_property
    def ndimage(self) -> Any:
        """``scipy.ndimage`` or ``cupyx.scipy.ndimage``."""
        if self._scipy:
            from scipy import ndimage

            return ndimage
        from cupyx.scipy import ndimage as cundimage

        return cundimage

    @functools.cached_property
    def hilbert(self) -> Callable[..., Any]:
        """``scipy.signal.hilbert`` or ``cupyx.scipy.signal.hilbert``."""
        if self._scipy:
            from scipy.signal import hilbert

            return hilbert
        from cupyx.scipy.signal import hilbert as cuhilbert

        return cuhilbert

    def load(self) -> "Backend":
        """Load every library this backend's functions use now (they stay loaded in the process), so that no
        task's measurement is charged for loading them; returns the backend."""
        _ = self.ndimage, self.hilbert
        return self

    def asarray(self, host: Any, dtype: Any = None) -> Any:
        """``host`` on this device (a copy on a GPU, fake or real; as is on the CPU)."""
        if self.name == CPU:
            return np.asarray(host, dtype=dtype)
        if self.fake_capacity is not None:
            return np.array(host, dtype=dtype, copy=True)
        return self.xp.asarray(host, dtype=dtype)

    def to_host(self, array: Any) -> np.ndarray:
        """``array`` as a numpy array in host memory."""
        if self.name == CPU:
            return np.asarray(array)
        if self.fake_capacity is not None:
            return np.array(array, copy=True)
        return self.xp.asnumpy(array)

    def eigh(self, stack: Any) -> tuple[Any, Any]:
        """Eigenvalues (ascending) and eigenvectors of a (N, k, k) stack of symmetric matrices.

        On a GPU, in batches of at most :data:`EIGH_BATCH` matrices (see the module docstring).
        """
        xp = self.xp
        if self.name == CPU or len(stack) <= EIGH_BATCH:
            return xp.linalg.eigh(stack)
        n, k = stack.shape[0], stack.shape[-1]
        values = xp.empty((n, k), dtype=stack.dtype)
        vectors = xp.empty(stack.shape, dtype=stack.dtype)
        for start in range(0, n, EIGH_BATCH):
            stop = min(n, start + EIGH_BATCH)
            values[start:stop], vectors[start:stop] = xp.linalg.eigh(stack[start:stop])
        return values, vectors

    @contextlib.contextmanager
    def track(self) -> Iterator[GpuUse]:
        """Measure the GPU memory the block inside uses (see the module docstring); a no-op on the CPU.

        A block that raises has its finished frames' locals released first (:func:`release_frames`): the
        device arrays of a failed task are freed with the pool, not kept alive by its exception.
        """
        use = GpuUse()
        if self.name == CPU:
            yield use
        elif self.fake_capacity is not None:
            with _track_fake(use, self.fake_capacity):
                yield use
        else:
            with _track_cupy(use, self.xp):
                yield use


def release_frames(exc: BaseException) -> None:
    """Drop the local variables of the frames ``exc`` (and the errors it was raised from) unwound through.

    An exception keeps its traceback, which keeps every frame it passed through and their locals: an operator's
    intermediate arrays. Dask keeps a failed task's exception (and Prefect its Failed state, which holds it) until
    the task is released, so without this a task that ran out of memory kept what it had allocated: measured on an
    H100, after one gst3d_dip slab ran out of the GPU's memory every later slab of the same worker found 60-80 GB
    still allocated and ran out too. Frames still executing (the caller's) are left alone.
    """
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__


@contextlib.contextmanager
def _track_cupy(use: GpuUse, cupy: Any) -> Iterator[None]:
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    pool.free_all_blocks()
    before = int(pool.total_bytes())  # live arrays the task did not make
    use.method = "cupy-pool"
    try:
        yield
    except BaseException as exc:
        release_frames(exc)  # before the pool is freed: the failed task's arrays go back to the driver too
        raise
    finally:
        try:
            cupy.cuda.Device().synchronize()
        except Exception:  # noqa: BLE001 - a broken context: the task's own error says so
            pass
        use.peak_bytes = max(0, int(pool.total_bytes()) - before)
        pool.free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()


@contextlib.contextmanager
def _track_fake(use: GpuUse, capacity: int) -> Iterator[None]:
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    before = tracemalloc.get_traced_memory()[0]
    use.method = "fake-tracemalloc"
    failed = False
    try:
        yield
    except BaseException as exc:
        failed = True
        release_frames(exc)
        raise
    finally:
        use.peak_bytes = max(0, tracemalloc.get_traced_memory()[1] - before)
        if started:
            tracemalloc.stop()
    if not failed and use.peak_bytes > capacity:
        raise FakeGpuOutOfMemoryError(
            f"Out of memory on the fake GPU: the task held {use.peak_bytes:,} bytes at its peak, over the device's "
            f"{capacity:,} bytes ({FAKE_GPU_ENV})")


_BACKENDS: dict[tuple[str, int | None], Backend] = {}


def backend(device: str) -> Backend:
    """The :class:`Backend` of ``device`` in this process (``"auto"`` resolved; cached)."""
    name = resolve_device(device)
    fake = _fake_capacity() if name == CUDA else None
    key = (name, fake)
    if key not in _BACKENDS:
        if name == CPU or fake is not None:
            _BACKENDS[key] = Backend(name, np, fake_capacity=fake)
        else:
            import cupy

            _BACKENDS[key] = Backend(name, cupy)
    return _BACKENDS[key]
