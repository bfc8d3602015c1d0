"""The operators this Prefect project's flows run: the library's seismic operators by name.

A project's own operator goes here too, made with :func:`memchunk_prefect.operators.operator`
(see the docs' "Your own operator" guide).
"""

from memchunk_prefect.operators import (
    OPERATORS,
    cosine_phase,
    envelope,
    gaussian_smooth,
    gst3d_azimuth,
    gst3d_dip,
    instantaneous_frequency,
    instantaneous_phase,
    semblance,
    trace_correlation,
)

__all__ = ["OPERATORS", "cosine_phase", "envelope", "gaussian_smooth", "gst3d_azimuth", "gst3d_dip",
           "instantaneous_frequency", "instantaneous_phase", "semblance", "trace_correlation"]
