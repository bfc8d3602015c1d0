"""Lateral continuity attributes: windowed semblance, and a deliberately dense trace correlation.

``device``: ``"cpu"``, ``"cuda"`` (CuPy) or ``"auto"``; see :mod:`memchunk_prefect.operators.device`.
"""

from __future__ import annotations

import numpy as np

from memchunk_prefect.operators._common import on_device, per_axis_int, reach
from memchunk_prefect.operators.device import Backend
from memchunk_prefect.operators.instantaneous import TASK_OPTIONS
from memchunk_prefect.operators.spec import operator


def semblance_halo(params) -> tuple[int, int, int]:
    """The window half-widths (iline, xline, twt) in samples.

    >>> semblance_halo({"window": (1, 2, 5)})
    (1, 2, 5)
    """
    return per_axis_int(params["window"], "window")  # type: ignore[return-value]


def _box_sum(be: Backend, values, half_widths):
    """Sum over a centred box, zero outside the block (direct sums, so bitwise equal on any sub-block)."""
    for axis, w in enumerate(half_widths):
        if w > 0:
            values = be.ndimage.correlate1d(values, be.xp.ones(2 * w + 1), axis=axis, mode="constant", cval=0.0)
    return values


def _window_counts(be: Backend, n: int, w: int):
    """How many positions of ``range(n)`` a window of half-width ``w`` centred on each one covers."""
    xp = be.xp
    i = xp.arange(n)
    return (xp.minimum(i + w, n - 1) - xp.maximum(i - w, 0) + 1).astype(xp.float64)


@operator(halo=semblance_halo, memory_params=("window",), whole_traces=False, **TASK_OPTIONS)
def semblance(block, window=(1, 1, 4), device="cpu"):
    """Marfurt-style semblance (coherence), dimensionless in [0, 1]: 1 = laterally continuous.

    Over the ``(2 w_il + 1) x (2 w_xl + 1)`` traces and ``2 w_t + 1`` samples
    centred on each output (``window = (w_il, w_xl, w_t)`` half-widths in
    samples, one number for all three)::

        S = sum_t (sum_j u_j(t))^2 / (J sum_t sum_j u_j(t)^2)

    where ``J`` is the number of traces in the window. This returns semblance,
    not ``1 - semblance``: faults and channels show as *low* values. Computed
    in float64. At the volume's edges the window is truncated to the traces
    and samples that exist (``J`` counts only those), so the result stays in
    [0, 1]; halos are clipped at the volume's edge, so chunked results are exact.
    The halo is the window's half-widths; ``twt`` may be cut.

    NaN where the window holds no energy (all zero: semblance is 0/0) and
    wherever a NaN/Inf sample lies within the window.
    """
    w = per_axis_int(window, "window")
    be, u, bad = on_device(device, block, "semblance", np.float64)
    xp, shape = be.xp, u.shape

    lateral_sum = _box_sum(be, u, (w[0], w[1], 0))
    numerator = _box_sum(be, lateral_sum * lateral_sum, (0, 0, w[2]))
    del lateral_sum
    energy = _box_sum(be, u * u, w)
    del u
    traces = (_window_counts(be, shape[0], w[0])[:, None, None]
              * _window_counts(be, shape[1], w[1])[None, :, None])
    denominator = traces * energy
    del energy
    undefined = ~(denominator > 0)
    denominator[undefined] = 1.0
    out = xp.clip(numerator / denominator, 0.0, 1.0).astype(xp.float32)
    out[undefined] = xp.nan
    if bad is not None:
        out[reach(bad, w, be)] = xp.nan
    return be.to_host(out)


def trace_correlation_halo(params) -> tuple[int, int, int]:
    """The lateral radius (iline, xline) and no time halo.

    >>> trace_correlation_halo({"radius": (2, 1)})
    (2, 1, 0)
    """
    r = per_axis_int(params["radius"], "radius", n=2)
    return (r[0], r[1], 0)


@operator(halo=trace_correlation_halo, memory_params=(), whole_traces=True, **TASK_OPTIONS)
def trace_correlation(block, radius=(1, 1), device="cpu"):
    """Mean correlation coefficient of each whole trace with its lateral neighbours, in [-1, 1].

    For each trace, the zero-lag Pearson correlation (over the whole trace) with
    every other trace within ``radius = (r_il, r_xl)`` traces (one number for
    both), averaged; the value is repeated along ``twt`` so the output has the
    block's shape. A trace-to-trace continuity map: low where traces change
    laterally (faults, noise).

    **Deliberately superlinear in memory**: it forms the dense (N x N) float64
    Gram matrix of all N = n_il x n_xl traces of the block (one BLAS call) and
    then reads only the neighbour entries, so its peak memory grows as
    ``8 N^2`` bytes — quadratically in the chunk's lateral size — while a
    neighbours-only loop would be linear. It exists so that memory models can be
    tested against an operator that is not linear in the chunk's elements; it is
    exact under chunking (halo ``(r_il, r_xl, 0)``, whole traces).

    Constant (e.g. dead) traces correlate 0 with everything. Traces holding any
    NaN/Inf sample come out NaN and are left out of their neighbours' means;
    a trace with no usable neighbour is NaN.
    """
    r_il, r_xl = per_axis_int(radius, "radius", n=2)
    be, traces, bad = on_device(device, block, "trace_correlation", np.float64)
    xp = be.xp
    n_il, n_xl, n_t = traces.shape
    traces = traces.reshape(n_il * n_xl, n_t)
    usable = xp.ones(n_il * n_xl, bool) if bad is None else ~bad.reshape(n_il * n_xl, n_t).any(axis=1)

    traces = traces - traces.mean(axis=1, keepdims=True)
    norms = xp.linalg.norm(traces, axis=1)
    norms[norms == 0] = 1.0
    traces /= norms[:, None]
    gram = traces @ traces.T  # (N, N): the dense, quadratic part
    del traces

    index = xp.arange(n_il * n_xl).reshape(n_il, n_xl)
    total = xp.zeros((n_il, n_xl))
    count = xp.zeros((n_il, n_xl))
    for di in range(-r_il, r_il + 1):
        for dx in range(-r_xl, r_xl + 1):
            if (di, dx) == (0, 0) or abs(di) >= n_il or abs(dx) >= n_xl:
                continue
            here = (slice(max(0, -di), n_il - max(0, di)), slice(max(0, -dx), n_xl - max(0, dx)))
            there = (slice(max(0, di), n_il - max(0, -di)), slice(max(0, dx), n_xl - max(0, -dx)))
            a, b = index[here], index[there]
            weight = usable[b]
            total[here] += xp.where(weight, gram[a, b], 0.0)
            count[here] += weight
    del gram
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / count
    mean[(count == 0) | ~usable.reshape(n_il, n_xl)] = xp.nan
    return be.to_host(xp.repeat(mean.astype(xp.float32)[:, :, None], n_t, axis=2))
