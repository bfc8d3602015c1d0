"""Operators: what runs on one block, and where.

- :mod:`~memchunk_prefect.operators.spec`: the :func:`operator` decorator and what it tells the
  runner (halo, memory-relevant parameters, whole traces, device), for any user's operator;
- :mod:`~memchunk_prefect.operators.registry`: the built-in seismic operators by name
  (``OPERATORS``, :func:`~memchunk_prefect.operators.registry.resolve_step`);
- :mod:`~memchunk_prefect.operators.device`: the CPU or an NVIDIA GPU as the array library a block's
  arithmetic runs on.

The built-in operators are imported on first use, so a user's own operator module that only needs
:func:`operator` does not load scipy's filters into every worker.

>>> from memchunk_prefect.operators import envelope, operator_key
>>> operator_key(envelope)
'envelope|float32|cpu'
"""

from __future__ import annotations

import importlib
from typing import Any

from memchunk_prefect.operators.spec import (
    DEFAULT_SPEC,
    SPEC_ATTRIBUTE,
    OperatorSpec,
    operator,
    operator_key,
    operator_name,
    spec_of,
)

_REGISTRY = (
    "OPERATORS", "DEFAULT_STEPS", "get", "resolve_step",
    "envelope", "instantaneous_phase", "instantaneous_frequency", "cosine_phase", "gaussian_smooth",
    "gst3d_dip", "gst3d_azimuth", "semblance", "trace_correlation", "convert",
)

__all__ = ["DEFAULT_SPEC", "SPEC_ATTRIBUTE", "OperatorSpec", "operator", "operator_key", "operator_name",
           "spec_of", *_REGISTRY]


def __getattr__(name: str) -> Any:
    if name in _REGISTRY:
        return getattr(importlib.import_module("memchunk_prefect.operators.registry"), name)
    raise AttributeError(f"module 'memchunk_prefect.operators' has no attribute {name!r}")
