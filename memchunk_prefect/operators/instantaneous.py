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
they give phase 0 and cosine of phase 1, and no phase advance for the frequency.

``device``: ``"cpu"`` (scipy.signal.hilbert), ``"cuda"`` (cupyx.scipy.signal.hilbert)
or ``"auto"``; see :mod:`memchunk_prefect.operators.device`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from prefect.cache_policies import NO_CACHE

from memchunk_prefect.operators._common import on_device
from memchunk_prefect.operators.device import Backend
from memchunk_prefect.operators.spec import operator

#: Blocks are large arrays: hashing them for Prefect's input cache would cost time and memory
#: for no benefit (the runner writes results by region and never re-uses a cached block).
TASK_OPTIONS: dict[str, Any] = {"cache_policy": NO_CACHE}

_PI32 = np.float32(np.pi)


def _analytic(block, operator_name: str, device: str):
    """The backend, the analytic signal of each trace on it (complex64 for float32 input), the non-finite mask."""
    be, data, bad = on_device(device, block, operator_name, np.float32)
    return be, be.hilbert(data, axis=-1), bad


def _finish(be: Backend, values, bad) -> np.ndarray:
    """``values`` as float32 in host memory, NaN where the input was not finite."""
    out = values.astype(be.xp.float32, copy=False)
    if bad is not None:
        out[bad] = be.xp.nan
    return be.to_host(out)


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def envelope(block, device="cpu"):
    """Envelope (instantaneous amplitude) ``|x + i H[x]|`` of each trace, in the input's amplitude units.

    Non-negative. Halo (0, 0, 0); whole traces. Non-finite input samples give NaN there.
    """
    be, z, bad = _analytic(block, "envelope", device)
    return _finish(be, be.xp.abs(z), bad)


def _phase32(z, be: Backend | None = None):
    """``angle(z)`` as float32 in (-pi, pi]: -pi (after rounding to float32) is reported as +pi.
    ``be``: the backend whose array ``z`` is (the CPU's by default)."""
    xp = be.xp if be is not None else np
    phase = xp.angle(z).astype(xp.float32)
    phase[phase <= -_PI32] = _PI32
    return phase


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def instantaneous_phase(block, device="cpu"):
    """Instantaneous phase ``angle(x + i H[x])`` in radians, in (-pi, pi] (float32 pi bounds).

    Not unwrapped. Phase 0 where the envelope is zero. Halo (0, 0, 0); whole
    traces. Non-finite input samples give NaN there.
    """
    be, z, bad = _analytic(block, "instantaneous_phase", device)
    return _finish(be, _phase32(z, be), bad)


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def cosine_phase(block, device="cpu"):
    """Cosine of the instantaneous phase, ``x / |z|``: dimensionless, in [-1, 1].

    Shows reflector continuity independent of amplitude. 1 where the envelope
    is zero. Halo (0, 0, 0); whole traces. Non-finite input samples give NaN there.
    """
    be, z, bad = _analytic(block, "cosine_phase", device)
    return _finish(be, be.xp.cos(be.xp.angle(z)), bad)


@operator(halo=(0, 0, 0), whole_traces=True, **TASK_OPTIONS)
def instantaneous_frequency(block, sample_interval_ms=4.0, device="cpu"):
    """Instantaneous frequency in Hz: the rate of change of the instantaneous phase over 2 pi.

    Computed from the analytic signal ``z`` without unwrapping, as the phase
    advance between neighbouring samples, ``angle(z[t+1] * conj(z[t]))`` (always
    in (-pi, pi], so no unwrapping is needed), averaged over the step before and
    the step after each sample (one-sided at the trace ends), divided by
    ``2 pi dt`` with ``dt = sample_interval_ms / 1000`` s (Barnes, 1992). Unlike
    the derivative form ``(x dy/dt - y dx/dt) / (2 pi (x^2 + y^2))`` with finite
    differences, this is exact for a pure tone at any frequency below Nyquist
    (finite differences read a 25 Hz cosine at 4 ms as 23.4 Hz), and needs no
    division by the envelope. In float64.

    It can be negative and is erratic where the envelope nearly vanishes (as the
    instantaneous frequency is, by definition). A step touching a sample of zero
    envelope counts as no phase advance; one-sample traces give 0 Hz. Halo
    (0, 0, 0); whole traces. Non-finite input samples give NaN there.
    """
    dt_s = float(sample_interval_ms) / 1000.0
    if not np.isfinite(dt_s) or dt_s <= 0:
        raise ValueError(f"`sample_interval_ms` must be a positive number of milliseconds, got {sample_interval_ms!r}")
    be, z, bad = _analytic(block, "instantaneous_frequency", device)
    xp = be.xp
    z = z.astype(xp.complex128)
    freq = xp.zeros(z.shape, dtype=xp.float64)
    if z.shape[-1] > 1:
        step = xp.angle(z[..., 1:] * xp.conj(z[..., :-1]))  # phase advance per sample, radians
        del z
        freq[..., 0] = step[..., 0]
        freq[..., -1] = step[..., -1]
        freq[..., 1:-1] = 0.5 * (step[..., 1:] + step[..., :-1])
        freq /= 2.0 * np.pi * dt_s
    return _finish(be, freq, bad)
