"""How well a key's memory model predicted its own history, and the floor no shape-only model beats.

The figures ``python -m benchmarks.studies.store_quality`` and the learning-quality goals of
``python -m benchmarks.strategies`` are read from: :func:`replay_quality` replays a key's
rows through :class:`~memchunk_prefect.learn.operator.OperatorModel`, scoring each run
before it is learned; :func:`repeatability` is the spread of blocks run again.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from memchunk_prefect.core.records import Observation
from memchunk_prefect.learn.operator import OperatorModel

#: A scored run whose block has more than this many times the elements of every block learned before it was
#: predicted by extrapolation (:func:`replay_quality` reports its error apart).
BEYOND_RATIO = 1.05


def replay_quality(rows: Iterable[Observation], key: str, *, after: int = 5, **options: Any) -> dict[str, Any]:
    """How well ``key``'s model predicted its own history: each ``ok`` run scored before it is learned.

    ``rows``: the key's observations in the order they were stored. A run is
    scored once the model is ready and has learned ``after`` usable runs: the
    absolute error of the predicted mean (``mape``, a fraction), whether the peak
    was within the upper bound (``coverage``, a share) and the upper bound over
    the peak (``bound_over_peak``, mean). The goals for a real run:
    coverage >= 0.95, mape <= 0.10 after 5 runs, bound_over_peak <= 1.25.
    The error is also split by where the run lay: ``mape_beyond`` over the
    ``scored_beyond`` runs whose block was larger than ``BEYOND_RATIO`` x every
    block learned before it (the model extrapolated), ``mape_within`` over the rest.

    >>> rows = [Observation("k|float32|cpu", n, (1, 1, n), 4 * n, 2**20 + 100 * n)
    ...         for n in range(10_000, 90_000, 5_000)]
    >>> q = replay_quality(rows, "k|float32|cpu")
    >>> q["scored"], q["coverage"], q["mape"] < 0.01
    (11, 1.0, True)
    """
    m = OperatorModel(key, **options)
    errors: list[float] = []
    covered: list[bool] = []
    ratios: list[float] = []
    beyond: list[bool] = []
    largest = 0  # elements of the largest ok block learned so far
    for o in rows:
        if (o.operator_key == key and o.outcome == "ok" and o.usable and o.peak_bytes > 0 and o.elements > 0
                and m.n_observations >= after):
            p = m.predict(o.extents)
            if p.ready:
                peak = m.working_bytes(o)
                errors.append(abs(p.mean_bytes / peak - 1))
                covered.append(peak <= p.upper_bytes)
                ratios.append(p.upper_bytes / peak)
                beyond.append(o.elements > BEYOND_RATIO * largest)
        if o.operator_key == key:
            m.learn(o)
            if o.outcome == "ok" and o.usable:
                largest = max(largest, int(o.elements))
    n = len(errors)
    far = [e for e, b in zip(errors, beyond) if b]
    near = [e for e, b in zip(errors, beyond) if not b]
    return {"key": key, "observations": m.n_observations, "scored": n,
            "mape": sum(errors) / n if n else None, "coverage": sum(covered) / n if n else None,
            "bound_over_peak": sum(ratios) / n if n else None,
            "scored_beyond": len(far), "mape_beyond": sum(far) / len(far) if far else None,
            "mape_within": sum(near) / len(near) if near else None}


def repeatability(rows: Iterable[Observation], key: str, *, coverage: float = 0.95,
                  min_repeats: int = 2) -> dict[str, Any]:
    """What no memory model that sees only the block's shape can beat on ``key``'s runs: the spread of blocks run again.

    A model predicts a chunk's peak from the extents of the block it reads, so
    two runs of the same extents get the same prediction, whatever each really
    peaked at. Their spread is measurement noise to the model (the allocator
    reusing memory a previous task freed, a storage library decompressing
    several chunks at once, other threads of the worker allocating during the
    run): it sets a floor under the learning-quality figures of
    :func:`replay_quality`, in the same units.

    Runs are grouped by extents; groups of at least ``min_repeats`` usable
    ``ok`` runs count. Per group, in sample (the lowest any predictor of the
    group's runs reaches, knowing them all in advance):

    - the best constant's mean absolute percentage error: the constant is the
      median weighted by 1 / peak, which minimises ``sum |c - y| / y``;
    - the tightest constant bound that covers ``coverage`` of the group's
      peaks, over each peak (mean of bound / peak, as ``bound_over_peak``).

    Returned run-weighted over the groups: ``floor_mape`` (a fraction),
    ``floor_bound_over_peak``, ``runs`` and ``groups`` counted; the floors are
    None when no extents repeat ``min_repeats`` times.

    >>> MiB = 2**20
    >>> rows = [Observation("k|float32|cpu", 1000, (1, 10, 100), 4000, p * MiB) for p in (15, 15, 15, 20)]
    >>> r = repeatability(rows, "k|float32|cpu")
    >>> r["groups"], r["runs"], round(r["floor_mape"], 4), round(r["floor_bound_over_peak"], 4)
    (1, 4, 0.0625, 1.25)
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for o in rows:
        if o.operator_key == key and o.outcome == "ok" and o.usable and o.peak_bytes > 0:
            groups.setdefault(tuple(o.extents), []).append(int(o.peak_bytes))
    mape_sum = bound_sum = 0.0
    runs = n_groups = 0
    for peaks in groups.values():
        if len(peaks) < min_repeats:
            continue
        ys = sorted(peaks)
        weights = [1.0 / y for y in ys]
        half, acc = 0.5 * sum(weights), 0.0
        for y, w in zip(ys, weights):  # the weighted median minimises sum(w * |c - y|) with w = 1 / y
            acc += w
            if acc >= half:
                best = y
                break
        bound = ys[max(0, math.ceil(coverage * len(ys) - 1e-9) - 1)]
        mape_sum += sum(abs(best - y) / y for y in ys)
        bound_sum += sum(bound / y for y in ys)
        runs += len(ys)
        n_groups += 1
    return {"key": key, "runs": runs, "groups": n_groups,
            "floor_mape": mape_sum / runs if runs else None,
            "floor_bound_over_peak": bound_sum / runs if runs else None}
