"""Gaussian smoothing of a volume, sigma per axis, in samples."""

from __future__ import annotations

import numpy as np

from memchunk_prefect.operators._common import gaussian_radius, on_device, per_axis, reach
from memchunk_prefect.operators.instantaneous import TASK_OPTIONS
from memchunk_prefect.operators.spec import operator


def gaussian_halo(params) -> tuple[int, int, int]:
    """The kernel radius per axis, ``int(truncate * sigma + 0.5)`` samples: the halo of :func:`gaussian_smooth`.

    >>> gaussian_halo({"sigma": (1, 2, 0), "truncate": 4.0})
    (4, 8, 0)
    """
    sigma = per_axis(params["sigma"], "sigma")
    return tuple(gaussian_radius(s, params["truncate"]) for s in sigma)  # type: ignore[return-value]


@operator(halo=gaussian_halo, memory_params=("sigma",), whole_traces=False, **TASK_OPTIONS)
def gaussian_smooth(block, sigma=(1.0, 1.0, 1.0), truncate=4.0, device="cpu"):
    """Gaussian low-pass filter, :func:`scipy.ndimage.gaussian_filter` in float32 (``cupyx.scipy.ndimage``'s
    on ``device="cuda"``; see :mod:`memchunk_prefect.operators.device`).

    ``sigma`` is one number or three (iline, xline, twt), in samples (not metres
    or ms); 0 leaves that axis unsmoothed. The kernel is cut at ``truncate``
    sigmas, so the halo is the radius ``int(truncate * sigma + 0.5)`` per axis.
    The volume's edges are handled by scipy's ``reflect`` mode; since halos are
    clipped at the volume's edge, a block's edge is then the volume's edge and
    chunked results equal the whole-volume result. ``twt`` may be cut.

    Output in the input's amplitude units. NaN/Inf samples: every output within
    the kernel's box (the halo) of a non-finite sample is NaN.
    """
    sigmas = per_axis(sigma, "sigma")
    be, data, bad = on_device(device, block, "gaussian_smooth", np.float32)
    out = be.ndimage.gaussian_filter(data, sigmas, truncate=float(truncate), mode="reflect", output=be.xp.float32)
    del data
    if bad is not None:
        out[reach(bad, gaussian_halo({"sigma": sigmas, "truncate": truncate}), be)] = be.xp.nan
    return be.to_host(out)
