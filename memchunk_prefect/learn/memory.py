"""The memory model of one operator key: a mean and an upper bound for a block's peak bytes."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Iterable, Sequence

from river import metrics, stats, utils

from memchunk_prefect.core.records import FIRST_USE_BYTES, FIRST_USE_SHARE, Observation, Prediction, first_use_bytes
from memchunk_prefect.core.settings import ITEMSIZE
from memchunk_prefect.learn.forms import (
    _POWERS,
    CURVED,
    LINEAR,
    METRIC_WINDOW,
    MIB,
    MIN_NOISE,
    MIN_SIZE_RATIO,
    PRIOR_NOISE,
    PRIOR_VARIANCE,
    QUADRATIC,
    SUPERLINEAR_GAIN,
    _Fit,
    _Form,
    _loo_weight,
    _rate_ratio,
    _rolling_count,
    _t_quantile,
)

DISTINCT_SIZE_RATIO = 1.2
"""Block sizes closer than this are one size to a curvature: a few percent of memory noise decides what a curve
through them does. One probe wave's blocks differ by a few percent; 20% more elements is 44% more memory for a
quadratic operator and 20% for a linear one."""
QUADRATIC_GROWTH = 2.0
"""The least exponent a bound beyond the largest block grows by while the curvature cannot be fitted: the
steepest form the model fits (:meth:`MemoryModel._growth_mib`)."""
MIN_RISES = 3
"""Fewest runs that timed their memory's rise before :meth:`MemoryModel.rise` reads one."""


def spread_sizes(sizes: Iterable[int], ratio: float) -> int:
    """How many of ``sizes`` (elements) stand each at least ``ratio`` x the one counted below it, from the
    smallest: sizes a few percent apart (one probe wave's slightly different blocks) count once.

    >>> spread_sizes([62_400, 64_800, 280_800, 291_600], DISTINCT_SIZE_RATIO)
    2
    """
    count, last = 0, 0.0
    for size in sorted(sizes):
        if count == 0 or size >= ratio * last:
            count, last = count + 1, float(size)
    return count


@dataclass
class _Censored:
    u: float  # Mi-elements of the block that ran out of memory
    peak_mib: float  # what it had when it did


class _Points:
    """The runs one fit is made of: each form's posterior, the block sizes (elements) and the largest peak (MiB)
    learned at each, and the conformal ratios (peak / mean predicted before the run) of those scored."""

    def __init__(self, forms: dict[str, _Form], conformal_window: int):
        self.forms = forms
        self.sizes: set[int] = set()
        self.largest = 0  # elements of the largest block in sizes
        self.size_peaks: dict[int, float] = {}
        self.ratios: deque[float] = deque(maxlen=conformal_window)

    @property
    def n(self) -> int:
        return self.forms[LINEAR].n

    def add(self, elements: int, y: float, scale: float) -> None:
        u = elements / MIB
        for form in self.forms.values():
            form.learn(u, y, scale)
        self.sizes.add(elements)
        self.size_peaks[elements] = max(self.size_peaks.get(elements, 0.0), y)
        self.largest = max(self.largest, elements)


@dataclass
class _Quarantined:
    obs: Observation
    ratio: float  # observed / mean at the time
    seen_at: int  # index in the stream of usable observations


