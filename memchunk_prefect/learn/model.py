"""Online memory model per operator key: a mean and an upper bound for a block's peak bytes.

What it covers: learning, from :class:`~memchunk_prefect.core.records.Observation`
rows, how many bytes an operator needs for a block of given extents, and saying
how sure it is. What it does not: choosing chunks (``policy.py``), measuring
(``monitor.py``), or keeping rows on disk (``store.py``; :class:`ModelBank`
rebuilds models by replaying the store, never by unpickling).

How it learns (and why)
-----------------------
*Backbone: fixed overhead + per-element cost.* Features are the block's
elements (halo included) in units of ``2**20`` ("Mi-elements", ``u``); the
target is peak bytes in MiB. The *linear* form is ``peak = a + b*u``: ``a`` is
the fixed overhead (MiB) and ``b`` the bytes per element. A straight line
extrapolates sensibly to chunks larger than any seen — a tree model under-
predicted a 400^3 chunk 3x in the memory-aware-chunking study (Unicamp) and the run failed.
Two curved forms, ``a + b*u + c*u**1.5`` (``superlinear``) and ``a + b*u +
c*u**2`` (``quadratic``, e.g. all-pairs of traces), are fitted beside it for
operators whose memory grows faster than their size; the better one's mean is
used when its leave-one-out error (PRESS) beats the line's, ``c > 0`` (so it
never bends down when extrapolating), and the blocks learned support a curve
(sizes without a wide gap between them, or bytes per element that rise with
size: :meth:`OperatorModel.memory_curve_supported`; a curve refused for that still
sets the floor of the tight bound). While the line is used, the bound is blended towards
the best curved form's bound by their leave-one-out likelihood ratio (about
half while the data cannot tell them apart): inside the data they agree,
outside it a line would under-predict a curve that the noise hid. Beyond the
largest block measured the tight bound blends that curve's mean (times the
learned margin) by the same weight.

*River does the fitting.* Each form is a :class:`river.linear_model.BayesianLinearRegression`
(``learn_one`` per observation). It has no intercept, so a constant feature is
added. Each form fits in units of the largest block it has learned (sizes and
peaks divided by that block's), so its coefficients are of order one for any
operator; the prior is weak there (variance 1e6, i.e. ``alpha=1e-6``, River's
``alpha`` being a precision) on the fixed and per-element parts, so their
posterior mean is least squares, and weakly informative on a curved form's
curvature (see :class:`_Form`).
Coefficients and posterior covariance are read back through ``predict_one``
(``with_dist=True``) and cached until the next ``learn``, so the planner's
thousands of ``predict`` calls are cheap. Memory noise is *multiplicative*
(a few percent run to run), so each row is divided by its own scale
``sqrt(peak**2 + floor**2)`` before ``learn_one`` — weighted least squares on
relative residuals (the floor, 4 MiB, keeps tiny blocks whose peaks are
mostly allocator noise from dominating).

*Weighted towards the blocks that matter.* The forms are approximations over
two decades of block size, and a cold start's probes sit at the small end,
where an operator's "fixed" part is not yet fixed: gaussian_smooth's peaks
were 37, 15 and 8.6 bytes per element at 0.2, 1.9 and 13.5 Mi-elements
(memory concave in the block over the probes). A line fitted with every block
counting alike bent its slope to pass the probes and read the blocks the
planner then chose more than 10% high (the test
``test_a_concave_start_does_not_bend_the_line_the_large_blocks_follow``). So
each row also counts ``(u / u_ref) ** size_weight`` (0.5; ``u_ref`` the form's
unit, the largest block learned, refitted when one 1.25x larger arrives; at
least ``MIN_WEIGHT_RATIO`` of the largest's size): its noise scale is its
scale over that weight, in the fit and in the bound alike. Near the largest
blocks the fit follows them; a small block's bound is wider, as its runs were
further from the form. Replayed over 89 stores of benchmark runs
(``python -m benchmarks.store_quality --size-weight W``), 0.5 took
gaussian_smooth from 21.1% to 13.1% MAPE and its bound from 1.43x to 1.28x
its peak (within the bound 90.5% -> 93.5%), memory_hog from 4.0% to 2.9%,
envelope 12.3% -> 11.8%, gst3d_dip and trace_correlation unchanged.

*Upper bound.* River's BLR keeps ``beta`` (noise precision) fixed, so with
``beta = 1`` its predictive variance is ``1 + h`` where ``h`` is the query's
leverage (how far it extrapolates). The noise scale is learned here from the
relative residuals: ``s**2 = (nu0*s0**2 + RSS) / (nu0 + n - p)`` (a weak prior of
5 % with one pseudo-observation), and the one-sided bound is the Student-t
prediction interval ``mean * (1 + t(confidence, nu0 + n - p) * s * sqrt(1 + h))``.
Near the data that is a few percent above the mean; far outside it widens.

*Censored observations* (``censored=True``: ``memory_error``, or ``killed``
for memory; "needs more than
``peak_bytes`` at ``u_c``") are not fitted as points. Each one is a floor: if
the model's bound at ``u_c`` is below ``peak_bytes * (1 + censored_margin)``,
bounds (and means) are multiplied by the shortfall ratio for blocks at least
half that size, fading (linearly in log size) to no correction at 1/8 of it; a
block at least as large as ``u_c`` is floored at ``censored_block_factor`` (2) x
that value: the run says only "more than this", and the budget it is compared
with moves with the workers' resting memory, so a floor at the value itself
let the next run plan the same killed size again on workers resting lower. The
correction shrinks by itself as ``ok`` observations teach the model more. A
censored point contradicted by an ``ok`` run at least as large that needed less
is dropped.

*First uses.* A run that leaves memory held in its worker process (``Observation.retained_bytes``: a CUDA
context, a library loaded, a JIT's code; more than ``first_touch_bytes`` and ``first_touch_share`` of its
peak) paid something once per worker, not per element. Its block is learned without it, and
:meth:`OperatorModel.first_use_bytes` reports it for the next map to take off its headroom: a fresh worker pays
it again. On an H100 the demo's host model of a GPU key, after each worker's first chunk (which loads CUDA's
libraries and keeps them), bounded the next chunk of 1 x 26 traces at 178.6 MiB. The log has the bounds, not the peaks;
first chunks of ~150 MiB and later ones of ~1 MiB give that bound (the test
``test_what_a_first_use_left_held_is_the_workers_and_the_block_is_learned_without_it``).

*Outliers.* Once ready, an ``ok`` observation above ``outlier_ratio`` x the
current upper bound, or below the mean / ``outlier_ratio``, is quarantined, not
learned. It is accepted (learned, with everything quarantined that agrees with
it) only if a second one repeats it — same direction, ratio within
``outlier_ratio`` — within ``quarantine_window`` observations; otherwise it
expires. One 100x measurement therefore never shrinks chunks; a real change
that repeats is learned. (After a real change of regime — a new library
version — ``memchunk forget KEY`` starts clean faster.)

*Honesty.* ``ready`` is False until ``min_observations`` usable ``ok``
observations at two or more distinct sizes exist; the prediction then says why,
and the policy probes.

Units: bytes (``*_bytes``), elements (counts), MiB / Mi-elements inside only.

>>> from memchunk_prefect.core.records import Observation
>>> m = OperatorModel("toy|float32|cpu")
>>> for n in (2**18, 2**19, 2**20, 2**21):
...     _ = m.learn(Observation("toy|float32|cpu", n, (1, 1, n), 4 * n, 50 * 2**20 + 28 * n))
>>> p = m.predict((1, 1, 2**22))
>>> p.ready, round(p.mean_bytes / (50 * 2**20 + 28 * 2**22), 3)
(True, 1.0)
>>> round(m.summary()["bytes_per_element"], 1)
28.0
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from river import metrics, stats, utils

from memchunk_prefect.core.bandit import ArmChoice
from memchunk_prefect.core.chunks import Shape
from memchunk_prefect.core.energy import ESTIMATE, DeviceRun, busy_weight, is_measured, split_among_devices
from memchunk_prefect.core.records import (
    FIRST_USE_BYTES,
    FIRST_USE_SHARE,
    Observation,
    Prediction,
    Reward,
    first_use_bytes,
)
from memchunk_prefect.core.settings import ITEMSIZE, PolicySettings
from memchunk_prefect.learn.bandit import ArmLearner
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
    RATE_HISTORY,
    SUPERLINEAR_GAIN,
    _Fit,
    _Form,
    _loo_weight,
    _rate_ratio,
    _rolling_count,
    _t_quantile,
)

if TYPE_CHECKING:  # pragma: no cover
    from memchunk_prefect.learn.store import Store

TOUCH_POOL_BYTES = 256 * MIB
"""Bytes an operator's own runs must have grown their workers by, in all, before the cost of growing one is
taken from them alone (:meth:`ModelBank.touch_seconds_per_byte`): a cold start's probes grow a few tens of MiB,
whose kernel time is mostly what any run pays (:meth:`OperatorModel.touch_seconds_per_byte`); half a large
chunk's growth (trace_correlation's 545 MiB blocks grew their workers ~500 MiB) is the operator's own."""

