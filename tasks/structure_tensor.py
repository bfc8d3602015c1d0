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
float32 input (see ``python -m benchmarks.operator_memory``).

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
"""

from __future__ import annotations

import numpy as np
from scipy import ndimage

from memchunk_prefect.operators import operator

from ._common import check_block, gaussian_radius, per_axis, reach, split_finite
from .instantaneous import TASK_OPTIONS

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


def structure_tensor_normals(block, sigma_gradient, sigma_tensor, truncate, operator_name="gst3d"):
    """Unit normals (..., 3) in (iline, xline, twt) sample axes, twt component <= 0; NaN where undefined."""
    arr = check_block(block, operator_name)
    sg = per_axis(sigma_gradient, "sigma_gradient", allow_zero=False)
    st = per_axis(sigma_tensor, "sigma_tensor")
    data, bad = split_finite(arr, np.float64)

    gradients = [ndimage.gaussian_filter(data, sg, order=order, truncate=truncate, mode="reflect")
                 for order in _DERIVATIVE_ORDERS]
    del data
    tensor = np.empty(arr.shape + (3, 3), dtype=np.float64)
    for a in range(3):
        for b in range(a, 3):
            smoothed = ndimage.gaussian_filter(gradients[a] * gradients[b], st, truncate=truncate, mode="reflect")
            tensor[..., a, b] = smoothed
            tensor[..., b, a] = smoothed
    del gradients, smoothed

    eigenvalues, eigenvectors = np.linalg.eigh(tensor.reshape(-1, 3, 3))  # ascending eigenvalues
    del tensor
    normals = eigenvectors[:, :, 2].reshape(arr.shape + (3,))
    largest = eigenvalues[:, 2].reshape(arr.shape)
    del eigenvalues, eigenvectors

    # An eigenvector's sign is arbitrary: make it point up (twt component <= 0); for an exactly
    # horizontal normal, make the iline component (then the xline one) non-negative.
    nt = normals[..., 2]
    horizontal = nt == 0
    flip = (nt > 0) | (horizontal & ((normals[..., 0] < 0) | ((normals[..., 0] == 0) & (normals[..., 1] < 0))))
    normals[flip] *= -1.0

    undefined = ~(largest > 0)
    if bad is not None:
        undefined |= reach(bad, gst_halo({"sigma_gradient": sg, "sigma_tensor": st, "truncate": truncate}))
    normals[undefined] = np.nan
    return normals


@operator(halo=gst_halo, memory_params=("sigma_gradient", "sigma_tensor"), whole_traces=False, **TASK_OPTIONS)
def gst3d_dip(block, sigma_gradient=1.0, sigma_tensor=2.0, truncate=4.0):
    """Reflector dip from the gradient structure tensor: degrees in [0, 90] from horizontal, in sample axes.

    0 for flat reflectors, 90 for vertical ones. ``sigma_gradient`` and
    ``sigma_tensor`` are one number or three (iline, xline, twt), in samples.
    NaN where undefined (zero tensor, or a NaN/Inf sample within the halo).
    See the module docstring for conventions and the halo.
    """
    n = structure_tensor_normals(block, sigma_gradient, sigma_tensor, float(truncate), "gst3d_dip")
    dip = np.degrees(np.arctan2(np.hypot(n[..., 0], n[..., 1]), np.abs(n[..., 2])))
    return dip.astype(np.float32)


@operator(halo=gst_halo, memory_params=("sigma_gradient", "sigma_tensor"), whole_traces=False, **TASK_OPTIONS)
def gst3d_azimuth(block, sigma_gradient=1.0, sigma_tensor=2.0, truncate=4.0):
    """Reflector dip azimuth (down-dip direction) from the gradient structure tensor: degrees in [0, 360).

    Measured from the +iline axis toward the +xline axis, in sample axes: 0 when
    the reflector deepens toward increasing inline, 90 toward increasing
    crossline. NaN where undefined (zero tensor, or a NaN/Inf sample within the
    halo). See the module docstring for conventions and the halo.
    """
    n = structure_tensor_normals(block, sigma_gradient, sigma_tensor, float(truncate), "gst3d_azimuth")
    azimuth = np.mod(np.degrees(np.arctan2(n[..., 1], n[..., 0])), 360.0).astype(np.float32)
    azimuth[azimuth >= np.float32(360.0)] = 0.0  # a tiny negative angle rounds to 360 in float32
    return azimuth