class MemoryModel:
    """Peak bytes of one operator's blocks: a mean, an upper bound and a tight bound, learned online.

    *Fit.* The three forms of :mod:`memchunk_prefect.learn.forms` on peak MiB
    against Mi-elements; a curve's mean is used when its leave-one-out error is
    under ``superlinear_gain`` of the line's, it rises, and the blocks learned
    support it (:meth:`memory_curve_supported`). While the line is used, the upper
    bound is blended towards the best curve's by their leave-one-out weight: inside
    the data they agree, outside it a line under-predicts a curve the noise hid.
    Rows are divided by ``hypot(peak, noise_floor_bytes)`` (memory noise is a few
    percent of the peak; the floor keeps tiny blocks, mostly allocator noise, from
    dominating) and count ``(size / the largest's) ** size_weight``, so a cold
    start's small probes, where a "fixed" part is not yet fixed, do not bend the
    line the large blocks follow.

    *Bounds.* The upper bound is the Student-t prediction interval at
    ``confidence``, widening with extrapolation. Once ``conformal_window`` scored
    runs exist, their quantile of peak over predicted mean (:meth:`conformal_factor`)
    is a floor under it and is the tight bound (``Prediction.tight_bytes``) up to
    ``tight_reach`` x the largest block measured: what the learned policy may bet on.

    *Censored runs* (out of memory: "needs more than ``peak_bytes``") are floors,
    not points: a block at least as large is floored at ``censored_block_factor`` x
    that, and nearby bounds are raised to ``1 + censored_margin`` over it, fading
    with size; an ``ok`` run at least as large that needed less drops it, or, learned before it, keeps it out.

    *First uses.* What a run left held in its worker (a CUDA context, a library)
    beyond ``first_touch_bytes`` and ``first_touch_share`` of its peak (a worker's
    first call of the operator: beyond ``first_touch_bytes`` alone) is paid once
    per worker: the block is learned without it (:meth:`first_use_bytes`).

    *Outliers.* Once ready, an ``ok`` run above ``outlier_ratio`` x the bound or
    below the mean / ``outlier_ratio`` is quarantined; a second one in the same
    direction within ``quarantine_window`` runs accepts both, else it expires. One
    100x measurement never shrinks chunks; a real change that repeats is learned.

    *Runs that shared their worker.* On a worker of several threads a run that overlapped another reads the
    process's peak, the other's memory in it or its release under it (:attr:`Observation.alone`); the budget
    gives each thread a slot of its own, so only a run's own peak is what a chunk must fit. Every usable run is
    learned into one fit and the runs that were alone into a second; once the second is ready on its own
    (the test below), its fit, sizes and margin are the model's, and overlapped runs stay in the first only.

    *Honesty.* Not ready until ``min_observations`` usable runs at sizes at least
    ``min_size_ratio`` apart: the prediction says why, and the policy probes.

    Other parameters (public, as constructed): ``key``, named in the reasons;
    ``prior_variance``, ``prior_noise``, ``min_noise`` and ``curvature_sd`` (at
    ``min_noise``) for the forms (:class:`~memchunk_prefect.learn.forms._Form`);
    ``metric_window``, runs in the rolling error, first uses and drift kept;
    ``memory_curve_margin`` / ``memory_gap_ratio`` / ``memory_gap_gain``: see
    :meth:`memory_curve_supported`. Not thread-safe on its own.

    Units: bytes and elements outside; MiB and Mi-elements inside only.

    >>> import random
    >>> from memchunk_prefect.core.records import Observation
    >>> rng = random.Random(7)
    >>> m = MemoryModel("toy|float32|cpu")
    >>> for n in (2**18, 2**19, 2**20, 2**21) * 2:  # 50 MiB plus 28 bytes per element, 1% noise
    ...     _ = m.learn(Observation("toy|float32|cpu", n, (1, 1, n), 4 * n,
    ...                             (50 * 2**20 + 28 * n) * rng.uniform(0.99, 1.01)))
    >>> p = m.predict((1, 1, 2**22))
    >>> p.ready, round(p.mean_bytes / (50 * 2**20 + 28 * 2**22), 2), p.mean_bytes < p.upper_bytes
    (True, 1.0, True)
    """

    def __init__(self, key: str, confidence: float = 0.95, min_observations: int = 3, outlier_ratio: float = 3.0,
                 quarantine_window: int = 10, censored_margin: float = 0.05, censored_block_factor: float = 2.0,
                 noise_floor_bytes: float = 4 * MIB, prior_noise: float = PRIOR_NOISE, min_noise: float = MIN_NOISE,
                 superlinear_gain: float = SUPERLINEAR_GAIN, metric_window: int = METRIC_WINDOW,
                 prior_variance: float = PRIOR_VARIANCE, curvature_sd: float = 2.5, conformal_window: int = 20,
                 tight_reach: float = 2.0, min_size_ratio: float = MIN_SIZE_RATIO,
                 first_touch_bytes: float = FIRST_USE_BYTES, first_touch_share: float = FIRST_USE_SHARE,
                 size_weight: float = 0.5, memory_curve_margin: float = 0.1, memory_gap_ratio: float = 4.0,
                 memory_gap_gain: float = 0.5):
        _check(confidence, min_observations, outlier_ratio, memory_curve_margin, memory_gap_ratio, memory_gap_gain)
        self.key = key
        self.confidence = confidence
        self.min_observations = min_observations
        self.outlier_ratio = outlier_ratio
        self.quarantine_window = quarantine_window
        self.censored_margin = censored_margin
        self.censored_block_factor = censored_block_factor
        self.noise_floor_bytes = noise_floor_bytes
        self.prior_noise = prior_noise
        self.min_noise = min_noise
        self.superlinear_gain = superlinear_gain
        self.metric_window = metric_window
        self.prior_variance = prior_variance
        self.curvature_sd = curvature_sd
        self.conformal_window = conformal_window
        self.tight_reach = tight_reach
        self.min_size_ratio = min_size_ratio
        self.first_touch_bytes = first_touch_bytes
        self.first_touch_share = first_touch_share
        self.size_weight = size_weight
        self.memory_curve_margin = memory_curve_margin
        self.memory_gap_ratio = memory_gap_ratio
        self.memory_gap_gain = memory_gap_gain
        # River's regression is conjugate in the noise: beta = 1 on relative targets makes every prior variance
        # a multiple of the noise variance (see _Form). The curvature's prior is stated at the least noise the
        # fit admits (min_noise), so it is at least curvature_sd peaks wide whatever the measured noise.
        def points() -> _Points:
            forms = {name: _Form(name, prior_variance, curvature_sd / min_noise, size_weight) for name in _POWERS}
            return _Points(forms, conformal_window)

        self._all = points()  # every usable ok run
        self._alone = points()  # the runs that had their worker to themselves (Observation.alone)
        self._active = self._all  # the one predictions come from: _alone once it is ready on its own
        self._censored: list[_Censored] = []
        self._quarantine: deque[_Quarantined] = deque()
        self._first_use: deque[float] = deque(maxlen=metric_window)  # the latest first uses' retained memory, MiB
        self._rises: deque[tuple[float, float]] = deque(maxlen=metric_window)  # the latest runs' (rise_50, rise_90)
        self._unseen: deque[float] = deque(maxlen=metric_window)  # MiB runs started above the resting level
        self._seen = 0
        self._n_censored = 0
        self._n_quarantined = 0
        # River's rolling metrics over the latest metric_window scored runs (Any: River types Rolling loosely).
        self._mape: Any = utils.Rolling(metrics.MAPE, window_size=metric_window)
        self._coverage: Any = utils.Rolling(stats.Mean, window_size=metric_window)
        self._bound_ratio: Any = utils.Rolling(stats.Mean, window_size=metric_window)
        self._cache: dict[tuple[int, int], Prediction] = {}

    # ------------------------------------------------------------------ learning

    @property
    def n_observations(self) -> int:
        """Usable ``ok`` observations behind the fit (quarantined ones are not counted until accepted): every one,
        or those that ran alone once they are enough (see the class)."""
        return self._active.n

    # The fit predictions come from, its sizes and its margin (see the class): read through these.
    @property
    def _forms(self) -> dict[str, _Form]:
        return self._active.forms

    @property
    def _sizes(self) -> set[int]:
        return self._active.sizes

    @property
    def _largest(self) -> int:
        return self._active.largest

    @property
    def _size_peaks(self) -> dict[int, float]:
        return self._active.size_peaks

    @property
    def _ratios(self) -> deque[float]:
        return self._active.ratios

    def learn(self, obs: Observation) -> str:
        """Learn one observation; returns what was done: ``learned``, ``censored``,
        ``quarantined``, ``accepted`` (a repeated outlier) or ``ignored`` (not about memory)."""
        if obs.gpu_out_of_memory:
            return "ignored"  # the GPU's memory ran out: it says nothing of the host's (bank.gpu_view learns it)
        if not obs.usable or obs.elements <= 0 or obs.peak_bytes <= 0:
            return "ignored"
        if obs.outcome == "ok" and obs.rise_50 is not None and obs.rise_90 is not None:
            self._rises.append((float(obs.rise_50), float(obs.rise_90)))
        self._cache.clear()
        u = obs.elements / MIB
        y = obs.peak_bytes / MIB
        if obs.outcome == "killed" and not obs.censored:
            return "ignored"  # killed for something other than memory: says nothing about memory
        if obs.censored or obs.outcome == "memory_error":
            self._n_censored += 1
            # Ok runs already learned at least as large that needed less contradict it, as later ones drop it
            # (:meth:`_learn_point`): the worker died of something other than this block (another thread's
            # first use, what a co-tenant held). Kept, it would floor every block from its size up for good, since
            # no plan would run that size again to drop it.
            if not any(e >= obs.elements and peak < y for e, peak in self._all.size_peaks.items()):
                self._censored.append(_Censored(u, y))
            return "censored"
        left = self.first_use(obs)
        if left:
            # What the run left held is the worker's from now on, and the map's budget follows it there
            # (machine.MapMachine drift): as part of this block's peak it would read as a huge cost per element.
            self._first_use.append(left / MIB)
            obs = replace(obs, peak_bytes=self.working_bytes(obs))
        self._seen += 1
        if self._ready_reason() is None:
            pred = self._predict_u(u, apply_censored=False)
            ratio = obs.peak_bytes / max(pred.mean_bytes, 1.0)
            if obs.peak_bytes > self.outlier_ratio * pred.upper_bytes or ratio < 1.0 / self.outlier_ratio:
                return self._quarantine_or_accept(obs, ratio)
            self._score(obs, pred)
            # The margin is learned from the run's peak against what the model predicted before it knew. A
            # prediction below the block's own input bytes is no prediction of this operator at this size (a line
            # sloping down through early probes): its ratio would poison every plan for conformal_window runs.
            if self._upper_mib(u)[0] * MIB >= obs.bytes_in:  # the fit's own mean, before the floor at that
                ratio = obs.peak_bytes / pred.mean_bytes
                self._all.ratios.append(ratio)
                if obs.alone and self._active is self._alone:
                    self._alone.ratios.append(ratio)
        self._unseen.append(obs.unseen_bytes / MIB)
        self._expire_quarantine()
        self._learn_point(obs)
        return "learned"

    def _score(self, obs: Observation, pred: Prediction) -> None:  # the rolling figures of summary()
        self._mape.update(obs.peak_bytes, pred.mean_bytes)
        self._coverage.update(1.0 if obs.peak_bytes <= pred.upper_bytes else 0.0)
        self._bound_ratio.update(pred.upper_bytes / obs.peak_bytes)

    def _learn_point(self, obs: Observation) -> None:
        u = obs.elements / MIB
        y = obs.peak_bytes / MIB
        scale = math.hypot(y, self.noise_floor_bytes / MIB)
        self._all.add(obs.elements, y, scale)
        if obs.alone:
            self._alone.add(obs.elements, y, scale)
            if self._active is self._all and self._points_reason(self._alone) is None:
                self._active = self._alone
        # An ok run at least as large as a censored one that needed less contradicts it.
        self._censored = [c for c in self._censored if not (u >= c.u and y < c.peak_mib)]
        self._cache.clear()

    def _expire_quarantine(self) -> None:
        while self._quarantine and self._seen - self._quarantine[0].seen_at > self.quarantine_window:
            self._quarantine.popleft()

    def _quarantine_or_accept(self, obs: Observation, ratio: float) -> str:
        self._expire_quarantine()
        agree = [q for q in self._quarantine
                 if (q.ratio > 1) == (ratio > 1)
                 and max(q.ratio, ratio) / min(q.ratio, ratio) <= self.outlier_ratio]
        if agree:
            for q in agree:
                self._quarantine.remove(q)
                self._learn_point(q.obs)
            self._learn_point(obs)
            return "accepted"
        self._quarantine.append(_Quarantined(obs, ratio, self._seen))
        self._n_quarantined += 1
        return "quarantined"

    def conformal_factor(self) -> float | None:
        """The learned margin: the split-conformal quantile of (peak / mean predicted before the run) at
        ``confidence``, over the latest ``conformal_window`` scored runs (the model as it is now): their
        ``ceil((n + 1) * confidence)``-th smallest, so a new run needs more than ``mean x factor`` with
        probability at most ``1 - confidence`` (runs exchangeable). None until there are enough (19 at 0.95)."""
        n = len(self._ratios)
        k = math.ceil((n + 1) * self.confidence)
        if n == 0 or k > n:
            return None
        return sorted(self._ratios)[k - 1]

    def unseen_bytes(self) -> float:
        """The most memory the latest ``metric_window`` runs started above the resting level the budget assumed,
        bytes (0 if none). The workers' (memory earlier tasks left), not the block's, so never in a bound: a map
        takes it off its kill headroom until its own runs say where the workers stand (``machine.Start.drift_bytes``).
        """
        return max(self._unseen, default=0.0) * MIB

    def first_use(self, obs: Observation) -> int:
        """What ``obs`` left held in its worker, bytes, where that makes it a first use (more than both
        ``first_touch_bytes`` and ``first_touch_share`` of its peak; for a worker's first call of the operator, more
        than ``first_touch_bytes``: :func:`~memchunk_prefect.core.records.first_use_bytes`); else 0. Less is what
        any run leaves (allocator pages, Python's caches) and stays in the peak it was measured with."""
        return first_use_bytes(obs, self.first_touch_bytes, self.first_touch_share)

    def working_bytes(self, obs: Observation) -> int:
        """The peak of ``obs`` as this model learns it: less what a first use left held (:meth:`first_use`),
        bytes. What a prediction of the block is compared with."""
        return max(1, int(obs.peak_bytes) - self.first_use(obs))

    def first_use_bytes(self) -> float:
        """The most memory one of the latest ``metric_window`` first uses left held in its worker, bytes; 0 if none.
        Like :meth:`unseen_bytes`, the worker's and never in a bound: a map takes it off its kill headroom, so a
        fresh worker's first chunk fits. Kept over first uses, not runs (a long map's runs would push them out)."""
        return max(self._first_use, default=0.0) * MIB

    def rise(self) -> tuple[float, float] | None:
        """When in its run a block's memory reaches half and 90% of its peak, as shares of the run's wall time: the
        medians over the latest ``metric_window`` runs that timed it (``Observation.rise_50``/``rise_90``); None
        before :data:`MIN_RISES` did. What a block that does not fit gets through before its worker is killed
        follows it (:class:`memchunk_prefect.sim.cluster.SimulatedCluster`)."""
        if len(self._rises) < MIN_RISES:
            return None
        return (statistics.median(r[0] for r in self._rises), statistics.median(r[1] for r in self._rises))

    # ------------------------------------------------------------------ choosing the form

    def _fits(self) -> dict[str, _Fit]:
        return {name: f.fit(self.prior_noise, 1.0, self.min_noise) for name, f in self._forms.items()}

    def form(self) -> str:
        """The form whose mean is used: a curved one when it predicts held-out points better, else ``linear``."""
        return self._curve_choice()[0]

    def _unsupported_curve(self) -> str | None:
        """The curved form that beat the line on leave-one-out error but was refused for want of support
        (:meth:`memory_curve_supported`), or None. Neither taken nor ruled out: the tight bound covers its mean."""
        return self._curve_choice()[1]

    def _curve_choice(self) -> tuple[str, str | None]:
        """``(the form used, a curve refused for want of support or None)``: the best rising curve is taken when
        its leave-one-out error is under ``superlinear_gain`` of the line's and the runs support it
        (:meth:`memory_curve_supported`) or its error is under ``memory_gap_gain`` of the line's; under
        ``superlinear_gain`` alone it is refused."""
        if self._ready_reason() is not None:
            return LINEAR, None
        fits = self._fits()
        best = self._best_curved(fits, curving_up=True)
        if best is None:
            return LINEAR, None
        ratio = fits[best].press / fits[LINEAR].press if fits[LINEAR].press > 0 else 0.0
        if ratio >= self.superlinear_gain:
            return LINEAR, None
        if self.memory_curve_supported() or ratio < self.memory_gap_gain:
            return best, None
        return LINEAR, best

    def _best_curved(self, fits: dict[str, _Fit], *, curving_up: bool) -> str | None:
        """The curved form with the lowest leave-one-out error among those with enough points (and c > 0)."""
        ok = [name for name in CURVED
              if fits[name].n >= len(_POWERS[name]) + 2 and math.isfinite(fits[name].press)
              and (fits[name].coef[-1] > 0 or not curving_up)]
        return min(ok, key=lambda name: fits[name].press) if ok else None

    def _curved_weight(self) -> tuple[float, str | None]:
        """How much the best curved form's bound counts while the line is chosen (0..1), and which form.

        The leave-one-out likelihood ratio (:func:`~memchunk_prefect.learn.forms._loo_weight`): about 1/2
        while the data cannot tell the forms apart, towards 0 as they show the line is enough. It counts even
        when the fitted curvature is negative: the curvature's uncertainty is what widens a far bound.
        """
        if self._ready_reason() is not None or self.form() != LINEAR:
            return 0.0, None
        fits = self._fits()
        best = self._best_curved(fits, curving_up=False)
        if best is None:
            return 0.0, None
        return _loo_weight(fits[best].press, fits[LINEAR].press, fits[LINEAR].n), best

    def memory_curve_supported(self) -> bool:
        """Whether the blocks learned support a curved memory form: no two consecutive sizes more than
        ``memory_gap_ratio`` apart, or peak bytes per element at the largest blocks above the smallest blocks' by
        more than ``memory_curve_margin`` (the time model's test on peaks).

        A curve fitted across a gap (a cold start's jump from its probes to the rest of the map) is free in it,
        where the planner plans the next chunk. Refused, a curve is not ruled out: the upper bound blends it and
        the tight bound holds its mean (:meth:`_unsupported_curve`); one under ``memory_gap_gain`` of the line's
        leave-one-out error is taken anyway. 4x, not time's 3x: memory has no slow spells, so a cold start's
        waves (3.3-3.9x apart) support a curve.
        """
        sizes = sorted(self._size_peaks)
        if len(sizes) >= 2 and all(b <= self.memory_gap_ratio * a for a, b in zip(sizes, sizes[1:])):
            return True
        ratio = _rate_ratio(list(self._size_peaks.items()), self.min_size_ratio)
        return ratio is not None and ratio > 1.0 + self.memory_curve_margin

    def _ready_reason(self) -> str | None:
        return self._points_reason(self._active)

    def _points_reason(self, points: _Points) -> str | None:
        """Why a fit on ``points`` cannot plan yet, or None when it can."""
        n = points.n
        if n < self.min_observations:
            return (f"only {n} usable observation{'s' if n != 1 else ''} of {self.key!r}; "
                    f"{self.min_observations} are needed before planning (probe first)")
        if len(points.sizes) < 2:
            return (f"all {n} observations of {self.key!r} are at one block size; "
                    "a fixed overhead and a per-element cost need two sizes (probe another size)")
        smallest = min(points.sizes)
        if points.largest < self.min_size_ratio * smallest:
            # Sizes a few percent apart cannot separate a fixed overhead from a per-element cost.
            return (f"the {n} observations of {self.key!r} span blocks of {smallest:,} to {points.largest:,} "
                    f"elements, less than {self.min_size_ratio:g}x apart: a fixed overhead and a per-element cost "
                    "need sizes further apart (probe another size)")
        return None

    # ------------------------------------------------------------------ predicting

    def predict(self, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        """Mean and upper bound of the peak bytes for a block of ``extents`` (halo included).

        ``itemsize`` (bytes per element) only matters with no usable
        observations, where the guess is the block's own bytes (a lower bound);
        the key already pins the dtype. Cached until the next run is learned.
        """
        elements = 1
        for e in extents:
            elements *= int(e)
        if elements <= 0:
            raise ValueError(f"extents must be positive, got {tuple(extents)}")
        cached = self._cache.get((elements, itemsize))
        if cached is None:
            cached = self._predict_u(elements / MIB, itemsize=itemsize)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[(elements, itemsize)] = cached
        return cached

    def _predict_u(self, u: float, *, itemsize: int = ITEMSIZE, apply_censored: bool = True) -> Prediction:
        n = self.n_observations
        reason = self._ready_reason()
        if reason is not None:
            mean, upper = self._guess(u, itemsize)
            tight = upper
        else:
            mean, upper = self._upper_mib(u)
            # Whatever the fit says, an operator holds at least the block it was given.
            own = u * itemsize
            mean, upper = max(mean, own), max(upper, own)
            reason = f"{self.form()} fit on {n} observations"
            if self._all.n > n:
                reason += f" that had their worker to themselves (of {self._all.n})"
            # The conformal margin, once learned, is a floor.
            q = self.conformal_factor()
            if q is not None and mean * q > upper:
                upper = mean * q
                reason += f"; bound {q:.3f} x the mean (learned from {len(self._ratios)} runs)"
            # Trusted up to tight_reach x the largest block measured: each plan at most doubles what is known.
            tight = upper if u > self.tight_reach * self._largest_u() else min(upper, self._tight_mib(u, mean, q))
            curve = self._unsupported_curve()
            if curve is not None:
                # The runs cannot tell the line from this curve: the line's mean is the estimate, the tight bound
                # holds the curve's.
                tight = max(tight, min(upper, self._bound(curve, u)[0]))
            w, other = self._curved_weight() if curve is None else (0.0, None)
            if other is not None and w > 0 and u > self._largest_u():
                # Beyond the largest block, where the line and the curve the upper bound blends in part, the curve
                # counts in the tight bound by the same weight: its mean times the margin.
                curved = self._tight_mib(u, self._bound(other, u)[0], q)
                tight = max(tight, min(upper, tight + w * (curved - tight)))
            growth = self._growth_mib(u)
            if growth is not None and growth[0] > tight:
                upper, tight = max(upper, growth[0]), growth[0]
                reason += (f"; beyond the largest block measured, bounded as one that grows as size^{growth[1]:.2f} "
                           "until a third size tells a curve from a line")
        if apply_censored and self._censored:
            mean, upper, tight, note = self._apply_censored(u, mean, upper, tight)
            if note:
                reason += f"; {note}"
        return Prediction(mean_bytes=mean * MIB, upper_bytes=upper * MIB, n_observations=n,
                          ready=self._ready_reason() is None, reason=reason, tight_bytes=tight * MIB)

    def _upper_mib(self, u: float) -> tuple[float, float]:
        """(mean, upper) in MiB: the chosen form's, its bound blended towards the best curved one's."""
        mean, upper = self._bound(self.form(), u)
        w, other = self._curved_weight()
        if other is not None and w > 0:
            upper = upper + w * max(0.0, self._bound(other, u)[1] - upper)
        return mean, upper

    def _growth_mib(self, u: float) -> tuple[float, float] | None:
        """(bound in MiB, exponent) for a block of ``u`` Mi-elements beyond the largest measured, while the
        curvature cannot be fitted yet: fewer than three sizes each ``DISTINCT_SIZE_RATIO`` x the one below
        (:func:`spread_sizes`), or too few runs for the quadratic form. None otherwise, or inside the sizes seen.

        The largest peak times ``(u / largest) ** exponent``, the exponent the growth between the two largest
        such sizes showed, and at least 2: the most an operator the forms can describe (fixed, per-element and
        quadratic parts, none negative) can need given what the largest block needed. A block's peak is the
        largest of its phases (reading, computing, writing), not their sum: while a phase of fixed size is the
        larger at the small blocks, two sizes can show no growth at all from a compute phase quadratic in the
        block, and the line through them under-predicts a block several times larger by as much
        (``test_two_sizes_whose_small_peaks_hide_a_quadratic_phase_bound_a_far_block_as_quadratic``). A
        third size tells the forms apart; until then a plan grows a block by at most the square root of what
        its budget holds over the largest peak.
        """
        largest = self._largest
        if u * MIB <= largest or (spread_sizes(self._sizes, DISTINCT_SIZE_RATIO) >= 3
                                  and self._forms[QUADRATIC].n >= len(_POWERS[QUADRATIC]) + 2):
            return None
        below = [e for e in self._size_peaks if e * self.min_size_ratio <= largest]
        if not below:
            return None
        other = max(below)
        p_large, p_other = self._size_peaks[largest], self._size_peaks[other]
        exponent = QUADRATIC_GROWTH
        if p_other > 0 and p_large > p_other:
            exponent = max(exponent, math.log(p_large / p_other) / math.log(largest / other))
        return p_large * (u * MIB / largest) ** exponent, exponent

    def _largest_u(self) -> float:
        """The largest block (Mi-elements) with a usable ``ok`` observation."""
        return self._largest / MIB

    def _tight_mib(self, u: float, mean: float, q: float | None) -> float:
        """The least bound (MiB) for a block of ``u`` Mi-elements and mean ``mean``: ``mean x q`` with a conformal
        factor (:meth:`conformal_factor`), before that the chosen form's prediction interval of a point inside
        the data (leverage 0). Valid inside the sizes seen; beyond them, the bet the learned policy may take."""
        if q is not None:
            return mean * q
        form = self._forms[self.form()]
        fit = self._fits()[form.name]
        scale = math.hypot(mean, self.noise_floor_bytes / MIB) / form.weight(u)
        return mean + _t_quantile(self.confidence, fit.dof) * fit.s * scale

    def _bound(self, name: str, u: float) -> tuple[float, float]:
        """(mean, upper) in MiB from one form's River posterior: ``mean * (1 + t * s * sqrt(1 + leverage))`` on
        the row's scale, the leverage growing with extrapolation."""
        form = self._forms[name]
        fit = form.fit(self.prior_noise, 1.0, self.min_noise)
        mean = form.mean(u, fit)
        scale = math.hypot(max(mean, 0.0), self.noise_floor_bytes / MIB) / form.weight(u)
        x = form.design(u, scale)
        lev = float(x @ fit.cov @ x)
        t = _t_quantile(self.confidence, fit.dof)
        upper = max(mean, 0.0) + t * fit.s * math.sqrt(1.0 + max(lev, 0.0)) * scale
        return max(mean, 0.0), upper

    def _guess(self, u: float, itemsize: int) -> tuple[float, float]:
        """A not-ready guess: per-element cost of the observations seen so far, or the block's own bytes."""
        form = self._forms[LINEAR]
        if not form.n:
            own = u * itemsize
            return own, own
        mean = form.max_per_u * u
        return mean, 2.0 * mean

    def _apply_censored(self, u: float, mean: float, upper: float, tight: float) -> tuple[float, float, float, str]:
        factor, floor, note = 1.0, 0.0, ""
        for c in self._censored:
            need = c.peak_mib * (1.0 + self.censored_margin)
            if u >= c.u:
                # A block at least as large as one that ran out of memory needs more than that run had, by how
                # much no one knows. The budget it is compared with moves with the workers' resting memory, so a
                # floor at the value itself would let the next run plan the same size again on workers resting lower.
                floor = max(floor, need * self.censored_block_factor)
            if self._ready_reason() is None:
                bound_c = self._upper_mib(c.u)[1]
            else:
                _, bound_c = self._guess(c.u, ITEMSIZE)
            if bound_c >= need:
                continue
            ratio = need / max(bound_c, 1e-9)
            w = min(1.0, max(0.0, (math.log2(u / c.u) + 3.0) / 2.0))  # whole from half its size, none at 1/8
            factor = max(factor, 1.0 + (ratio - 1.0) * w)
        if factor > 1.0 or floor > upper:
            note = f"raised by {len(self._censored)} out-of-memory record(s)"
        return max(mean * factor, floor), max(upper * factor, floor), max(tight * factor, floor), note

    # ------------------------------------------------------------------ reporting

    def explain(self, extents: Sequence[int]) -> dict[str, Any]:
        """What a block's upper bound is made of, for a person asking why it is what it is (bytes).

        :meth:`predict`'s figures and ``form``; ``form_upper_bytes``, the chosen form's own bound before the best
        curve's is blended in; ``curved_form`` / ``curved_upper_bytes`` / ``curved_weight``, that curve, its bound
        and its share (:meth:`_curved_weight`); ``line_mean_bytes``; ``curve_supported``
        (:meth:`memory_curve_supported`); ``times_largest``, the block over the largest measured. The fit's
        figures are None while the model is not ready.
        """
        elements = math.prod(int(e) for e in extents)
        p = self.predict(extents)
        out: dict[str, Any] = {"elements": elements, "ready": p.ready, "form": self.form(),
                               "mean_bytes": p.mean_bytes, "upper_bytes": p.upper_bytes, "tight_bytes": p.tight_bytes,
                               "form_upper_bytes": None, "curved_form": None, "curved_upper_bytes": None,
                               "curved_weight": 0.0, "line_mean_bytes": None, "curve_supported": None,
                               "times_largest": elements / self._largest if self._largest else None}
        if p.ready:
            u = elements / MIB
            out["form_upper_bytes"] = self._bound(self.form(), u)[1] * MIB
            out["line_mean_bytes"] = self._bound(LINEAR, u)[0] * MIB
            out["curve_supported"] = self.memory_curve_supported()
            w, other = self._curved_weight()
            if other is not None:
                out.update(curved_form=other, curved_upper_bytes=self._bound(other, u)[1] * MIB, curved_weight=w)
        return out

    def summary(self) -> dict[str, Any]:
        """Plain figures for the CLI and reports (bytes, bytes per element, fractions)."""
        fits = self._fits() if self.n_observations else {}
        form = self.form()
        n_scored = _rolling_count(self._coverage)
        out: dict[str, Any] = {
            "key": self.key,
            "n_observations": self.n_observations,
            "n_censored": self._n_censored,
            "n_quarantined": self._n_quarantined,
            "ready": self._ready_reason() is None,
            "reason": self._ready_reason() or f"{form} fit",
            "form": form,
            "bytes_per_element": None,
            "fixed_overhead_bytes": None,
            "superlinear_coefficient": None,
            "noise": None,
            "recent_mape": self._mape.get() / 100.0 if n_scored else None,  # a fraction, not percent
            "coverage": self._coverage.get() if n_scored else None,
            "bound_over_truth": self._bound_ratio.get() if n_scored else None,
            "scored": n_scored,
            "margin": self.conformal_factor(),
            "margin_runs": len(self._ratios),
            "unseen_bytes": self.unseen_bytes(),
            "first_use_bytes": self.first_use_bytes(),
            "rise": self.rise(),
        }
        if fits and out["ready"]:
            fit = fits[form]
            coef = self._forms[form].coefficients(fit)
            out["fixed_overhead_bytes"] = float(coef[0] * MIB)
            out["bytes_per_element"] = float(coef[1])  # MiB per Mi-element == bytes per element
            if form in CURVED:
                out["superlinear_coefficient"] = float(coef[2])
                out["superlinear_power"] = _POWERS[form][2]
            out["noise"] = fit.s
        return out


def _check(confidence: float, min_observations: int, outlier_ratio: float, memory_curve_margin: float,
           memory_gap_ratio: float, memory_gap_gain: float) -> None:
    """Refuse settings the model cannot work with (ValueError naming the setting)."""
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0.5, 1), got {confidence!r}")
    if min_observations < 2:
        raise ValueError(f"min_observations must be at least 2 (a line has 2 unknowns), got {min_observations!r}")
    if outlier_ratio <= 1.0:
        raise ValueError(f"outlier_ratio must be above 1, got {outlier_ratio!r}")
    if not memory_curve_margin >= 0.0:
        raise ValueError(f"memory_curve_margin must be a fraction of at least 0, got {memory_curve_margin!r}")
    if not memory_gap_ratio > 1.0:
        raise ValueError(f"memory_gap_ratio must be above 1, got {memory_gap_ratio!r}")
    if not 0.0 <= memory_gap_gain <= 1.0:
        raise ValueError(f"memory_gap_gain must be in [0, 1] (a fraction of the line's leave-one-out error), "
                         f"got {memory_gap_gain!r}")
