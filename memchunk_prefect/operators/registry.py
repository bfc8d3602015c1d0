"""The built-in seismic operators by name: the registry the pipeline, the simulator and the CLI look up.

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
['convert', 'cosine_phase', 'envelope']

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
| convert | the input's (a copy to another store) | (0, 0, 0) | - | yes |
"""

from __future__ import annotations

import inspect
from typing import Any

from memchunk_prefect.core.errors import RunnerConfigError
from memchunk_prefect.operators.conversion import convert
from memchunk_prefect.operators.discontinuity import semblance, trace_correlation
from memchunk_prefect.operators.instantaneous import (
    cosine_phase,
    envelope,
    instantaneous_frequency,
    instantaneous_phase,
)
from memchunk_prefect.operators.smoothing import gaussian_smooth
from memchunk_prefect.operators.structure_tensor import gst3d_azimuth, gst3d_dip

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
        convert,
    )
}

#: The demo's chain: a light operator, a moderate one, and the heavy structure tensor (~60x its input).
DEFAULT_STEPS: list[dict[str, Any]] = [
    {"name": "envelope"},
    {"name": "gaussian_smooth", "sigma": [2.0, 2.0, 2.0]},
    {"name": "gst3d_dip"},
]


def get(name: str) -> Any:
    """The built-in operator called ``name``; :class:`RunnerConfigError` naming the choices otherwise."""
    if name not in OPERATORS:
        raise RunnerConfigError(f"unknown operator {name!r}: choose from {', '.join(sorted(OPERATORS))}")
    return OPERATORS[name]


def resolve_step(step: dict[str, Any] | str, *, reserved: tuple[str, ...] = ("name",)) -> tuple[Any, dict[str, Any]]:
    """``{"name": ..., **params}`` (or just a name) -> (the operator task, its parameters).

    Keys in ``reserved`` are the caller's own (e.g. ``output``), not parameters. Unknown
    operators and parameters the operator does not take are refused before anything runs.

    >>> task, params = resolve_step({"name": "gaussian_smooth", "sigma": [1, 1, 2]})
    >>> task.name, params
    ('gaussian_smooth', {'sigma': (1, 1, 2)})
    """
    if isinstance(step, str):
        step = {"name": step}
    if not isinstance(step, dict) or "name" not in step:
        raise RunnerConfigError(f"a step must be an operator name or a dict with a 'name', got {step!r}")
    task = get(step["name"])
    params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in step.items() if k not in reserved}
    accepted = list(inspect.signature(task.fn).parameters)[1:]  # the first is the block
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise RunnerConfigError(f"{task.name} has no parameter {', '.join(map(repr, unknown))}; it takes "
                                f"{', '.join(accepted) or 'none'}")
    return task, params
