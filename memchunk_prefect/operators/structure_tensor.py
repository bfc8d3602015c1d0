"""Reflector dip and azimuth from the 3D gradient structure tensor (GST).

Steps, per voxel, all in float64:

1. gradient ``g = (d/d_iline, d/d_xline, d/d_twt)`` by Gaussian-derivative
   filters of scale ``sigma_gradient`` (samples);
2. the six distinct products ``g_a g_b`` smoothed by a Gaussian of scale
   ``sigma_tensor`` (samples): the structure tensor ``T`` (3x3, symmetric);
3. :func:`numpy.linalg.eigh` over the (N, 3, 3) stack of tensors; the normal to
   the reflector is the eigenvector of the largest eigenvalue.

This is the straightforward implementation the reference study profiled: the
float64 tensor stack and its eigenvectors make its peak memory tens of times the
float32 input (see ``python -m benchmarks.studies.operator_memory``).

Units and conventions — axes are in **samples**, not metres or milliseconds: a
reflector that moves one sample down per inline has a dip of 45 degrees. To get
a true dip, rescale the axes first (or convert the result with the bin sizes
and a velocity).

- dip: angle of the normal from vertical (the twt axis), degrees in [0, 90].
- azimuth: direction of steepest descent (down-dip, toward increasing twt) of
  the reflector, degrees in [0, 360), measured from the +iline axis toward the
  +xline axis. The eigenvector's sign is fixed by making its twt component
  non-positive (pointing up), whose horizontal projection points down-dip. For
  near-flat reflectors the azimuth is poorly defined (numerically arbitrary).

Halo per axis: the derivative radius plus the tensor smoothing radius,
``int(truncate * sigma_gradient + 0.5) + int(truncate * sigma_tensor + 0.5)``.
Edges: scipy's ``reflect`` mode at the block's edge, which (halos being clipped
at the volume's edge) is the volume's edge, so chunked results are exact.

Undefined outputs are NaN: where the tensor is zero (constant or dead data,
no gradient at all), and where a NaN/Inf sample lies within the halo box of the
output (non-finite samples are set to zero before filtering, so ``eigh`` never
sees them).

``device``: ``"cpu"`` (scipy, numpy), ``"cuda"`` (cupyx.scipy.ndimage, and
``cupy.linalg.eigh`` in batches of at most 2^20 matrices, see
:mod:`memchunk_prefect.operators.device`) or ``"auto"``. The GPU path is the same
algorithm; its peak GPU memory on an H100 was ~8.6 GiB fixed (cusolver's batched
eigh workspace and the CUDA context) plus ~40x the float32 input.
"""

from __future__ import annotations

import numpy as np

from memchunk_prefect.operators._common import gaussian_radius, on_device, per_axis, reach
from memchunk_prefect.operators.device import Backend, backend
from memchunk_prefect.operators.instantaneous import TASK_OPTIONS
from memchunk_prefect.operators.spec import operator

_DERIVATIVE_ORDERS = ((1, 0, 0), (0, 1, 0), (0, 0, 1))


def gst_halo(params) -> tuple[int, int, int]:
    """Derivative radius + tensor smoothing radius per axis, in samples.

    >>> gst_halo({"sigma_gradient": 1.0, "sigma_tensor": 2.0, "truncate": 4.0})
    (12, 12, 12)
    """
    sg = per_axis(params["sigma_gradient"], "sigma_gradient", allow_zero=False)
    st = per_axis(params["sigma_tensor"], "sigma_tensor")
    t = params["truncate"]
    return tuple(gaussian_radius(a, t) + gaussian_radius(b, t) for a, b in zip(sg, st))  # type: ignore[return-value]


