"""Complex-trace (instantaneous) attributes: envelope, phase, frequency, cosine of phase.

All four start from the analytic signal ``z = x + i H[x]`` of each trace, with
the Hilbert transform ``H`` computed by :func:`scipy.signal.hilbert` along
``twt`` (FFT over the whole trace). That transform is global along the trace, so
these operators declare ``whole_traces=True`` (the planner never cuts ``twt``)
and a zero halo: each trace is computed alone, so the result is exact under any
iline/xline chunking.

NaN/Inf samples: a non-finite sample is treated as a zero (dead) sample for the
transform, and that sample's output is NaN. The rest of the trace is computed
from the zero-filled trace (a single bad sample does not blank a whole trace).

Samples where the envelope is exactly zero (dead traces) have no defined phase:
they give phase 0, cosine of phase 1 and frequency 0 Hz.
"""

from __future__ import annotations

import numpy as np
from prefect.cache_policies import NO_CACHE
from scipy.signal import hilbert

from memchunk_prefect.operators import operator

from ._common import check_block, split_finite

#: Blocks are large arrays: hashing them for Prefect's input cache would cost time and memory
#: for no benefit (the runner writes results by region and never re-uses a cached block).
TASK_OPTIONS = {"cache_policy": NO_CACHE}

_PI32 = np.float32(np.pi)


def _analytic(block, operator_name: str):
    """The analytic signal of each trace (complex64 for float32 input) and the non-finite mask."""
    arr = check_block(block, operator_name)
    data, bad = split_finite(arr, np.float32)
    return hilbert(data, axis=-1), bad


def _finish(values: np.ndarray, bad: np.ndarray | None) -> np.ndarray:
    out = np.asarray(values, dtype=np.float32)
    if bad is not None:
        out[bad] = np.nan
    return out


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def envelope(block):
    """Envelope (instantaneous amplitude) ``|x + i H[x]|`` of each trace, in the input's amplitude units.

    Non-negative. Halo (0, 0, 0); whole traces. Non-finite input samples give NaN there.
    """
    z, bad = _analytic(block, "envelope")
    return _finish(np.abs(z), bad)


def _phase32(z: np.ndarray) -> np.ndarray:
    """``angle(z)`` as float32 in (-pi, pi]: -pi (after rounding to float32) is reported as +pi."""
    phase = np.angle(z).astype(np.float32)
    phase[phase <= -_PI32] = _PI32
    return phase


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def instantaneous_phase(block):
    """Instantaneous phase ``angle(x + i H[x])`` in radians, in (-pi, pi] (float32 pi bounds).

    Not unwrapped. Phase 0 where the envelope is zero. Halo (0, 0, 0); whole
    traces. Non-finite input samples give NaN there.
    """
    z, bad = _analytic(block, "instantaneous_phase")
    return _finish(_phase32(z), bad)


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def cosine_phase(block):
    """Cosine of the instantaneous phase, ``x / |z|``: dimensionless, in [-1, 1].

    Shows reflector continuity independent of amplitude. 1 where the envelope
    is zero. Halo (0, 0, 0); whole traces. Non-finite input samples give NaN there.
    """
    z, bad = _analytic(block, "cosine_phase")
    return _finish(np.cos(np.angle(z)), bad)


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def instantaneous_frequency(block, sample_interval_ms=4.0):
    """Instantaneous frequency in Hz: the time derivative of the phase over 2 pi.

    Computed without unwrapping from the analytic signal ``z = x + i y``::

        f = (x dy/dt - y dx/dt) / (2 pi (x^2 + y^2))

    with ``d/dt`` by central differences (one-sided at the trace ends,
    :func:`numpy.gradient`) over ``sample_interval_ms`` milliseconds, in float64.
    It can be negative, and spikes where the envelope nearly vanishes (as the
    instantaneous frequency does by definition); 0 Hz where the envelope is
    exactly zero. Halo (0, 0, 0); whole traces. Non-finite input samples give NaN there.
    """
    dt_s = float(sample_interval_ms) / 1000.0
    if not np.isfinite(dt_s) or dt_s <= 0:
        raise ValueError(f"`sample_interval_ms` must be a positive number of milliseconds, got {sample_interval_ms!r}")
    z, bad = _analytic(block, "instantaneous_frequency")
    x = z.real.astype(np.float64)
    y = z.imag.astype(np.float64)
    del z
    numerator = x * np.gradient(y, dt_s, axis=-1)
    numerator -= y * np.gradient(x, dt_s, axis=-1)
    power = x * x
    power += y * y
    del x, y
    zero = power == 0
    power[zero] = 1.0
    freq = numerator / (2.0 * np.pi * power)
    freq[zero] = 0.0
    return _finish(freq, bad)
