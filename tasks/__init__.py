"""Seismic attribute operators as Prefect tasks.

Each operator is made with :func:`memchunk_prefect.operators.operator`: its
``.fn(block, **params)`` works on a plain numpy block ``(iline, xline, twt)``
and returns a float32 block of the same shape, and it declares its halo
(samples per axis) from its parameters, its memory-relevant parameters, and
whether it needs whole traces.

>>> import numpy as np
>>> from memchunk_prefect.operators import spec_of
>>> spec_of(gaussian_smooth).halo_for({"sigma": (1, 1, 2)})
(4, 4, 8)
>>> gaussian_smooth.fn(np.zeros((2, 3, 20), np.float32)).shape
(2, 3, 20)
>>> sorted(OPERATORS)[:3]
['cosine_phase', 'envelope', 'gaussian_smooth']

| operator | units, range | halo (iline, xline, twt) | memory params | whole traces |
|---|---|---|---|---|
| envelope | amplitude, >= 0 | (0, 0, 0) | - | yes |
| instantaneous_phase | radians, (-pi, pi] | (0, 0, 0) | - | yes |
| instantaneous_frequency | Hz | (0, 0, 0) | - | yes |
| cosine_phase | [-1, 1] | (0, 0, 0) | - | yes |
| gaussian_smooth | amplitude | int(truncate*sigma+0.5) | sigma | no |
| gst3d_dip | degrees, [0, 90] | gradient + tensor radius | sigma_gradient, sigma_tensor | no |
| gst3d_azimuth | degrees, [0, 360) | gradient + tensor radius | sigma_gradient, sigma_tensor | no |
| semblance | [0, 1] | window half-widths | window | no |
| trace_correlation | [-1, 1], memory O(traces^2) | (r_il, r_xl, 0) | - | yes |
"""

from __future__ import annotations

from .discontinuity import semblance, trace_correlation
from .instantaneous import cosine_phase, envelope, instantaneous_frequency, instantaneous_phase
from .smoothing import gaussian_smooth
from .structure_tensor import gst3d_azimuth, gst3d_dip

#: Every operator by name (the Prefect task name).
OPERATORS = {
    task.name: task
    for task in (
        envelope,
        instantaneous_phase,
        instantaneous_frequency,
        cosine_phase,
        gaussian_smooth,
        gst3d_dip,
        gst3d_azimuth,
        semblance,
        trace_correlation,
    )
}

__all__ = sorted(OPERATORS) + ["OPERATORS"]