def structure_tensor_normals(block, sigma_gradient, sigma_tensor, truncate, operator_name="gst3d",
                             be: Backend | None = None):
    """Unit normals (..., 3) in (iline, xline, twt) sample axes, twt component <= 0; NaN where undefined.

    ``be``: the backend to compute on (the CPU's by default); the normals are its arrays.
    """
    sg = per_axis(sigma_gradient, "sigma_gradient", allow_zero=False)
    st = per_axis(sigma_tensor, "sigma_tensor")
    be, data, bad = on_device((be or backend("cpu")).name, block, operator_name, np.float64)
    xp, shape = be.xp, data.shape

    gradients = [be.ndimage.gaussian_filter(data, sg, order=order, truncate=truncate, mode="reflect")
                 for order in _DERIVATIVE_ORDERS]
    del data
    tensor = xp.empty(shape + (3, 3), dtype=xp.float64)
    for a in range(3):
        for b in range(a, 3):
            smoothed = be.ndimage.gaussian_filter(gradients[a] * gradients[b], st, truncate=truncate, mode="reflect")
            tensor[..., a, b] = smoothed
            tensor[..., b, a] = smoothed
    del gradients, smoothed

    eigenvalues, eigenvectors = be.eigh(tensor.reshape(-1, 3, 3))  # ascending eigenvalues
    del tensor
    normals = eigenvectors[:, :, 2].reshape(shape + (3,))
    largest = eigenvalues[:, 2].reshape(shape)
    del eigenvalues, eigenvectors

    # An eigenvector's sign is arbitrary: make it point up (twt component <= 0); for an exactly
    # horizontal normal, make the iline component (then the xline one) non-negative.
    nt = normals[..., 2]
    horizontal = nt == 0
    flip = (nt > 0) | (horizontal & ((normals[..., 0] < 0) | ((normals[..., 0] == 0) & (normals[..., 1] < 0))))
    normals[flip] *= -1.0

    undefined = ~(largest > 0)
    if bad is not None:
        undefined |= reach(bad, gst_halo({"sigma_gradient": sg, "sigma_tensor": st, "truncate": truncate}), be)
    normals[undefined] = xp.nan
    return normals


@operator(halo=gst_halo, memory_params=("sigma_gradient", "sigma_tensor"), whole_traces=False, **TASK_OPTIONS)
def gst3d_dip(block, sigma_gradient=1.0, sigma_tensor=2.0, truncate=4.0, device="cpu"):
    """Reflector dip from the gradient structure tensor: degrees in [0, 90] from horizontal, in sample axes.

    0 for flat reflectors, 90 for vertical ones. ``sigma_gradient`` and
    ``sigma_tensor`` are one number or three (iline, xline, twt), in samples.
    NaN where undefined (zero tensor, or a NaN/Inf sample within the halo).
    See the module docstring for conventions and the halo.
    """
    be = backend(device)
    xp = be.xp
    n = structure_tensor_normals(block, sigma_gradient, sigma_tensor, float(truncate), "gst3d_dip", be)
    dip = xp.degrees(xp.arctan2(xp.hypot(n[..., 0], n[..., 1]), xp.abs(n[..., 2])))
    return be.to_host(dip.astype(xp.float32))


@operator(halo=gst_halo, memory_params=("sigma_gradient", "sigma_tensor"), whole_traces=False, **TASK_OPTIONS)
def gst3d_azimuth(block, sigma_gradient=1.0, sigma_tensor=2.0, truncate=4.0, device="cpu"):
    """Reflector dip azimuth (down-dip direction) from the gradient structure tensor: degrees in [0, 360).

    Measured from the +iline axis toward the +xline axis, in sample axes: 0 when
    the reflector deepens toward increasing inline, 90 toward increasing
    crossline. NaN where undefined (zero tensor, or a NaN/Inf sample within the
    halo). See the module docstring for conventions and the halo.
    """
    be = backend(device)
    xp = be.xp
    n = structure_tensor_normals(block, sigma_gradient, sigma_tensor, float(truncate), "gst3d_azimuth", be)
    azimuth = xp.mod(xp.degrees(xp.arctan2(n[..., 1], n[..., 0])), 360.0).astype(xp.float32)
    azimuth[azimuth >= np.float32(360.0)] = 0.0  # a tiny negative angle rounds to 360 in float32
    return be.to_host(azimuth)
