"""Small helpers shared by the operators: block checks, per-axis parameters, non-finite handling.

Every built-in operator follows one rule for NaN/Inf input (see each
docstring for the detail): a non-finite sample never crashes an operator and
never leaks into numerical kernels (``eigh``, FFTs) — it is replaced by zero for
the computation, and the outputs it could have influenced come back as NaN.
For windowed operators that is every output whose support (its halo box)
holds a non-finite sample, which keeps the rule exact under chunking.

Devices: every operator takes ``device`` (``"cpu"``, ``"cuda"``, ``"auto"``; see
:mod:`memchunk_prefect.operators.device`). Blocks come in and go out as numpy arrays in
host memory; in between the arithmetic runs on the device's array library (a
:class:`~memchunk_prefect.operators.device.Backend`), with the same code for both.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from memchunk_prefect.core.chunks import AXES
from memchunk_prefect.core.errors import VolumeError
from memchunk_prefect.operators.device import Backend, backend

# Load the CPU backend's libraries (scipy.ndimage, scipy.signal: about 77 MiB resident) when an operator module is
# imported, which on a worker happens when the task is unpickled, before run_block starts measuring. Loaded lazily
# inside the first chunk instead, they were charged to that chunk's peak and taught the model a multiple several
# times too high (a 48 MiB budget then refused every chunk of envelope as too large).
backend("cpu").load()

Triple = tuple[float, float, float]


def is_device_array(block: Any) -> bool:
    """Whether ``block`` lives in GPU memory (a CuPy array, or any array exposing ``__cuda_array_interface__``)."""
    return hasattr(block, "__cuda_array_interface__")


def check_block(block: Any, operator: str) -> Any:
    """The block as an ndarray (a GPU array stays one); refuse anything that is not a non-empty 3D (iline, xline,
    twt) block."""
    arr = block if is_device_array(block) else np.asarray(block)
    if arr.ndim != 3:
        raise VolumeError(
            f"{operator} needs a 3D block (iline, xline, twt), got an array of shape {arr.shape}; "
            "a single trace or inline must keep its axes, e.g. block[None, None, :] or block[None]"
        )
    if arr.size == 0:
        raise VolumeError(f"{operator} got an empty block of shape {arr.shape}: every axis needs at least one sample")
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise VolumeError(f"{operator} needs a real-valued block, got dtype {arr.dtype}")
    return arr


def per_axis(value: Any, name: str, *, n: int = 3, allow_zero: bool = True) -> tuple[float, ...]:
    """A scalar or ``n`` values (one per axis) as a tuple of non-negative finite floats."""
    if np.ndim(value) == 0:
        values = (float(value),) * n
    else:
        values = tuple(float(v) for v in value)
    if len(values) != n:
        axes = ", ".join(AXES[:n])
        raise ValueError(f"`{name}` must be one number or {n} numbers ({axes}), got {value!r}")
    bad = [v for v in values if not np.isfinite(v) or v < 0 or (v == 0 and not allow_zero)]
    if bad:
        need = "positive" if not allow_zero else "non-negative"
        raise ValueError(f"`{name}` must be {need} and finite on every axis, got {value!r}")
    return values


def per_axis_int(value: Any, name: str, *, n: int = 3) -> tuple[int, ...]:
    """A scalar or ``n`` non-negative ints (window half-widths)."""
    floats = per_axis(value, name, n=n)
    ints = tuple(int(v) for v in floats)
    if ints != floats:
        raise ValueError(f"`{name}` must be whole numbers of samples, got {value!r}")
    return ints


def gaussian_radius(sigma: float, truncate: float) -> int:
    """The kernel radius (samples) scipy.ndimage uses for one axis: ``int(truncate * sigma + 0.5)``.

    >>> gaussian_radius(1.0, 4.0), gaussian_radius(2.5, 4.0), gaussian_radius(0.0, 4.0)
    (4, 10, 0)
    """
    return int(float(truncate) * float(sigma) + 0.5)


def on_device(device: str, block: Any, operator: str, dtype: Any) -> tuple[Backend, Any, Any]:
    """``(backend, data, bad)``: the checked host block on ``device`` as ``dtype``, non-finite samples set to 0,
    and their mask (see :func:`split_finite`), both on the device."""
    be = backend(device)
    arr = check_block(block, operator)
    if is_device_array(arr) and not be.on_gpu:
        raise VolumeError(f"{operator} got a block in GPU memory ({type(arr).__module__}.{type(arr).__name__}) to run "
                          f"on the CPU (device={device!r}): pass device='cuda' (or 'auto') to compute it on the GPU, "
                          "or move it to host memory first (cupy.asnumpy)")
    data, bad = split_finite(be.asarray(arr), dtype, be)
    return be, data, bad


def split_finite(block: Any, dtype: Any, be: Backend | None = None) -> tuple[Any, Any]:
    """``(data, bad)``: the block as ``dtype`` with non-finite samples set to 0, and their mask.

    ``bad`` is None when every sample is finite (the common case costs no mask).
    ``be``: the backend whose arrays these are (the CPU's by default).
    """
    xp = (be or backend("cpu")).xp
    finite = xp.isfinite(block)
    if bool(finite.all()):
        return block.astype(dtype, copy=False), None
    return xp.where(finite, block, 0).astype(dtype, copy=False), ~finite


def reach(bad: Any, radius: Sequence[int], be: Backend | None = None) -> Any:
    """Outputs whose box of half-widths ``radius`` (per axis) holds at least one ``bad`` sample.

    A box dilation, clipped at the block's edges like the halos are, so it is
    exact under chunking whenever the halo is at least ``radius``. ``be``: the
    backend whose arrays these are (the CPU's by default).
    """
    be = be or backend("cpu")
    out = bad.view(be.xp.uint8) if bad.dtype == be.xp.bool_ else bad.astype(be.xp.uint8)
    for axis, r in enumerate(radius):
        if r > 0:
            out = be.ndimage.maximum_filter1d(out, size=2 * int(r) + 1, axis=axis, mode="constant", cval=0)
    return out.astype(bool)