@dataclass(frozen=True)
class _TimeChoice:
    """What the time model plans by: the form it names (:meth:`OperatorModel.time_form`), the curve whose
    mean counts in a block's seconds (None: the line alone) and how much it counts (0..1; the fitted line
    counts the rest)."""

    form: str
    curve: str | None
    weight: float


@dataclass
class _Censored:
    u: float
    peak_mib: float


@dataclass
class _Quarantined:
    obs: Observation
    ratio: float  # observed / mean at the time
    seen_at: int  # index in the stream of usable observations


@dataclass
class OperatorModel:
    """The memory model of one operator key; see the module docstring for the method.

    Parameters (public, as constructed): ``confidence`` of the one-sided upper
    bound; ``min_observations`` before ``ready``; ``outlier_ratio`` and
    ``quarantine_window`` (observations) for outlier screening;
    ``censored_margin`` (fraction) above a censored peak the bound must reach;
    ``censored_block_factor``: a block at least as large as a censored one is
    floored at this multiple of what that run had;
    ``noise_floor_bytes`` added in quadrature to each peak when scaling rows;
    ``prior_noise`` (relative) and ``min_noise`` (relative) for the noise scale;
    ``curvature_sd``: prior standard deviation of a curved form's curvature, in
    multiples of the peak at the largest block measured, at a relative noise of
    ``min_noise`` (wider at more noise: the prior is conjugate, see :class:`_Form`);
    ``superlinear_gain``: the superlinear form is chosen only when its
    leave-one-out error is below this fraction of the line's (its bound is
    blended in otherwise, see :meth:`_curved_weight`);
    ``metric_window``: observations in the rolling MAPE and coverage;
    ``min_size_ratio``: ``ready`` needs usable runs at blocks at least this many
    times apart in size (the largest over the smallest);
    ``tight_reach``: the tight bound (``Prediction.tight_bytes``) is given for
    blocks up to this multiple of the largest one measured, the upper bound beyond;
    ``time_floor_seconds`` added in quadrature to each run's seconds when fitting time;
    ``first_touch_bytes`` / ``first_touch_share``: a run that took its worker more
    than both above the most it had held (``Observation.grew_bytes``) paid the
    kernel to fault in and zero that memory, once per worker and growth, not per
    element (0.8-1.4 s against 0.3 s for the same call again, ``benchmarks.first_touch``):
    its seconds less its kernel CPU time teach time (:meth:`compute_seconds`); where that is unknown, its
    seconds teach time only while no run without that cost has been learned;
    the same two thresholds tell a first use (:meth:`first_use_bytes`): a run that left its worker holding
    more than both (``Observation.retained_bytes``) is learned without what it left;
    ``size_weight``: a memory row counts ``(its size / the largest's) ** size_weight``
    in the fit (see the module docstring; 0: every block alike);
    ``time_curve_margin`` and ``time_gap_ratio``: a curved time form is used only
    where the runs measured support it: no two consecutive sizes more than
    ``time_gap_ratio`` apart, or seconds per element at the largest blocks above the
    smallest blocks' by more than ``time_curve_margin`` (:meth:`curve_supported`);
    ``time_rising_gain``: where the measured rates rise (:meth:`rates_rise`), the
    leave-one-out error a curved time form must reach, as a fraction of the line's
    (``superlinear_gain`` otherwise): the rise is the evidence of a curve, so the
    fit need only be as good as the line's (see :meth:`time_form`);
    ``memory_curve_margin`` and ``memory_gap_ratio``: the same support asked of a
    curved memory form, on peak bytes per element (:meth:`memory_curve_supported`).

    Not thread-safe on its own; :class:`ModelBank` serializes ``learn`` and ``predict``.
    ``shared`` observations (other tasks ran in the same process) are learned as
    they are: their peak over-states this task's, which errs on the safe side.
    """

    key: str
    confidence: float = 0.95
    min_observations: int = 3
    outlier_ratio: float = 3.0
    quarantine_window: int = 10
    censored_margin: float = 0.05
    censored_block_factor: float = 2.0
    noise_floor_bytes: float = 4 * MIB
    prior_noise: float = PRIOR_NOISE
    min_noise: float = MIN_NOISE
    superlinear_gain: float = SUPERLINEAR_GAIN
    metric_window: int = METRIC_WINDOW
    prior_variance: float = PRIOR_VARIANCE
    curvature_sd: float = 2.5
    conformal_window: int = 20
    tight_reach: float = 2.0
    time_floor_seconds: float = 0.01
    min_size_ratio: float = MIN_SIZE_RATIO
    first_touch_bytes: float = FIRST_USE_BYTES
    first_touch_share: float = FIRST_USE_SHARE
    size_weight: float = 0.5
    time_curve_margin: float = 0.1
    time_gap_ratio: float = 3.0
    time_rising_gain: float = 1.0
    memory_curve_margin: float = 0.1
    memory_gap_ratio: float = 4.0
    memory_gap_gain: float = 0.5

    _forms: dict[str, _Form] = field(init=False, repr=False)
    _censored: list[_Censored] = field(init=False, repr=False)
    _quarantine: deque = field(init=False, repr=False)
    _sizes: set = field(init=False, repr=False)
    _largest: int = field(init=False, repr=False, default=0)  # elements of the largest block in _sizes
    _size_peaks: dict = field(init=False, repr=False)  # elements -> the largest peak (MiB) learned at that size
    _first_use: deque = field(init=False, repr=False)  # the latest first uses' retained memory, MiB
    _seen: int = field(init=False, repr=False, default=0)
    _n_censored: int = field(init=False, repr=False, default=0)
    _n_quarantined: int = field(init=False, repr=False, default=0)
    _mape: Any = field(init=False, repr=False)
    _coverage: Any = field(init=False, repr=False)
    _bound_ratio: Any = field(init=False, repr=False)
    _cache: dict = field(init=False, repr=False)
    _rates: deque = field(init=False, repr=False)
    _first_touch_rates: deque = field(init=False, repr=False)  # seconds per element of runs that grew the worker
    _touch_costs: deque = field(init=False, repr=False)  # (kernel seconds, bytes grown, elements) of those runs
    _sys_rates: deque = field(init=False, repr=False)  # kernel seconds per element of ok runs that did not grow
    _time_forms: dict[str, _Form] = field(init=False, repr=False)
    _time_sizes: set = field(init=False, repr=False)
    _time_runs: deque = field(init=False, repr=False)  # (elements, compute seconds) of the runs time learned
    _time_memo: _TimeChoice | None = field(init=False, repr=False, default=None)  # until time learns a run
    _ratios: deque = field(init=False, repr=False)
    _unseen: deque = field(init=False, repr=False)
    _energy: deque = field(init=False, repr=False)
    _energy_mape: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.5 < self.confidence < 1.0:
            raise ValueError(f"confidence must be in (0.5, 1), got {self.confidence!r}")
        if self.min_observations < 2:
            raise ValueError(f"min_observations must be at least 2 (a line has 2 unknowns), "
                             f"got {self.min_observations!r}")
        if self.outlier_ratio <= 1.0:
            raise ValueError(f"outlier_ratio must be above 1, got {self.outlier_ratio!r}")
        if not self.time_curve_margin >= 0.0:
            raise ValueError(f"time_curve_margin must be a fraction of at least 0, got {self.time_curve_margin!r}")
        if not self.time_gap_ratio > 1.0:
            raise ValueError(f"time_gap_ratio must be above 1, got {self.time_gap_ratio!r}")
        if not self.memory_curve_margin >= 0.0:
            raise ValueError(f"memory_curve_margin must be a fraction of at least 0, got {self.memory_curve_margin!r}")
        if not self.memory_gap_ratio > 1.0:
            raise ValueError(f"memory_gap_ratio must be above 1, got {self.memory_gap_ratio!r}")
        if not 0.0 <= self.memory_gap_gain <= 1.0:
            raise ValueError(f"memory_gap_gain must be in [0, 1] (a fraction of the line's leave-one-out error), "
                             f"got {self.memory_gap_gain!r}")
        if not 0.0 < self.time_rising_gain <= 1.0:
            raise ValueError(f"time_rising_gain must be in (0, 1] (a fraction of the line's leave-one-out error), "
                             f"got {self.time_rising_gain!r}")
        # River's regression is conjugate in the noise: beta = 1 on relative targets makes every prior variance
        # a multiple of the noise variance (see _Form). The curvature's prior is stated at the least noise the
        # fit admits (min_noise), so it is at least curvature_sd peaks wide whatever the measured noise.
        self._forms = {name: _Form(name, self.prior_variance, self.curvature_sd / self.min_noise, self.size_weight)
                       for name in _POWERS}
        # Time has no bound to hedge, only a form chosen by held-out error: its curvature keeps the weak prior. Its
        # constant is held at 0 or above (time_form says why).
        self._time_forms = {name: _Form(name, self.prior_variance, math.sqrt(self.prior_variance),
                                        nonnegative_constant=True) for name in _POWERS}
        self._time_sizes = set()
        self._time_runs = deque(maxlen=RATE_HISTORY)
        self._time_memo = None
        self._censored = []
        self._quarantine = deque()
        self._sizes = set()
        self._size_peaks = {}
        self._first_use = deque(maxlen=self.metric_window)
        self._mape = utils.Rolling(metrics.MAPE, window_size=self.metric_window)
        self._coverage = utils.Rolling(stats.Mean, window_size=self.metric_window)
        self._bound_ratio = utils.Rolling(stats.Mean, window_size=self.metric_window)
        self._cache = {}
        self._rates = deque(maxlen=RATE_HISTORY)
        self._first_touch_rates = deque(maxlen=RATE_HISTORY)
        self._touch_costs = deque(maxlen=RATE_HISTORY)
        self._sys_rates = deque(maxlen=RATE_HISTORY)
        self._ratios = deque(maxlen=self.conformal_window)
        self._unseen = deque(maxlen=self.metric_window)
        self._energy = deque(maxlen=RATE_HISTORY)  # _EnergyRun of recent ok runs with an energy figure
        self._energy_mape = utils.Rolling(metrics.MAPE, window_size=self.metric_window)

    # ------------------------------------------------------------------ learning

    @property
    def n_observations(self) -> int:
        """Usable ``ok`` observations learned (quarantined ones are not counted until accepted)."""
        return self._forms[LINEAR].n

    def learn(self, obs: Observation) -> str:
        """Learn one observation; returns what was done: ``learned``, ``censored``,
        ``quarantined``, ``accepted`` (a repeated outlier) or ``ignored`` (not about memory)."""
        if obs.operator_key != self.key:
            raise ValueError(f"observation for {obs.operator_key!r} given to the model of {self.key!r}")
        if obs.gpu_out_of_memory:
            return "ignored"  # the GPU's memory ran out: it says nothing of the host's (model.gpu_view learns it)
        if obs.outcome == "ok" and obs.elements > 0 and obs.energy_joules is not None:
            self._learn_energy(obs)
        if obs.outcome == "ok" and obs.sys_seconds is not None and obs.elements > 0:
            if self.first_touch(obs):
                self._touch_costs.append((float(obs.sys_seconds), float(obs.grew_bytes or 0), int(obs.elements)))
            else:
                self._sys_rates.append(float(obs.sys_seconds) / obs.elements)
        if obs.outcome == "ok" and obs.elements > 0:
            seconds = self.compute_seconds(obs)
            if seconds is None:
                self._first_touch_rates.append(obs.seconds / obs.elements)
            else:
                self._rates.append(seconds / obs.elements)
                if seconds > 0:
                    u = obs.elements / MIB
                    for form in self._time_forms.values():
                        form.learn(u, seconds, math.hypot(seconds, self.time_floor_seconds))
                    self._time_sizes.add(obs.elements)
                    self._time_runs.append((int(obs.elements), seconds))
                    self._time_memo = None
        if not obs.usable or obs.elements <= 0 or obs.peak_bytes <= 0:
            return "ignored"
        self._cache.clear()
        u = obs.elements / MIB
        y = obs.peak_bytes / MIB
        if obs.outcome == "killed" and not obs.censored:
            return "ignored"  # killed for something other than memory: says nothing about memory
        if obs.censored or obs.outcome == "memory_error":
            self._censored.append(_Censored(u, y))
            self._n_censored += 1
            return "censored"
        left = self.first_use(obs)
        if left:
            # A first use: what the run left held (a CUDA context, a library, a cache) is the worker's from now on,
            # paid once per worker process, and the map's budget follows it there (machine.MapMachine drift). As
            # part of this block's peak it reads as a huge cost per element for a tiny block (on an H100 the demo's
            # host model of a GPU key bounded a chunk of 1 x 26 traces at 178.6 MiB after each worker's first
            # chunk). The block is learned without it; a worker yet to pay it is budgeted for it (first_use_bytes).
            self._first_use.append(left / MIB)
            obs = replace(obs, peak_bytes=self.working_bytes(obs))
        self._seen += 1
        if self._ready_reason() is None:
            pred = self._predict_u(u, apply_censored=False)
            ratio = obs.peak_bytes / max(pred.mean_bytes, 1.0)
            if obs.peak_bytes > self.outlier_ratio * pred.upper_bytes or ratio < 1.0 / self.outlier_ratio:
                return self._quarantine_or_accept(obs, ratio)
            self._score(obs, pred)
            # The margin is learned from the run's peak against what the model predicted before it knew (memory
            # the worker held above the resting level read is the workers', not the operator's: the map's
            # budget follows it, see machine.MapMachine._budget). A prediction below the block's own input
            # bytes is no prediction of this operator at this size (early probes whose peaks fell as blocks
            # grew fit a line sloping down, whose mean for a larger block is ~0): its ratio would be a margin
            # of millions that poisons every plan for the next conformal_window runs. The fit learns that
            # point; the margin does not.
            if self._upper_mib(u)[0] * MIB >= obs.bytes_in:  # the fit's own mean, before the floor at that
                self._ratios.append(obs.peak_bytes / pred.mean_bytes)
        self._unseen.append(obs.unseen_bytes / MIB)
        self._expire_quarantine()
        self._learn_point(obs)
        return "learned"

    def _learn_energy(self, obs: Observation) -> None:
        """Keep one run's energy; score what the model predicted for it first (River's rolling MAPE)."""
        run = _EnergyRun.of(obs)
        before = self.joules_per_element(measured_only=run.measured)
        if before is not None and run.joules > 0:
            self._energy_mape.update(run.joules, before[0] * run.elements)
        self._energy.append(run)

    def joules_per_element(self, window: int = 20, *, measured_only: bool = False) -> tuple[float, str] | None:
        """Energy per element (halo included) and what it rests on: ``(joules, source)``; None before any run.

        The median over the latest ``window`` ``ok`` runs of one kind: measured
        runs (``energy_source`` a counter) whenever any exists, estimates
        otherwise; the two are never mixed. Measured runs read a whole-device
        counter: runs of this operator that overlapped on the same host share it
        (:func:`memchunk_prefect.core.energy.split_device_energy`), so two chunks
        running side by side are not each charged for both. ``source`` is the
        counter's name ("rapl", "nvml", ...) or "estimate".
        """
        measured = [r for r in self._energy if r.measured]
        runs = measured if measured else ([] if measured_only else [r for r in self._energy])
        runs = runs[-max(1, int(window)):]
        if not runs:
            return None
        joules = [r.joules for r in runs]
        if measured:
            joules = _split_by_device(runs)
        rates = sorted(j / r.elements for j, r in zip(joules, runs))
        sources = sorted({r.source for r in runs})
        return rates[len(rates) // 2], "+".join(sources)

    def joules_for(self, elements: int, window: int = 20) -> float | None:
        """Energy of one block of ``elements`` (halo included), joules, from :meth:`joules_per_element`."""
        jpe = self.joules_per_element(window)
        return None if jpe is None else jpe[0] * int(elements)

    def first_touch(self, obs: Observation) -> bool:
        """Whether ``obs`` took its worker well above the most it had held (``first_touch_bytes`` and
        ``first_touch_share`` of its peak): its wall time then includes faulting that memory in.
        False when unknown (records older than schema v7)."""
        grew = obs.grew_bytes
        return grew is not None and grew > max(self.first_touch_bytes, self.first_touch_share * obs.peak_bytes)

    def compute_seconds(self, obs: Observation) -> float | None:
        """The seconds an ``ok`` run teaches time: its wall seconds; for a first touch (:meth:`first_touch`), its
        wall seconds less its kernel CPU time (``sys_seconds``), or None where that is unknown.

        A first touch's extra cost is the kernel's: ``python -m benchmarks.first_touch`` (one trace_correlation
        block, fresh processes) measured first calls of 0.60-1.24 s wall with 0.36-0.99 s of system CPU, later
        calls of 0.30-0.31 s with 0.05-0.06 s; wall less system time was 0.24-0.25 s first and 0.25-0.26 s
        later. So the first call less its system time teaches what the next costs to within the next's own
        system time (the zeroing every large allocation pays), and a cold start's probes, each larger than any
        before on its worker, teach how time grows with the block instead of being set aside. (Less only the
        growth's share, :meth:`growth_kernel_seconds`, would keep that system time too; tried, it moved the time
        forms fitted to the kept benchmark stores' rows, so it is left for a change of its own.)
        """
        if not self.first_touch(obs):
            return float(obs.seconds)
        if obs.sys_seconds is None:
            return None
        return max(0.0, float(obs.seconds) - float(obs.sys_seconds))

    def resting_sys_per_element(self, window: int = 20) -> float | None:
        """Kernel seconds per element a run pays that does not grow its worker: the median over the latest
        ``window`` such runs (None before one). gst3d_dip measured 0.11-0.31 s for 896,800 elements, none grown;
        trace_correlation 0.11-0.15 s for 834,200 below the mark its first runs set."""
        if not self._sys_rates:
            return None
        rates = sorted(list(self._sys_rates)[-max(1, int(window)):])
        return rates[len(rates) // 2]

    def growth_kernel_seconds(self, sys_seconds: float, elements: int, rest: float | None = None) -> float:
        """Of a first touch's kernel seconds, what growing its worker cost: all of them, less what a run of
        ``elements`` pays below the mark (``rest`` per element, default :meth:`resting_sys_per_element`;
        nothing while none is known). trace_correlation grew its worker 502 MiB for 0.70-0.77 s of kernel time
        on 834,200 elements, 0.11-0.15 s of which the same block paid again below the mark."""
        rest = self.resting_sys_per_element() if rest is None else rest
        return max(0.0, float(sys_seconds) - (rest or 0.0) * int(elements))

    def touch_costs(self) -> tuple[float, float]:
        """(kernel seconds growing cost, bytes grown) summed over the latest runs that grew their worker
        (:meth:`first_touch`) and measured their kernel time (:meth:`growth_kernel_seconds`): what
        :meth:`touch_seconds_per_byte` divides."""
        rest = self.resting_sys_per_element() or 0.0
        return (sum(self.growth_kernel_seconds(c[0], c[2], rest) for c in self._touch_costs),
                sum(c[1] for c in self._touch_costs))

    def touch_seconds_per_byte(self) -> float | None:
        """Kernel seconds per byte the latest runs that grew their worker paid (:meth:`first_touch`): the cost of
        growing a worker's memory past the most it has held, which a plan pays once per worker
        (:class:`memchunk_prefect.core.estimates.FirstTouch`); None before such a run.

        Their kernel time beyond what runs of their size pay below the mark (:meth:`growth_kernel_seconds`: a
        545 MiB trace_correlation block took 0.7-0.8 s growing 502 MiB, 0.1-0.15 s again) over the bytes they
        grew, summed (not a median of ratios), so the large growths, which cost what a plan pays, decide. The
        time model is fitted to first touches less the same extra (:meth:`compute_seconds`), so the two add up
        to what such a run took.
        """
        sys_seconds, grew = self.touch_costs()
        return sys_seconds / grew if grew > 0 else None

    def seconds_per_element(self, window: int = 20) -> float | None:
        """Compute seconds per element (halo included): the median of the latest ``window`` ``ok`` runs.

        Runs that paid a first touch (:meth:`first_touch`) count only while no
        other run has been learned. None before any ``ok`` run. A median, so one
        run slowed by a busy machine does not move it (the upper one of the two
        middle values for an even count).
        """
        source = self._rates or self._first_touch_rates
        if not source:
            return None
        rates = sorted(list(source)[-max(1, int(window)):])
        return rates[len(rates) // 2]

    def time_form(self) -> str:
        """The form of compute seconds against block size: a curved one only when it predicts held-out runs better.

        The same forms and the same test as for memory (leave-one-out error below
        ``superlinear_gain`` x the line's, positive curvature, at least
        ``p + 2`` runs, here at two sizes or more: see the constant below), fitted on relative
        residuals of seconds (a floor of ``time_floor_seconds`` keeps runs of a
        few milliseconds, mostly scheduling noise, from dominating). And rising
        over every size measured: a curve that falls at the smallest block says
        a larger block costs less time, which no operator does; it fits noise.
        A cold start's first probes carry first-call costs: envelope measured
        0.057 and 0.087 s for 240,000 elements, 0.044-0.050 s for 801,600 and
        0.184 s for 1,603,200 (benchmarks.heterogeneous); the U-shaped
        quadratic through them won on leave-one-out error, and the warm plan cut
        envelope into 4 chunks where the same store's memory plan gave 2.
        Runs that paid a first touch (:meth:`first_touch`) are fitted without
        their kernel time (:meth:`compute_seconds`), or not at all where it is
        unknown: the same trace_correlation block took 1.63-1.75 s on a worker's
        first call and 0.40-0.45 s later, and the line through both hid its quadratic.
        And supported by the runs where the planner will use it (:meth:`curve_supported`): sizes measured
        without a wide gap, or rates that rise with size. Where the rates rise (:meth:`rates_rise`), the curve
        need only predict held-out runs as well as the line (``time_rising_gain``). trace_correlation on
        256 x 128 x 200 measured 0.23-0.28 s for 845,000-element blocks and 0.57-0.73 s for 1,677,000 (0.30
        against 0.38 us per element); its curve's leave-one-out error was 0.99x the line's with a free constant,
        so at the 0.9x bar the form read linear and the planner counted 0.27 and 0.54 s: no gain in smaller
        chunks. Replayed over the kept benchmark stores (``python -m benchmarks.time_forms``), the lower
        bar turned trace_correlation curved after 126 of 156 later flow runs (82 at 0.9x) and changed no other
        operator's form (their rates fall with size, gst3d_dip's past 1.1x in a few runs whose curve already
        cleared 0.9x).

        Every form's constant is held at 0 or above (:meth:`_Form._without`): a negative one is a block of a few
        hundred thousand elements taking no time, which no operator does (per-task costs are the planner's
        ``per_task_overhead_seconds``, apart), and a line with one fits rising rates about as well as a curve,
        while the planner plans a line through zero at the median rate. Held, the line is the one planned, and
        the curve is chosen where it fits and that line does not. A cold start often times just two clusters
        of sizes (its probes, then the rest of the map at the second wave's size), where every three-term form
        is free along a line of near-exact fits and leave-one-out alone kept the free line (held at no constant,
        a curve has two terms, which two sizes fix, hence two sizes are enough to test it): trace_correlation
        on 192 x 192 x 100 (``python -m benchmarks.heterogeneous`` at c828ad3) took 0.07-0.09 s of compute for
        232,800 elements and 0.47-0.75 s for 824,500-843,900 (rates 1.9-2.7x apart); read as proportional to
        size, the learned policy's first warm plan of 4 chunks looked faster than 6, and ran 3.3-3.6 s against
        2.3-3.2 s for the heuristic's 6. Replayed over the kept benchmark stores (``python -m benchmarks.time_forms
        $(ls benchmarks/runs/stores-2026-11-2[56]/*.sqlite benchmarks/runs/stores-2026-11-27/full7-*.sqlite | grep
        -v gpu)``), trace_correlation read curved after 109 of 120 cold flow runs and 187 of 216 later ones (63
        and 165 with a free constant; 114 and 165 with a rule for two clusters of sizes this replaced); gst3d_dip
        after 6 and 11 of 188 and 308 (5 and 10); envelope and gaussian_smooth never, as before.

        The form named is not all the planner uses: where the rates rise, the best curve counts in a block's
        seconds by its leave-one-out weight against the line even while the line is named
        (:meth:`time_curve_weight`).
        """
        return self._time_choice().form

    def time_curve_weight(self) -> tuple[float, str | None]:
        """How much a curved time form counts in a block's seconds (0..1), and which form (None: none does).

        Where the measured rates rise (:meth:`rates_rise`) and the line is named, the best curve still counts:
        a block's seconds are the curve's mean times its leave-one-out weight against the line
        (:func:`_loo_weight`) plus the line's (fitted through zero, the predictions the weight compared) times
        the rest. Rising rates say the line is wrong at both ends; which of the two predicts held-out runs
        better is then often decided by one noisy probe. trace_correlation on 192 x 192 x 100 (``python -m
        benchmarks.heterogeneous`` at 8b753f0, store ``heterogeneous-8b753f0-memchunk-192x192x100-1``) timed
        two probes of the same 232,800-element block at 0.078 and 0.139 s and the rest at 0.45-0.59 s for
        834,200 (rates 1.22x apart): leave-one-out read 0.124 for the line and 0.140 for either curve, the
        form read linear, and the next warm plan of 4 chunks ran 3.16 s where the heuristic's 12 took 2.31.
        With six runs the curve counts 0.41 there instead of 0.

        A curve named counts whole, not by its weight (0.73-1.00 in the cold stores of ``python -m
        benchmarks.heterogeneous`` at cacbee3, which blended it): shrunk towards the line, it reads larger blocks
        cheaper, and the blocks beyond the largest timed ran slower still
        than the curve read (trace_correlation's warm 940,900-element blocks 0.81-0.99 s on a worker that had
        held them, where the cold run's curve read 0.62 s; ``python -m benchmarks.time_forms STORES --plans``
        shows what each warm plan cost). Where the rates do not rise, a curve is all (it cleared
        ``superlinear_gain`` on sizes that support it, :meth:`curve_supported`) or nothing: its weight would be
        about 1/2 on noise alone (gst3d_dip, whose per-task costs make its rates fall), and a curve makes the
        planner cut smaller.
        """
        choice = self._time_choice()
        return choice.weight, choice.curve

    def _time_choice(self) -> _TimeChoice:
        if self._time_memo is None:  # seconds_for asks once per candidate plan: choose once per run learned
            self._time_memo = self._fitted_time_choice()
        return self._time_memo

    def _fitted_time_choice(self) -> _TimeChoice:
        """The form the leave-one-out test of :meth:`time_form` picks, and the curve's weight
        (:meth:`time_curve_weight`)."""
        line = _TimeChoice(LINEAR, None, 0.0)
        if len(self._time_sizes) < 2:
            return line
        fits = {name: f.fit(self.prior_noise, 1.0, self.min_noise) for name, f in self._time_forms.items()}
        u0 = min(self._time_sizes) / MIB
        # With positive curvature the slope only grows with size: rising at the smallest block is rising everywhere.
        ok = [name for name in CURVED
              if fits[name].n >= len(_POWERS[name]) + 2 and math.isfinite(fits[name].press) and fits[name].coef[-1] > 0
              and self._time_forms[name].mean(1.01 * u0, fits[name]) > self._time_forms[name].mean(u0, fits[name])]
        best = min(ok, key=lambda name: fits[name].press) if ok else None
        if best is None:
            return line
        if self.rates_rise():
            if fits[best].press <= self.time_rising_gain * fits[LINEAR].press:
                return _TimeChoice(best, best, 1.0)
            return _TimeChoice(LINEAR, best, _loo_weight(fits[best].press, fits[LINEAR].press, fits[LINEAR].n))
        if fits[best].press < self.superlinear_gain * fits[LINEAR].press and self.curve_supported():
            return _TimeChoice(best, best, 1.0)
        return line

    def time_fits(self, elements: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
        """Per time form: runs fitted, leave-one-out error (``press``, on relative residuals) and the compute
        seconds it predicts for blocks of ``elements`` (halo included): what :meth:`time_form` chooses between,
        for diagnosis (``python -m benchmarks.time_forms --fits``). Empty before any timed run."""
        if not self._time_sizes:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for name, form in self._time_forms.items():
            fit = form.fit(self.prior_noise, 1.0, self.min_noise)
            out[name] = {"n": int(fit.n), "press": float(fit.press),
                         "seconds": [float(form.mean(int(e) / MIB, fit)) for e in elements]}
        return out

    def curve_supported(self) -> bool:
        """Whether the runs measured support a curved time form: they leave no gap in size wider than
        ``time_gap_ratio`` (so leave-one-out tested the curve where the planner will use it), or their seconds
        per element rise with size by more than ``time_curve_margin`` (:meth:`rates_rise`).

        A curved time form is what makes the planner cut smaller for speed, and a curve through two clusters of
        sizes is free in the gap between them, where the next plan cuts. A cold start measures exactly that: its
        probes (small, one spell) and the rest of the map (large, another). One benchmark round's gst3d_dip probes
        (176,800-343,200 elements) took 0.53-0.68 s, most of it per task, and its two 3,891,200-element chunks
        ran in a slow spell (9.5-10.4 s wall, 8.0-8.8 s of CPU, against 7.0-7.3 s and 6.1-6.4 s the round before);
        the quadratic through them won on leave-one-out error and read 3.0 s for 2,252,800 elements against
        7.9 s for 3,891,200 (1.3 us per element against 2.0), and the warm plan cut gst3d_dip in 4 chunks where 2
        ran as fast per element. Leave-one-out does not see such a gap: each wave runs one chunk per slot at one
        size, and the twin of a chunk left out stays in the fit. Cold starts' waves step 3.3-3.9x in size
        (256 x 128 x 200 in the heterogeneous benchmark: 228,000, 896,800, then 2,969,600 elements), so a cold
        start alone never stands a curve on leave-one-out at the default 3x. Over that day's kept benchmark
        stores (``python -m benchmarks.time_forms``), after each flow run, the measured ratio of the largest
        blocks' rate to the smallest's was 0.13-0.34 for envelope, 0.14-0.69 for gaussian_smooth and 0.60-1.12
        for gst3d_dip (per-task costs weigh most on small blocks), whose curves were noise, and 1.06-2.46 for
        trace_correlation, whose time grows with the square of the traces per chunk. An operator with a fixed
        cost per call and a quadratic part has rates that fall, then rise: measured densely, its curve stands on
        leave-one-out alone.
        """
        sizes = sorted({e for e, _ in self._time_runs})
        if len(sizes) >= 2 and all(b <= self.time_gap_ratio * a for a, b in zip(sizes, sizes[1:])):
            return True
        return self.rates_rise()

    def rates_rise(self) -> bool:
        """True when :meth:`rate_ratio` is above ``1 + time_curve_margin``."""
        ratio = self.rate_ratio()
        return ratio is not None and ratio > 1.0 + self.time_curve_margin

    def rate_ratio(self) -> float | None:
        """The median measured seconds per element of the largest blocks (within ``min_size_ratio`` of the
        largest size) over the smallest blocks'; None before two sizes that far apart were timed. Above 1:
        larger blocks cost more per element; below: per-task costs weigh on small blocks."""
        return _rate_ratio(self._time_runs, self.min_size_ratio)

    def memory_curve_supported(self) -> bool:
        """Whether the blocks learned support a curved memory form: no two consecutive sizes more than
        ``memory_gap_ratio`` apart, or peak bytes per element at the largest blocks above the smallest blocks' by
        more than ``memory_curve_margin`` (the time model's test, :meth:`curve_supported`, on peaks).

        A curved form's mean is what the planner plans the next chunk by, and a curve fitted across a gap is
        free in it. One benchmark's cold gaussian_smooth measured probes of 0.13-0.24 M elements (7.5-9.4 MiB),
        then 1.90 M and 2.25 M (21.2-25.0 MiB): a gap of 8x, and the two top sizes, 1.18x apart, rose a little
        more steeply than the line from the probes. The superlinear form won on leave-one-out error and read
        mean 43.4 MiB (tight bound 46.2) for the warm chunk of 3.69 M elements, which peaked 35.0 MiB. Its bytes
        per element fell with size (42-76 for the probes, 11.6-11.9 at the top), as any operator's with a fixed
        cost does; an operator whose memory grows with the square of the traces per chunk shows it rising
        (trace_correlation: 209 bytes per element at 0.23 M elements, 682-769 at 0.83-0.94 M). An unsupported
        curve still widens the upper bound (:meth:`_curved_weight`), and beyond the largest block the growth
        the runs showed still holds (:meth:`_growth_mib`).

        Refused, a curve is not ruled out: the tight bound holds its mean (:meth:`_unsupported_curve`). The same
        cold-start picture came from an operator whose memory does curve: envelope on 256 x 128 x 200, probes of
        0.24 M elements then 1.28 M and 1.75 M (a 5.3x gap); its warm chunk of 3.28 M peaked 66.5 MiB, where the
        line's tight bound read 60.4 MiB and the curve's mean 70.8 (``python -m benchmarks.heterogeneous`` at
        2effcc0, before the tight bound held it).

        Unsupported, a curve is still taken where it predicts held-out blocks far better than the line
        (leave-one-out error below ``memory_gap_gain``, 0.5, of the line's, :meth:`form`): an operator quadratic
        in its traces with a fixed cost of its own has bytes per element that fall with size, yet a curve the
        line cannot approach (a gaussian_smooth-like 0.79 of the line's error is not that).

        The widest step is 4x, not time's 3x: a cold start's waves step 3.3-3.9x in size, and memory, unlike
        time, has no slow spells (a few percent run to run), so a wave supports a curve; the jump from the
        probes straight to the rest of the map does not. Replayed over the 146 benchmark stores kept before this
        test (``benchmarks/runs/stores-2026-11-2[56]/*.sqlite`` but the gpu-demo, full5, full6, 2effcc0 and
        e33fe1b ones; ``python -m benchmarks.store_quality STORES``, with ``--memory-gap-gain 0.9`` for the model
        before), gaussian_smooth's MAPE went from 8.3% to
        7.8% (runs beyond the largest block measured: 25.6% to 21.8%), envelope's from 4.0% to 4.4% (its runs do
        curve a little: bytes per element 20.1 at 0.80 M elements, 21.9 at 1.84 M); coverage and the mean bound
        over the peak were unchanged (envelope's 1.17x to 1.16x).
        """
        sizes = sorted(self._size_peaks)
        if len(sizes) >= 2 and all(b <= self.memory_gap_ratio * a for a, b in zip(sizes, sizes[1:])):
            return True
        ratio = _rate_ratio(list(self._size_peaks.items()), self.min_size_ratio)
        return ratio is not None and ratio > 1.0 + self.memory_curve_margin

    def seconds_for(self, elements: int) -> float | None:
        """Compute seconds for a block of ``elements`` (halo included) when time grows faster than its size.

        None while no curve counts: then time is proportional to size and the
        planner uses :meth:`seconds_per_element` (a median: robust to a slow
        run). An operator whose cost grows with the square of traces per chunk
        is cheaper per element in smaller chunks; this is how the planner knows
        it. Where a curve counts only in part (:meth:`time_curve_weight`), the
        rest is the fitted line held at no constant it was weighed against.
        """
        weight, curve = self.time_curve_weight()
        if curve is None or weight <= 0.0:
            return None
        u = int(elements) / MIB
        seconds = max(0.0, self._time_mean(curve, u))
        return seconds if weight >= 1.0 else weight * seconds + (1.0 - weight) * max(0.0, self._time_mean(LINEAR, u))

    def _time_mean(self, form: str, u: float) -> float:
        """The fitted compute seconds of time form ``form`` for a block of ``u`` Mi-elements."""
        f = self._time_forms[form]
        return f.mean(u, f.fit(self.prior_noise, 1.0, self.min_noise))

    def _score(self, obs: Observation, pred: Prediction) -> None:
        self._mape.update(obs.peak_bytes, pred.mean_bytes)
        self._coverage.update(1.0 if obs.peak_bytes <= pred.upper_bytes else 0.0)
        self._bound_ratio.update(pred.upper_bytes / obs.peak_bytes)

    def conformal_factor(self) -> float | None:
        """The learned margin: the split-conformal quantile of (needed / predicted mean) at ``confidence``.

        Each ``ok`` run scored once the model was ready gives ``peak / mean``,
        the mean predicted *before* the run was learned. With ``n`` of
        them the factor is their ``ceil((n + 1) * confidence)``-th smallest, so a
        new run needs more than ``mean x factor`` with probability at most
        ``1 - confidence`` (runs exchangeable). None until there are enough runs
        (19 at 0.95). Only the latest ``conformal_window`` runs count (20: the
        largest ratio among them at 0.95): the errors of the model as it is now,
        not of the model it was after its first probes (in a benchmark run the
        whole-history factor was 1.09 for an operator whose recent error was 0.4%).
        """
        n = len(self._ratios)
        k = math.ceil((n + 1) * self.confidence)
        if n == 0 or k > n:
            return None
        return sorted(self._ratios)[k - 1]

    def unseen_bytes(self) -> float:
        """The most memory the latest ``metric_window`` runs started above the resting level the budget assumed.

        Bytes; 0 if none. Recent runs only: it is a property of the workers as
        they are now (memory left behind by earlier tasks, this operator's
        imports), not of the operator's block, so it is never in a bound: a map
        takes it off its kill headroom until its own runs say where the workers
        stand (``machine.Start.drift_bytes``).
        """
        return max(self._unseen, default=0.0) * MIB

    def first_use(self, obs: Observation) -> int:
        """What ``obs`` left held in its worker, bytes, where that makes it a first use; else 0.

        A finished run that left more than both ``first_touch_bytes`` and ``first_touch_share`` of its peak held
        (``Observation.retained_bytes``). Less is what any run leaves (allocator pages, Python's caches) and stays
        in the peak it was measured with.
        """
        return first_use_bytes(obs, self.first_touch_bytes, self.first_touch_share)

    def working_bytes(self, obs: Observation) -> int:
        """The peak of ``obs`` as this model learns it: less what a first use left held (:meth:`first_use`),
        bytes. What a prediction of the block is compared with."""
        return max(1, int(obs.peak_bytes) - self.first_use(obs))

    def first_use_bytes(self) -> float:
        """The most memory one of the latest ``metric_window`` first uses left held in its worker, bytes; 0 if none.

        Like :meth:`unseen_bytes` it belongs to a worker, not to a block, and is never in a bound: a map takes it
        off its kill headroom until its own runs say where the workers stand, so a fresh worker's first chunk
        (the first use and the block together) fits as a warm worker's does. Kept over first uses, not runs:
        they come once per worker process, and a long map's runs would push it out of a window of runs.
        """
        return max(self._first_use, default=0.0) * MIB

    def _learn_point(self, obs: Observation) -> None:
        u = obs.elements / MIB
        y = obs.peak_bytes / MIB
        scale = math.hypot(y, self.noise_floor_bytes / MIB)
        for form in self._forms.values():
            form.learn(u, y, scale)
        self._sizes.add(obs.elements)
        self._size_peaks[obs.elements] = max(self._size_peaks.get(obs.elements, 0.0), y)
        self._largest = max(self._largest, obs.elements)
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

    # ------------------------------------------------------------------ predicting

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

        Within the data the forms agree; outside it a line under-predicts a
        curve the noise hid. The weight is the leave-one-out likelihood ratio,
        ``1 / (1 + (PRESS_curved / PRESS_lin) ** (n / 2))``: about 1/2 while the
        data cannot tell them apart, falling towards 0 as they show the line is
        enough. It counts even when the fitted curvature is negative: the
        curvature's uncertainty is what widens the bound far from the data.
        """
        if self._ready_reason() is not None or self.form() != LINEAR:
            return 0.0, None
        fits = self._fits()
        best = self._best_curved(fits, curving_up=False)
        if best is None:
            return 0.0, None
        return _loo_weight(fits[best].press, fits[LINEAR].press, fits[LINEAR].n), best

    def _upper_mib(self, u: float) -> tuple[float, float]:
        """(mean, upper) in MiB: the chosen form's, its bound blended towards the best curved one's."""
        mean, upper = self._bound(self.form(), u)
        w, other = self._curved_weight()
        if other is not None and w > 0:
            upper = upper + w * max(0.0, self._bound(other, u)[1] - upper)
        return mean, upper

    def _ready_reason(self) -> str | None:
        n = self.n_observations
        if n < self.min_observations:
            return (f"only {n} usable observation{'s' if n != 1 else ''} of {self.key!r}; "
                    f"{self.min_observations} are needed before planning (probe first)")
        if len(self._sizes) < 2:
            return (f"all {n} observations of {self.key!r} are at one block size; "
                    "a fixed overhead and a per-element cost need two sizes (probe another size)")
        smallest = min(self._sizes)
        if self._largest < self.min_size_ratio * smallest:
            # Two sizes a few percent apart cannot separate a fixed overhead from a per-element cost: a line
            # through 940,800 and 960,000 elements (peaks 686 and 723 MiB) read 0 bytes for a 3 x 3-trace block
            # and an upper bound of 2.7 GiB for it.
            return (f"the {n} observations of {self.key!r} span blocks of {smallest:,} to {self._largest:,} "
                    f"elements, less than {self.min_size_ratio:g}x apart: a fixed overhead and a per-element cost "
                    "need sizes further apart (probe another size)")
        return None

    def predict(self, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        """Mean and upper bound of the peak bytes for a block of ``extents`` (halo included).

        ``itemsize`` (bytes per element) only matters with no usable
        observations, where the guess is the block's own bytes (a lower bound);
        the key already pins the dtype.
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
            # The conformal margin, once learned, is a floor.
            q = self.conformal_factor()
            if q is not None and mean * q > upper:
                upper = mean * q
                reason += f"; bound {q:.3f} x the mean (learned from {len(self._ratios)} runs)"
            # Trusted up to tight_reach x the largest block measured: each plan at most doubles what is known.
            tight = upper if u > self.tight_reach * self._largest_u() else min(upper, self._tight_mib(u, mean, q))
            curve = self._unsupported_curve()
            if curve is not None:
                # The runs cannot tell the line from this curve (an operator's memory that does curve, envelope's,
                # and one that does not, gaussian_smooth's, left the same cold-start picture): the line's mean is
                # the estimate, and the tight bound holds the curve's.
                tight = max(tight, min(upper, self._bound(curve, u)[0]))
            w, other = self._curved_weight() if curve is None else (0.0, None)
            if other is not None and w > 0 and u > self._largest_u():
                # The curve the upper bound blends in (the runs cannot rule it out; a refused one is held above)
                # counts in the tight bound by the same weight: its mean times the margin. Beyond the largest
                # block, where the two part, the line's alone was under the peak for 54 of 173 envelope runs in
                # the kept benchmark stores (26 with it).
                curved = self._tight_mib(u, self._bound(other, u)[0], q)
                tight = max(tight, min(upper, tight + w * (curved - tight)))
            growth = self._growth_mib(u)
            if growth is not None and growth[0] > tight:
                upper, tight = max(upper, growth[0]), growth[0]
                reason += f"; beyond the largest block measured, grows as size^{growth[1]:.2f} as the runs did"
        if apply_censored and self._censored:
            mean, upper, tight, note = self._apply_censored(u, mean, upper, tight)
            if note:
                reason += f"; {note}"
        return Prediction(mean_bytes=mean * MIB, upper_bytes=upper * MIB, n_observations=n,
                          ready=self._ready_reason() is None, reason=reason, tight_bytes=tight * MIB)

    def _growth_mib(self, u: float) -> tuple[float, float] | None:
        """(bound in MiB, exponent) for a block of ``u`` Mi-elements beyond the largest measured, while the
        curvature cannot be fitted yet (fewer than three sizes, or too few runs for the quadratic form), if the
        two largest sizes at least ``min_size_ratio`` apart grew faster than linearly: the largest peak there
        times ``(u / largest) ** exponent``. A line through two sizes of an operator quadratic in its size
        under-predicts every larger block (the cold start's second probe wave is sized so such an operator
        fits; its plan must not then jump past it on a line). None otherwise."""
        largest = self._largest
        if u * MIB <= largest or (len(self._sizes) >= 3 and self._forms[QUADRATIC].n >= len(_POWERS[QUADRATIC]) + 2):
            return None
        below = [e for e in self._size_peaks if e * self.min_size_ratio <= largest]
        if not below:
            return None
        other = max(below)
        p_large, p_other = self._size_peaks[largest], self._size_peaks[other]
        if p_other <= 0 or p_large <= p_other:
            return None
        exponent = math.log(p_large / p_other) / math.log(largest / other)
        if exponent <= 1.0:
            return None
        return p_large * (u * MIB / largest) ** exponent, exponent

    def _largest_u(self) -> float:
        """The largest block (Mi-elements) with a usable ``ok`` observation."""
        return self._largest / MIB

    def _tight_mib(self, u: float, mean: float, q: float | None) -> float:
        """The least bound (MiB) for a block of ``u`` Mi-elements and mean ``mean``: the learned margin with no
        extrapolation widening (:meth:`_predict_u` raises it where a curve the runs cannot rule out parts from
        the line, beyond the largest block).

        With a conformal factor (see :meth:`conformal_factor`) it is ``mean x q``;
        before that, the prediction interval of a point inside the data (leverage 0,
        chosen form only). Valid inside the sizes seen; beyond them it is
        the bet the learned policy may take and is rewarded or penalised for, and
        only up to ``tight_reach`` x the largest block measured (beyond that the
        tight bound is the upper bound).
        """
        if q is not None:
            return mean * q
        form = self._forms[self.form()]
        fit = self._fits()[form.name]
        scale = math.hypot(mean, self.noise_floor_bytes / MIB) / form.weight(u)
        return mean + _t_quantile(self.confidence, fit.dof) * fit.s * scale

    def _bound(self, name: str, u: float) -> tuple[float, float]:
        """(mean, upper) in MiB from one form's River posterior."""
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
                # much no one knows: floored at censored_block_factor x what it had. Read against the kill line
                # less the resting memory, a smaller 'had' on the next run (workers resting lower) must not
                # admit the same size again; a much larger worker does.
                floor = max(floor, need * self.censored_block_factor)
            if self._ready_reason() is None:
                bound_c = self._upper_mib(c.u)[1]
            else:
                _, bound_c = self._guess(c.u, ITEMSIZE)
            if bound_c >= need:
                continue
            ratio = need / max(bound_c, 1e-9)
            w = min(1.0, max(0.0, (math.log2(u / c.u) + 3.0) / 2.0))
            factor = max(factor, 1.0 + (ratio - 1.0) * w)
        if factor > 1.0 or floor > upper:
            note = f"raised by {len(self._censored)} out-of-memory record(s)"
        return max(mean * factor, floor), max(upper * factor, floor), max(tight * factor, floor), note

    # ------------------------------------------------------------------ reporting

    def explain(self, extents: Sequence[int]) -> dict[str, Any]:
        """What a block's upper bound is made of, for a person asking why it is what it is (bytes).

        ``form`` and ``mean_bytes`` / ``upper_bytes`` / ``tight_bytes`` as :meth:`predict` gives them;
        ``form_upper_bytes``: the chosen form's own bound, before the best curved form's is blended in;
        ``curved_form``, ``curved_upper_bytes`` and ``curved_weight``: that form, its bound and the share of
        the gap it adds (:meth:`_curved_weight`; None and 0 when none is blended); ``times_largest``: the
        block over the largest one measured (past ``tight_reach`` the tight bound is the upper bound);
        ``line_mean_bytes``: the line's mean, whichever form is chosen; ``curve_supported``: whether the sizes
        measured support a curved form (:meth:`memory_curve_supported`; a curved ``form`` where they do not
        was taken on leave-one-out alone, ``memory_gap_gain``).
        Empty of fit figures (None) while the model is not ready.
        """
        elements = 1
        for e in extents:
            elements *= int(e)
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
            "recent_mape": None,
            "coverage": None,
            "bound_over_truth": None,
            "scored": self._coverage.obj.n if hasattr(self._coverage, "obj") else None,
            "margin": self.conformal_factor(),
            "margin_runs": len(self._ratios),
            "unseen_bytes": self.unseen_bytes(),
            "first_use_bytes": self.first_use_bytes(),
            "seconds_per_element": self.seconds_per_element(),
            "time_form": self.time_form(),
            "time_curve": self.time_curve_weight()[1],  # the curve counted in a block's seconds, if any
            "time_curve_weight": self.time_curve_weight()[0],  # how much (0..1; the fitted line, the rest)
            "time_rate_ratio": self.rate_ratio(),  # seconds per element, largest blocks over smallest
            "time_runs": len(self._rates),  # ok runs time is learned from (the latest RATE_HISTORY)
            "first_touch_runs": len(self._first_touch_rates),  # ok runs set aside: they grew their worker
            "touch_seconds_per_gib": None,  # kernel seconds per GiB a run paid to grow its worker (below)
            "joules_per_element": None,
            "energy_source": None,
            "energy_runs": len(self._energy),
            "energy_mape": None,
        }
        jpe = self.joules_per_element()
        if jpe is not None:
            out["joules_per_element"], out["energy_source"] = jpe
        spb = self.touch_seconds_per_byte()
        if spb is not None:
            out["touch_seconds_per_gib"] = spb * 2**30
        if _rolling_count(self._energy_mape):
            out["energy_mape"] = self._energy_mape.get() / 100.0
        if fits and out["ready"]:
            fit = fits[form]
            coef = self._forms[form].coefficients(fit)
            out["fixed_overhead_bytes"] = float(coef[0] * MIB)
            out["bytes_per_element"] = float(coef[1])  # MiB per Mi-element == bytes per element
            if form in CURVED:
                out["superlinear_coefficient"] = float(coef[2])
                out["superlinear_power"] = _POWERS[form][2]
            out["noise"] = fit.s
        n_scored = _rolling_count(self._coverage)
        out["scored"] = n_scored
        if n_scored:
            out["recent_mape"] = self._mape.get() / 100.0  # fraction, not percent
            out["coverage"] = self._coverage.get()
            out["bound_over_truth"] = self._bound_ratio.get()
        return out


def gpu_view(obs: Observation) -> Observation | None:
    """``obs`` as the GPU model of its key learns it: the GPU peak in place of the host's; None when it says
    nothing about GPU memory.

    A GPU map's key learns two models from the same runs (host bytes and GPU bytes; a GPU chunk must fit both
    budgets). The GPU's view of a run of a map on the GPU (``gpu_budget_bytes`` set): a finished run's
    ``gpu_peak_bytes`` above the worker's resting GPU memory; a GPU out-of-memory censored at what the device
    held when it failed, or the GPU budget where that is more; nothing from a host out-of-memory or a killed
    worker (the device's figure then is wherever the run stopped, neither a peak nor a bound), or an error.
    The host's fields the GPU does not have (what the worker held before, energy) are cleared. The host's
    model ignores a GPU out-of-memory (:meth:`OperatorModel.learn`).
    """
    if obs.gpu_budget_bytes is None or not obs.usable:
        return None  # not a map on the GPU (a CPU run's NVML figure is another process's business)
    if obs.gpu_out_of_memory:
        # It needed more than it held when it failed, and more than the budget it was planned within (a first
        # large allocation that fails leaves the pool where it was: 0 measured).
        peak, outcome, censored = max(int(obs.gpu_peak_bytes or 0), int(obs.gpu_budget_bytes)), "memory_error", True
    elif obs.outcome == "ok" and obs.gpu_peak_bytes is not None:
        peak, outcome, censored = int(obs.gpu_peak_bytes), "ok", False
    else:
        return None
    return replace(obs, peak_bytes=peak, outcome=outcome, censored=censored, gpu_out_of_memory=False,
                   budget_bytes=obs.gpu_budget_bytes, baseline_bytes=None, resting_bytes=None, others_bytes=None,
                   grew_bytes=None, retained_bytes=None, energy_joules=None, energy_source=None, shared=False)


#: A scored run whose block has more than this many times the elements of every block learned before it was
#: predicted by extrapolation (:func:`replay_quality` reports its error apart).
BEYOND_RATIO = 1.05


def replay_quality(rows: Iterable[Observation], key: str, *, after: int = 5, **options: Any) -> dict[str, Any]:
    """How well ``key``'s model predicted its own history: each ``ok`` run scored before it is learned.

    ``rows``: the key's observations in the order they were stored. A run is
    scored once the model is ready and has learned ``after`` usable runs: the
    absolute error of the predicted mean (``mape``, a fraction), whether the peak
    was within the upper bound (``coverage``, a share) and the upper bound over
    the peak (``bound_over_peak``, mean). The issue's goals for a real run:
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


@dataclass(frozen=True)
class _EnergyRun:
    """One ok run's energy, as the energy model keeps it (joules, elements, when and where it ran)."""

    joules: float
    elements: int
    source: str
    start: float
    end: float
    weight: float  # busy cores while it ran (CPU seconds / wall seconds), for sharing a device counter
    host: str

    @property
    def measured(self) -> bool:
        return is_measured(self.source)

    @classmethod
    def of(cls, obs: Observation) -> "_EnergyRun":
        end = float(obs.created_at)
        start = float(obs.started_at) if obs.started_at is not None else end - float(obs.seconds)
        return cls(float(obs.energy_joules or 0.0), int(obs.elements), str(obs.energy_source or ESTIMATE),
                   start, max(start, end), busy_weight(obs.cpu_seconds, obs.seconds), obs.host or obs.worker)


def _split_by_device(runs: Sequence[_EnergyRun]) -> list[float]:
    """Each measured run's share of its device's counter, runs grouped by (host, counter)."""
    return split_among_devices([(r.host, r.source) for r in runs],
                               [DeviceRun(r.start, r.end, r.joules, r.weight) for r in runs])


class ModelBank:
    """One :class:`OperatorModel` per key, rebuilt by replaying the store's rows (never unpickled).

    ``learn(obs)`` writes the row first, then learns, so what a model knows is
    always on disk. :meth:`refresh` replays rows other processes have added
    since (flows sharing a store). Thread-safe.
    """

    def __init__(self, store: "Store | None", **model_options: Any):
        self.store = store
        self.model_options = model_options
        self._models: dict[str, OperatorModel] = {}
        self._last_id: dict[str, int] = {}
        self._gpu_models: dict[str, OperatorModel] = {}
        self._gpu_last_id: dict[str, int] = {}
        self._learners: dict[str, ArmLearner] = {}
        self._last_reward: dict[str, int] = {}
        self._lock = threading.RLock()

    def model(self, key: str) -> OperatorModel:
        """The model of ``key`` (an empty one if the store has nothing for it)."""
        with self._lock:
            m = self._models.get(key)
            if m is None:
                m = OperatorModel(key, **self.model_options)
                self._models[key] = m
                self._last_id[key] = 0
                self._replay(key)
            return m

    def gpu_model(self, key: str) -> OperatorModel:
        """The GPU-memory model of ``key``: learned from the same rows through :func:`gpu_view` (an empty one
        where no run of ``key`` measured the GPU)."""
        with self._lock:
            m = self._gpu_models.get(key)
            if m is None:
                m = self._gpu_models[key] = OperatorModel(key, **self.model_options)
                self._gpu_last_id[key] = 0
                self._replay_gpu(key)
            return m

    @staticmethod
    def _learn_gpu(m: OperatorModel, obs: Observation) -> None:
        view = gpu_view(obs)
        if view is not None:
            m.learn(view)

    def _replay(self, key: str) -> None:
        if self.store is None:
            return
        m = self._models[key]
        for row_id, obs in self.store.rows(key, after=self._last_id.get(key, 0)):
            m.learn(obs)
            self._last_id[key] = row_id

    def _replay_gpu(self, key: str) -> None:
        if self.store is None:
            return
        m = self._gpu_models[key]
        for row_id, obs in self.store.rows(key, after=self._gpu_last_id.get(key, 0)):
            self._learn_gpu(m, obs)
            self._gpu_last_id[key] = row_id

    def refresh(self, key: str | None = None) -> None:
        """Learn rows added to the store by others since this bank last looked."""
        with self._lock:
            for k in ([key] if key else list(self._models)):
                if k in self._models:
                    self._replay(k)
                if k in self._gpu_models:
                    self._replay_gpu(k)

    def learn(self, obs: Observation) -> str:
        """Persist ``obs`` to the store, then learn it (and its GPU view, see :func:`gpu_view`); returns what the
        host model did with it."""
        with self._lock:
            key = obs.operator_key
            m = self.model(key)
            gpu = key in self._gpu_models or gpu_view(obs) is not None
            if self.store is None:
                if gpu:
                    self._learn_gpu(self.gpu_model(key), obs)
                return m.learn(obs)
            self._replay(key)  # rows others wrote before ours, in order
            row_id = self.store.add(obs)
            self._last_id[key] = row_id
            if gpu:
                self.gpu_model(key)  # created from the rows (ours included), or brought up to them
                self._replay_gpu(key)
            return m.learn(obs)

    def learner(self, key: str) -> ArmLearner:
        """The learned policy's bandit of ``key``, rebuilt from the store's rewards (and any added since)."""
        with self._lock:
            lrn = self._learners.get(key)
            if lrn is None:
                lrn = self._learners[key] = ArmLearner(key)
            if self.store is not None:
                for row_id, r in self.store.reward_rows(key, after=self._last_reward.get(key, 0)):
                    lrn.learn(r)
                    self._last_reward[key] = row_id
            return lrn

    def reward(self, r: Reward) -> None:
        """Persist a finished plan's reward, then teach the bandit of its key."""
        with self._lock:
            lrn = self.learner(r.operator_key)
            if self.store is not None:
                self._last_reward[r.operator_key] = self.store.add_reward(r)
            lrn.learn(r)

    def choose_arm(self, key: str, groups: Sequence[Sequence[str]]) -> ArmChoice:
        """The arm ``key``'s bandit plays among ``groups`` (arms grouped by identical plans)."""
        with self._lock:
            return self.learner(key).choose(groups)

    def predict(self, key: str, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        """The prediction of ``key``'s model for a block of ``extents`` (halo included)."""
        with self._lock:
            return self.model(key).predict(extents, itemsize)

    def predict_gpu(self, key: str, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        """The GPU-memory prediction of ``key``'s model for a block of ``extents`` (halo included)."""
        with self._lock:
            return self.gpu_model(key).predict(extents, itemsize)

    def seconds_per_element(self, key: str, window: int = 20) -> float | None:
        """``key``'s recent compute seconds per element (see :meth:`OperatorModel.seconds_per_element`)."""
        with self._lock:
            return self.model(key).seconds_per_element(window)

    def seconds_for(self, key: str, elements: int) -> float | None:
        """``key``'s compute seconds for a block, when not proportional (see :meth:`OperatorModel.seconds_for`)."""
        with self._lock:
            return self.model(key).seconds_for(elements)

    def joules_for(self, key: str, elements: int, window: int = 20) -> float | None:
        """``key``'s learned energy of a block (see :meth:`OperatorModel.joules_for`), joules; None if none."""
        with self._lock:
            return self.model(key).joules_for(elements, window)

    def touch_seconds_per_byte(self, key: str) -> float | None:
        """What growing a worker's memory costs ``key``'s runs, kernel seconds per byte
        (:meth:`OperatorModel.touch_seconds_per_byte`); where its own runs grew less than
        ``TOUCH_POOL_BYTES`` in all, every model this bank has loaded, pooled: the cost is the kernel's,
        paid alike by any operator on the machine, and an operator's first map has none of its own.
        None before any such run."""
        with self._lock:
            own_seconds, own_grew = self.model(key).touch_costs()
            if own_grew >= TOUCH_POOL_BYTES:
                return own_seconds / own_grew
            costs = [m.touch_costs() for m in self._models.values()]
            grew = sum(c[1] for c in costs)
            return sum(c[0] for c in costs) / grew if grew > 0 else None

    def predictor(self, key: str, itemsize: int = ITEMSIZE):
        """A callable ``extents -> Prediction`` for ``policy.plan`` (serialized with ``learn``)."""
        return lambda extents: self.predict(key, extents, itemsize)

    def keys(self) -> list[str]:
        """Keys with observations in the store (or learned here when there is no store)."""
        with self._lock:
            keys = list(self.store.keys()) if self.store is not None else []
            return keys + [k for k in self._models if k not in keys and self._models[k].n_observations]


class BankKnowledge:
    """The state machine's read-only view of one key's model in a :class:`~memchunk_prefect.learn.model.ModelBank`."""

    def __init__(self, bank: "ModelBank", key: str, settings: PolicySettings):
        self.bank = bank
        self.key = key
        self.settings = settings

    def predict(self, extents: Shape) -> Prediction:
        return self.bank.predict(self.key, extents, ITEMSIZE)

    def predict_gpu(self, extents: Shape) -> Prediction:
        return self.bank.predict_gpu(self.key, extents, ITEMSIZE)

    def seconds_per_element(self) -> float | None:
        return self.bank.seconds_per_element(self.key, self.settings.time_window)

    def seconds_for(self, elements: int) -> float | None:
        return self.bank.seconds_for(self.key, elements)

    def joules_for(self, elements: int) -> float | None:
        return self.bank.joules_for(self.key, elements, self.settings.time_window)

    def touch_seconds_per_byte(self) -> float | None:
        return self.bank.touch_seconds_per_byte(self.key)

    def block_seconds(self, elements: int) -> float | None:
        """Learned wall seconds of one block of ``elements`` (halo included): its compute time as the planner
        estimates it, plus the per-task overhead; None while no time is learned (for progress displays)."""
        compute = self.seconds_for(elements)
        if compute is None:
            spe = self.seconds_per_element()
            if spe is None:
                return None
            compute = elements * spe
        return compute + self.settings.per_task_overhead_seconds

    def margin(self) -> float | None:
        """The learned margin: the conformal quantile of needed / predicted mean (None until learned)."""
        return self.bank.model(self.key).conformal_factor()

    def choose_arm(self, groups: list[tuple[str, ...]]) -> ArmChoice:
        return self.bank.choose_arm(self.key, groups)
