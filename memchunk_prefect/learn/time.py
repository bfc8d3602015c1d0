"""The time model of one operator key: compute seconds of a block, and what growing a worker's memory costs."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from memchunk_prefect.core.records import FIRST_USE_BYTES, FIRST_USE_SHARE, Observation
from memchunk_prefect.learn.forms import (
    _POWERS,
    CURVED,
    LINEAR,
    MIB,
    MIN_NOISE,
    MIN_SIZE_RATIO,
    PRIOR_NOISE,
    PRIOR_VARIANCE,
    RATE_HISTORY,
    SUPERLINEAR_GAIN,
    _Fit,
    _Form,
    _loo_weight,
    _rate_ratio,
)

#: Timed runs (first calls set aside) before :meth:`TimeModel.time_spread` says how far runs stray from the model.
MIN_SPREAD_RUNS = 5

#: Timed blocks of one flow run before :meth:`TimeModel.run_offsets` gives that flow run an offset.
MIN_RUN_BLOCKS = 2


@dataclass(frozen=True)
class _TimeChoice:
    """What time is planned by: the form named (:meth:`TimeModel.time_form`), the curve whose mean counts in a
    block's seconds (None: the line alone) and how much it counts (0..1; the fitted line counts the rest)."""

    form: str
    curve: str | None
    weight: float


class TimeModel:
    """Compute seconds of one operator's blocks: a rate per element, and a curve where time grows faster.

    Time proportional to size is planned by :meth:`seconds_per_element`, a
    median of the latest runs' rates (one run slowed by a busy machine does not
    move it). Where time grows faster than size (all pairs of traces), smaller
    chunks are cheaper per element, and :meth:`seconds_for` says so: the same
    forms as memory (:mod:`memchunk_prefect.learn.forms`), fitted on relative
    residuals of seconds with every constant held at 0 or above, and a curve
    counted only where the runs support it (:meth:`time_form`,
    :meth:`time_curve_weight`). Where the rates fall with size (a per-block cost
    weighs on small blocks: :meth:`rates_fall`), a block is planned on the line
    between the smallest and the largest blocks timed (:meth:`falling_seconds`),
    not at a median rate over all sizes, which a cold start's small probes pull up.

    *First call.* A worker process's first run of an operator
    (``Observation.first_call``) pays what the process loads for it once: a
    library imported, a kernel compiled, a file opened. It is not a cost per
    element: learned as one, the fixed cost it puts on each block reads small
    blocks as slow, and a plan of many chunks as costlier than it runs. So a first
    call teaches the forms and rates nothing; what it took beyond a later call of
    the same block is learned apart (:meth:`first_call_seconds`), to be paid once
    per worker process (the simulator does; its pinning test is
    ``test_a_workers_first_call_is_learned_apart_and_does_not_read_small_blocks_as_slow``).

    *First touch.* A run that took its worker well above the most it had held
    (``Observation.grew_bytes`` over ``first_touch_bytes`` and ``first_touch_share``
    of its peak) paid the kernel to fault in and zero that memory, once per worker
    and growth, not per element. It teaches time without its kernel seconds
    (:meth:`compute_seconds`), and what the growth cost is learned apart
    (:meth:`touch_seconds_per_byte`) for the planner to count once per worker.

    Parameters (public, as constructed): ``time_window``, the latest runs a
    median rate is over; ``time_floor_seconds``, added in quadrature to each
    run's seconds when fitting (runs of milliseconds are mostly scheduling
    noise); ``first_touch_bytes`` / ``first_touch_share``, what makes a run a
    first touch; ``superlinear_gain``, the fraction of the line's leave-one-out
    error a curve must reach; ``time_rising_gain``, the same where the measured
    rates rise (the rise is evidence of a curve already); ``time_curve_margin``,
    how much the largest blocks' rate must exceed the smallest's to count as
    rising; ``time_gap_ratio``, the widest step between consecutive sizes that
    still tests a curve where the planner uses it; ``min_size_ratio``, sizes this
    far apart compare rates; ``prior_variance``, ``prior_noise``, ``min_noise``:
    the forms' prior and noise scale (:class:`~memchunk_prefect.learn.forms._Form`).

    Units: seconds, elements, bytes.

    >>> from memchunk_prefect.core.records import Observation
    >>> t = TimeModel()
    >>> for n in (2**18, 2**19, 2**20, 2**21) * 2:  # seconds grow with the square of the block
    ...     t.learn(Observation("k|float32|cpu", n, (1, 1, n), 4 * n, 2**20, seconds=0.1 * (n / 2**20) ** 2))
    >>> t.time_form(), round(t.seconds_for(2**21), 3)
    ('quadratic', 0.4)
    >>> round(t.seconds_per_element() * 2**21, 3)  # the median rate, which a line would plan by
    0.2
    """

    def __init__(self, time_window: int = 20, time_floor_seconds: float = 0.01,
                 first_touch_bytes: float = FIRST_USE_BYTES, first_touch_share: float = FIRST_USE_SHARE,
                 superlinear_gain: float = SUPERLINEAR_GAIN, time_rising_gain: float = 1.0,
                 time_curve_margin: float = 0.1, time_gap_ratio: float = 3.0, min_size_ratio: float = MIN_SIZE_RATIO,
                 prior_variance: float = PRIOR_VARIANCE, prior_noise: float = PRIOR_NOISE,
                 min_noise: float = MIN_NOISE):
        if not time_curve_margin >= 0.0:
            raise ValueError(f"time_curve_margin must be a fraction of at least 0, got {time_curve_margin!r}")
        if not time_gap_ratio > 1.0:
            raise ValueError(f"time_gap_ratio must be above 1, got {time_gap_ratio!r}")
        if not 0.0 < time_rising_gain <= 1.0:
            raise ValueError(f"time_rising_gain must be in (0, 1] (a fraction of the line's leave-one-out error), "
                             f"got {time_rising_gain!r}")
        self.time_window = time_window
        self.time_floor_seconds = time_floor_seconds
        self.first_touch_bytes = first_touch_bytes
        self.first_touch_share = first_touch_share
        self.superlinear_gain = superlinear_gain
        self.time_rising_gain = time_rising_gain
        self.time_curve_margin = time_curve_margin
        self.time_gap_ratio = time_gap_ratio
        self.min_size_ratio = min_size_ratio
        self.prior_variance = prior_variance
        self.prior_noise = prior_noise
        self.min_noise = min_noise
        # Time has no bound to hedge, only a form chosen by held-out error: its curvature keeps the weak prior.
        self._forms = {name: _Form(name, prior_variance, math.sqrt(prior_variance), nonnegative_constant=True)
                       for name in _POWERS}
        self._sizes: set[int] = set()  # block sizes the forms learned, elements
        self._runs: deque[tuple[int, float]] = deque(maxlen=RATE_HISTORY)  # (elements, compute seconds) learned
        self._flow_runs: deque[str] = deque(maxlen=RATE_HISTORY)  # the flow run of each of _runs, in step with it
        self._cpu_runs: deque[tuple[int, float]] = deque(maxlen=RATE_HISTORY)  # (elements, CPU s) of _runs that have it
        self._run_misses: dict[str, list[float]] | None = None  # run_misses, until the forms learn a run
        self._memo: _TimeChoice | None = None  # the choice, until the forms learn a run
        self._falling: dict[int, float | None] = {}  # seconds_for by block size, until the forms learn a run
        self._ceilings: dict[int, float | None] = {}  # first_call_ceiling by block size, until a run is learned
        self._slopes: dict[int, float | None] = {}  # robust_slope by window, until the forms learn a run
        self._floor_memo: tuple[int, int, float, float] | None = None  # rising_floor's sizes and rates, until a run
        self._rates: deque[float] = deque(maxlen=RATE_HISTORY)  # compute seconds per element of ok runs
        self._first_touch_rates: deque[float] = deque(maxlen=RATE_HISTORY)  # first touches of unknown kernel time
        self._first_calls: deque[tuple[int, float]] = deque(maxlen=RATE_HISTORY)  # (elements, compute s) of those
        self._first_call_rates: deque[float] = deque(maxlen=RATE_HISTORY)  # their compute seconds per element
        self._touch_costs: deque[tuple[float, float, int]] = deque(maxlen=RATE_HISTORY)  # (sys s, grew B, elements)
        self._sys_rates: deque[float] = deque(maxlen=RATE_HISTORY)  # kernel s per element of runs that did not grow

    def learn(self, obs: Observation) -> None:
        """Learn an ``ok`` run's seconds and kernel time (other outcomes say nothing of time)."""
        if obs.gpu_out_of_memory or obs.outcome != "ok" or obs.elements <= 0:
            return
        if obs.sys_seconds is not None:
            if self.first_touch(obs):
                self._touch_costs.append((float(obs.sys_seconds), float(obs.grew_bytes or 0), int(obs.elements)))
            else:
                self._sys_rates.append(float(obs.sys_seconds) / obs.elements)
        seconds = self.compute_seconds(obs)
        if seconds is None:
            self._first_touch_rates.append(obs.seconds / obs.elements)
            return
        if obs.first_call:
            self._first_calls.append((int(obs.elements), seconds))
            self._first_call_rates.append(seconds / obs.elements)
            self._ceilings.clear()
            return
        self._rates.append(seconds / obs.elements)
        if seconds > 0:
            u = obs.elements / MIB
            for form in self._forms.values():
                form.learn(u, seconds, math.hypot(seconds, self.time_floor_seconds))
            self._sizes.add(obs.elements)
            self._runs.append((int(obs.elements), seconds))
            self._flow_runs.append(obs.flow_run_id)
            cpu = self._work_seconds(obs)
            if cpu is not None:
                self._cpu_runs.append((int(obs.elements), cpu))
            self._memo = None
            self._run_misses = None
            self._falling.clear()
            self._ceilings.clear()
            self._slopes.clear()
            self._floor_memo = None

    # ------------------------------------------------------------------ first touch

    def first_touch(self, obs: Observation) -> bool:
        """Whether ``obs`` took its worker well above the most it had held (``first_touch_bytes`` and
        ``first_touch_share`` of its peak): its wall time then includes faulting that memory in.
        False when unknown (records older than schema v7)."""
        grew = obs.grew_bytes
        return grew is not None and grew > max(self.first_touch_bytes, self.first_touch_share * obs.peak_bytes)

    def compute_seconds(self, obs: Observation) -> float | None:
        """The seconds an ``ok`` run teaches time: its wall seconds; for a first touch (:meth:`first_touch`), its
        wall seconds less its kernel CPU time (``sys_seconds``), or None where that is unknown.

        A first touch's extra cost is the kernel's (``python -m benchmarks.studies.first_touch``): wall less system
        time of a first call is what the next call costs to within the next's own system time, so a cold
        start's probes, each larger than any before on its worker, still teach how time grows with the block.
        """
        if not self.first_touch(obs):
            return float(obs.seconds)
        if obs.sys_seconds is None:
            return None
        return max(0.0, float(obs.seconds) - float(obs.sys_seconds))

    def resting_sys_per_element(self, window: int | None = None) -> float | None:
        """Kernel seconds per element a run pays that does not grow its worker: the median over the latest
        ``window`` such runs (default ``time_window``; None before one)."""
        if not self._sys_rates:
            return None
        window = self.time_window if window is None else window
        rates = sorted(list(self._sys_rates)[-max(1, int(window)):])
        return rates[len(rates) // 2]

    def growth_kernel_seconds(self, sys_seconds: float, elements: int, rest: float | None = None) -> float:
        """Of a first touch's kernel seconds, what growing its worker cost: all of them, less what a run of
        ``elements`` pays below the mark (``rest`` per element, default :meth:`resting_sys_per_element`;
        nothing while none is known)."""
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

        Summed over the runs (not a median of ratios), so the large growths, which cost what a plan pays,
        decide. Time is fitted to first touches less their kernel time (:meth:`compute_seconds`), so the two
        add up to what such a run took.
        """
        sys_seconds, grew = self.touch_costs()
        return sys_seconds / grew if grew > 0 else None

    # ------------------------------------------------------------------ first call

    def first_call_seconds(self, window: int | None = None) -> float | None:
        """Seconds a worker process's first call of this operator takes beyond a later call of the same block: the
        median, over the latest ``window`` first calls (default ``time_window``; the upper middle value for an even
        count), of each one's compute seconds (:meth:`compute_seconds`) less what the model gives its block
        (:meth:`block_compute_seconds`), at least 0. Paid once per worker process, not per block. None before both
        a first call and a later run were learned."""
        if not self._first_calls or not self._rates:
            return None
        window = self.time_window if window is None else window
        extra = sorted(max(0.0, s - (self.block_compute_seconds(e) or 0.0))
                       for e, s in list(self._first_calls)[-max(1, int(window)):])
        return extra[len(extra) // 2]

    def first_call_block_seconds(self, elements: int, window: int | None = None) -> float | None:
        """Seconds a worker process's first call of a block of ``elements`` (halo included) takes, one-off cost
        and compute together, as first calls of about that size took them: the median, over the latest ``window``
        first calls (default ``time_window``) within ``min_size_ratio`` of the size, of each one's seconds
        (:meth:`compute_seconds`) scaled to the size by the model's growth (:meth:`block_compute_seconds`; by the
        size where it has none; the one-off part is scaled with it, off by at most ``min_size_ratio``). None where
        no first call was that size."""
        window = self.time_window if window is None else window
        e = int(elements)
        near = [(size, seconds) for size, seconds in self._first_calls
                if size <= self.min_size_ratio * e and e <= self.min_size_ratio * size][-max(1, int(window)):]
        if not near:
            return None
        at_e = self.block_compute_seconds(e)
        scaled = []
        for size, seconds in near:
            at_size = self.block_compute_seconds(size)
            scaled.append(seconds * (at_e / at_size if at_e and at_size else e / size))
        scaled.sort()
        return scaled[len(scaled) // 2]

    def block_compute_seconds(self, elements: int) -> float | None:
        """Compute seconds of a block of ``elements`` (halo included), as the planner counts them: :meth:`seconds_for`
        where time is not proportional to size, else :meth:`seconds_per_element` x ``elements``; None before any
        timed run."""
        seconds = self.seconds_for(elements)
        if seconds is not None:
            return seconds
        rate = self.seconds_per_element()
        return None if rate is None else rate * int(elements)

    # ------------------------------------------------------------------ spread

    def time_spread(self, window: int | None = None) -> float | None:
        """How far the latest ``window`` timed runs (default ``time_window``; first calls set aside) fell from
        the model's own seconds for their blocks (:meth:`block_compute_seconds`), as the standard deviation of a
        log-normal factor: 1.4826 x the median of ``|ln(run / model)|`` (a normal's standard deviation from its
        median absolute deviation, about the model rather than the runs' centre, so a model that misses a size
        widens it too). None before :data:`MIN_SPREAD_RUNS` such runs (runs or model seconds of 0 left out).

        What the simulator draws a block's seconds with (:class:`memchunk_prefect.sim.inputs.Draws`), so a
        prediction's p90 covers how far the operator's runs strayed on the machines they ran on. Measured against
        the model the same runs taught, it reads low over few runs (one run sits on a median rate exactly): the
        simulator draws no less than its stated spread. On a 2-core machine, the workload family's operators
        strayed by 0.17-0.55 (``memchunk models --store DIR/<workload>.sqlite``, the time column's ``~``, on the
        stores ``python -m benchmarks.sim_validation --seed 2 --work DIR`` leaves)."""
        window = self.time_window if window is None else window
        misses = []
        for elements, seconds in list(self._runs)[-max(1, int(window)):]:
            model = self.block_compute_seconds(elements)
            if model and model > 0 and seconds > 0:
                misses.append(abs(math.log(seconds / model)))
        if len(misses) < MIN_SPREAD_RUNS:
            return None
        return 1.4826 * statistics.median(misses)

    def run_misses(self) -> dict[str, list[float]]:
        """Each flow run's timed blocks (first calls set aside), as ``ln(seconds / model)``
        (:meth:`block_compute_seconds`; runs or model seconds of 0 left out): for flow runs with at least
        :data:`MIN_RUN_BLOCKS` of the latest timed runs, and an id (a row written outside a flow run has none).

        Blocks of one run share its machine's state (what else ran, how fast the host hands memory back) and its
        block sizes, where the model may sit high or low: they stray together, which :meth:`time_spread`, one
        block at a time, does not see. What
        :meth:`memchunk_prefect.learn.bank.ModelBank.run_spread` compares between flow runs."""
        if self._run_misses is None:
            by_run: dict[str, list[float]] = {}
            for (elements, seconds), flow_run in zip(self._runs, self._flow_runs):
                model = self.block_compute_seconds(elements) if flow_run else None
                if model and model > 0 and seconds > 0:
                    by_run.setdefault(flow_run, []).append(math.log(seconds / model))
            self._run_misses = {run: misses for run, misses in by_run.items() if len(misses) >= MIN_RUN_BLOCKS}
        return self._run_misses

    def run_offsets(self) -> dict[str, float]:
        """How far each flow run's timed blocks fell from the model together: the median of its
        :meth:`run_misses`, per flow run (log terms)."""
        return {run: statistics.median(misses) for run, misses in self.run_misses().items()}

    def within_run_spread(self) -> float | None:
        """How far blocks strayed from their own run's offset (:meth:`run_offsets`), as a normal's standard
        deviation: 1.4826 x the median of ``|miss - its run's median|``, each scaled by ``sqrt(k / (k - 1))`` for
        a run of ``k`` blocks (a deviation from the median of few is short by about that); None before a run of
        :data:`MIN_RUN_BLOCKS`. What each run's offset carries of its blocks' own scatter."""
        deviations = []
        for misses in self.run_misses().values():
            centre, k = statistics.median(misses), len(misses)
            deviations += [abs(x - centre) * math.sqrt(k / (k - 1)) for x in misses]
        return 1.4826 * statistics.median(deviations) if deviations else None

    # ------------------------------------------------------------------ rates and forms

    def seconds_per_element(self, window: int | None = None) -> float | None:
        """Compute seconds per element (halo included): the median of the latest ``window`` ``ok`` runs (default
        ``time_window``; the upper middle value for an even count). Runs that paid a first touch of unknown
        kernel time (:meth:`compute_seconds`), and a worker's first calls (:meth:`first_call_seconds`), count only
        while no other run has been learned. None before any."""
        source = self._rates or self._first_touch_rates or self._first_call_rates
        if not source:
            return None
        window = self.time_window if window is None else window
        rates = sorted(list(source)[-max(1, int(window)):])
        return rates[len(rates) // 2]

    def time_form(self) -> str:
        """The form of compute seconds against block size: a curved one only where it predicts held-out runs better.

        A curve is named when it has at least ``p + 2`` runs at two sizes or
        more, rises over every size measured (one that falls at the smallest block
        fits noise: a larger block never costs less), and either the measured
        rates rise (:meth:`rates_rise`) and its leave-one-out error is within
        ``time_rising_gain`` of the line's, or it is below ``superlinear_gain`` of
        the line's, the runs support it (:meth:`curve_supported`) and its own rise
        in cost per element lies among the sizes measured (:meth:`_rises_within`). A named
        curve makes the planner cut smaller for speed, so it must be where the
        planner cuts; the tests named ``test_*time_curve*`` and ``test_rates_that_rise_*`` pin each rule. Where
        the runs' CPU seconds per element do not rise (:meth:`cpu_rates_flat`), no curve is named or counted:
        wall seconds that rise with size while the work does not are what the tasks waited for.

        Every form's constant is held at 0 or above (:meth:`_Form._without`): a
        negative one reads a block that takes no time, and a line with one fits
        rising rates about as well as a curve, while the planner plans a line
        through zero. Held, a curve has two free terms, so two clusters of sizes
        (a cold start's probes, then the rest of the map) already test it.
        """
        return self._choice().form

    def time_curve_weight(self) -> tuple[float, str | None]:
        """How much a curved time form counts in a block's seconds (0..1), and which form (None: none does).

        A curve named counts whole (shrunk towards the line, it read larger
        blocks cheaper than they ran). Where the measured rates rise but the line
        is named, the best curve still counts by its leave-one-out weight against
        the line (:func:`_loo_weight`): rising rates say the line is wrong at both
        ends, and which of two forms predicts held-out runs better is then often
        one noisy probe's say. Where the rates do not rise, a curve is all or
        nothing: its weight would be about 1/2 on noise alone.
        """
        choice = self._choice()
        return choice.weight, choice.curve

    def _choice(self) -> _TimeChoice:
        if self._memo is None:  # seconds_for asks once per candidate plan: choose once per run learned
            self._memo = self._fitted_choice()
        return self._memo

    def _fitted_choice(self) -> _TimeChoice:
        """The form the leave-one-out test of :meth:`time_form` picks, and the curve's weight
        (:meth:`time_curve_weight`)."""
        line = _TimeChoice(LINEAR, None, 0.0)
        if len(self._sizes) < 2:
            return line
        fits = {name: f.fit(self.prior_noise, 1.0, self.min_noise) for name, f in self._forms.items()}
        u0 = min(self._sizes) / MIB
        # With positive curvature the slope only grows with size: rising at the smallest block is rising everywhere.
        ok = [name for name in CURVED
              if fits[name].n >= len(_POWERS[name]) + 2 and math.isfinite(fits[name].press) and fits[name].coef[-1] > 0
              and self._forms[name].mean(1.01 * u0, fits[name]) > self._forms[name].mean(u0, fits[name])]
        best = min(ok, key=lambda name: fits[name].press) if ok else None
        if best is None or self.cpu_rates_flat():
            return line
        if self.rates_rise():
            if fits[best].press <= self.time_rising_gain * fits[LINEAR].press:
                return _TimeChoice(best, best, 1.0)
            return _TimeChoice(LINEAR, best, _loo_weight(fits[best].press, fits[LINEAR].press, fits[LINEAR].n))
        if (fits[best].press < self.superlinear_gain * fits[LINEAR].press and self.curve_supported()
                and self._rises_within(best, fits[best])):
            return _TimeChoice(best, best, 1.0)
        return line

    def _rises_within(self, name: str, fit: _Fit) -> bool:
        """Whether curve ``name`` (fitted as ``fit``) reads the largest block timed dearer per element, by more
        than ``time_curve_margin``, than the cheapest block size timed: its rise lies among the runs measured.

        A curve with a fixed cost, ``a + c u^2``, reads rates that fall to a least at ``sqrt(a / c)`` and rise
        beyond. Where that least lies at or past the largest block, the curve's whole rise is an extrapolation
        no run measured, and leave-one-out cannot test it. Over noisy runs of a fixed cost and a small cost per
        element (the workload family's ``fam_table``), a quadratic won on leave-one-out error with its least at
        0.93x the largest block. It read a block 4.2x the largest at 2.25 s, where blocks half that size later
        ran in 0.21-0.33 s (``test_a_time_curve_whose_rise_lies_beyond_every_run_measured_is_not_named``).
        """
        form = self._forms[name]
        sizes = sorted({e for e, _ in self._runs})
        rates = [form.mean(e / MIB, fit) / e for e in sizes]
        return rates[-1] > (1.0 + self.time_curve_margin) * min(rates)

    def time_fits(self, elements: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
        """Per time form: runs fitted, leave-one-out error (``press``, on relative residuals) and the compute
        seconds it predicts for blocks of ``elements`` (halo included): what :meth:`time_form` chooses between,
        for diagnosis (``python -m benchmarks.studies.time_forms --fits``). Empty before any timed run."""
        if not self._sizes:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for name, form in self._forms.items():
            fit = form.fit(self.prior_noise, 1.0, self.min_noise)
            out[name] = {"n": int(fit.n), "press": float(fit.press),
                         "seconds": [float(form.mean(int(e) / MIB, fit)) for e in elements]}
        return out

    def curve_supported(self) -> bool:
        """Whether the runs measured support a curved time form: no gap between consecutive sizes wider than
        ``time_gap_ratio`` (so leave-one-out tested the curve where the planner will use it), or seconds per
        element that rise with size by more than ``time_curve_margin`` (:meth:`rates_rise`).

        A curve through two clusters of sizes is free in the gap between them,
        where the next plan cuts, and leave-one-out does not see it: each wave runs
        one chunk per slot at one size, and the twin of a chunk left out stays in
        the fit. A cold start's waves step 3.3-3.9x in size, so they alone never
        stand a curve at the default 3x
        (``test_a_cold_start_s_waves_alone_do_not_stand_a_time_curve_on_leave_one_out``).
        """
        sizes = sorted({e for e, _ in self._runs})
        if len(sizes) >= 2 and all(b <= self.time_gap_ratio * a for a, b in zip(sizes, sizes[1:])):
            return True
        return self.rates_rise()

    def rates_rise(self) -> bool:
        """True when :meth:`rate_ratio` is above ``1 + time_curve_margin``."""
        ratio = self.rate_ratio()
        return ratio is not None and ratio > 1.0 + self.time_curve_margin

    def _work_seconds(self, obs: Observation) -> float | None:
        """The CPU seconds of ``obs`` that :meth:`cpu_rate_ratio` counts: its thread's CPU time
        (``Observation.cpu_seconds``), less the kernel time a first touch's growth cost, as its compute seconds
        leave it out (:meth:`compute_seconds`); None where unknown or 0, and for a run of a map on a GPU
        (``gpu_budget_bytes`` set), whose work is the device's, not its thread's."""
        if obs.cpu_seconds is None or obs.gpu_budget_bytes is not None:
            return None
        cpu = float(obs.cpu_seconds)
        if self.first_touch(obs) and obs.sys_seconds is not None:
            cpu -= float(obs.sys_seconds)
        return cpu if cpu > 0 else None

    def cpu_rate_ratio(self) -> float | None:
        """:meth:`rate_ratio` of the same runs' CPU seconds (``Observation.cpu_seconds``, the calling thread's user
        and kernel time; runs without it left out): how the work done grows with the block, without what the
        task waited for."""
        return _rate_ratio(self._cpu_runs, self.min_size_ratio)

    def cpu_rates_flat(self) -> bool:
        """True when the runs' CPU seconds per element (:meth:`cpu_rate_ratio`) rise with size by no more than
        ``time_curve_margin``: their work grows no faster than their blocks, and no time curve is named or counted
        (:meth:`time_curve_weight`), whatever the wall seconds say.

        A task's wall seconds hold what it waited for beside its work: another thread holding the interpreter,
        the cores shared with other workers. Where that is most of them (small blocks on few cores), its noise
        draws curves through the probes of operators whose work is linear, and a block beyond them reads far
        dearer than it runs (the models explanation's "Time" has the measurements;
        ``test_a_time_curve_needs_the_runs_cpu_seconds_to_rise_with_size_too``). False where fewer than two sizes
        ``min_size_ratio`` apart have CPU seconds (records older than the monitor's CPU time; runs on a GPU count
        none). The calling thread's CPU time leaves out threads the operator hands work to: where an operator's
        work runs in a pool of its own, its CPU rates read flat and a curve its work has is not named."""
        ratio = self.cpu_rate_ratio()
        return ratio is not None and ratio <= 1.0 + self.time_curve_margin

    def rates_fall(self) -> bool:
        """True when :meth:`rate_ratio` is below ``1 / (1 + time_curve_margin)``: the largest blocks cost less per
        element than the smallest, by as much as :meth:`rates_rise` asks of a rise."""
        ratio = self.rate_ratio()
        return ratio is not None and ratio * (1.0 + self.time_curve_margin) < 1.0

    def falling_seconds(self, elements: int, window: int | None = None) -> float | None:
        """Compute seconds of a block of ``elements`` (halo included) from the smallest and largest blocks timed,
        for rates that fall with size (:meth:`rates_fall`). None before two sizes ``min_size_ratio`` apart.

        Each end's rate is the median (the upper middle value for an even count, as :meth:`seconds_per_element`)
        of its latest ``window`` runs (default ``time_window``) within ``min_size_ratio`` of its size. A block
        between the ends takes the seconds on the line through them: a fixed cost per block and a cost per
        element. A block beyond the largest takes the largest blocks' seconds and, for each element more, the
        cost per element measured into the largest blocks (:meth:`robust_slope`; the line's where no two runs
        lie far enough apart), at most the large blocks' rate: the fixed cost is paid once, not again in
        proportion. Scaled at the large blocks' rate instead, the workload family's ``fam_table`` (a lookup
        table built per call) read a split-on-failure flow's whole-survey chunk, 4.2x its largest probe, at
        1.19 s, where first calls of half that size ran in 0.21-0.33 s
        (``test_a_time_curve_whose_rise_lies_beyond_every_run_measured_is_not_named``), and the simulator
        predicted such flows up to 85% long. Below the smallest block timed the line goes on (never below the
        small blocks' rate times the block, where noise in the ends' medians gives the line a negative fixed
        cost): the fixed cost that made the small blocks slower per element does not shrink with the block.
        Scaled down at the small blocks' rate instead, a static-32 plan's 60,000-element blocks of the workload
        family's ``fam_first_use`` read 0.011 s, an eighth of the 0.087 s its
        1,000,000-element blocks took, though each block pays the same fixed cost, and the simulator predicted the
        plan 29% short. Where the smallest end took longer than the largest (a larger block is never faster, so
        one end is noise), the smallest end takes the largest's seconds: the longer runs carry less of a task's
        scheduling noise, and they are the end a plan of larger chunks extrapolates from. So a larger block never
        reads faster and the line's rate only falls with size: between two plans, the one of fewer, larger chunks
        reads no costlier per element, whatever the noise of sizes between the ends.

        A cold start's probes are small and pay each task's fixed costs over few elements; a warm run's chunks
        are 10-20x larger. Over the runs of both, the median rate is the probes' and read the warm chunks 3.7-9x
        slower than they ran on the workload family's two table operators (one of them pinned by
        ``test_rates_that_fall_with_size_plan_a_block_on_the_line_between_the_smallest_and_largest_blocks``).
        """
        runs = list(self._runs)
        if not runs or elements <= 0:
            return None
        lo, hi = min(e for e, _ in runs), max(e for e, _ in runs)
        if hi < self.min_size_ratio * lo:
            return None
        window = max(1, int(self.time_window if window is None else window))
        small = sorted([s / e for e, s in runs if e <= self.min_size_ratio * lo][-window:])
        large = sorted([s / e for e, s in runs if e * self.min_size_ratio >= hi][-window:])
        at_hi = large[len(large) // 2] * hi
        at_lo = min(small[len(small) // 2] * lo, at_hi)
        e = int(elements)
        if e >= hi:
            slope = self.robust_slope(window)
            if slope is None:  # no pair that far apart among the latest runs: the line through the ends
                slope = (at_hi - at_lo) / (hi - lo)
            return at_hi + min(slope, at_hi / hi) * (e - hi)
        line = at_lo + (at_hi - at_lo) * (e - lo) / (hi - lo)
        return line if e >= lo else max(line, at_lo * e / lo)

    def robust_slope(self, window: int | None = None) -> float | None:
        """Compute seconds per element one block costs more than another, measured into the largest blocks: the
        median, over every pair of a run of the largest blocks (within ``min_size_ratio`` of the largest size) and
        a run ``min_size_ratio`` times smaller or more (the latest ``window`` runs of each, default
        ``time_window``), of the pair's difference in seconds over its difference in elements (a Theil-Sen slope),
        at least 0. None before such a pair.

        The slope of ``seconds = fixed + slope x elements`` that a slow run or two cannot move far: runs of one
        size stray by 2-5x on a busy machine (a worker's kernel time to fault in memory lands on some and not on
        others), and each run is one of many pairs. Measured into the largest blocks, since it prices the
        elements of a block beyond them (:meth:`falling_seconds`)."""
        window = max(1, int(self.time_window if window is None else window))
        if window not in self._slopes:  # asked once per candidate plan: once per run learned
            runs = list(self._runs)
            hi = max((e for e, _ in runs), default=0)
            large = [(e, s) for e, s in runs if e * self.min_size_ratio >= hi][-window:]
            below = [(e, s) for e, s in runs if e * self.min_size_ratio <= hi][-window:]
            slopes = sorted((sl - so) / (el - eo) for el, sl in large for eo, so in below
                            if el >= self.min_size_ratio * eo and el > eo)
            self._slopes[window] = max(0.0, slopes[len(slopes) // 2]) if slopes else None
        return self._slopes[window]

    def rising_floor(self, elements: int) -> float | None:
        """The fewest compute seconds a block of ``elements`` (halo included) may read where the measured rates
        rise with size (:meth:`rates_rise`): at or beyond the largest blocks timed (within ``min_size_ratio``
        of the largest size), their median rate x ``elements``; between the smallest and the largest, the
        smallest blocks' median rate x ``elements`` (a line through the two ends would lie above a convex curve
        between them); none below the smallest. Each median is the lower middle value of the latest
        ``time_window`` runs (a floor takes the lower of two). None where the rates do not rise.

        A larger block never reads cheaper per element than the blocks measured below its size, whatever the
        fitted forms say. Over runs bunched at a few sizes, the line fitted beside a curve took a large constant
        and read a 1.9 M-element block of the workload family's ``fam_gram`` (compute quadratic in its traces)
        at 0.32 s where its measured blocks of 0.46-0.63 M ran at 0.36 us per element and it took 0.82 s; the
        warm plan cut its map in 2 chunks where 8 had run 1.4x faster
        (``test_rates_that_rise_with_size_never_read_a_larger_block_cheaper_per_element``).
        """
        if not self.rates_rise():
            return None
        if self._floor_memo is None:
            runs = list(self._runs)[-max(1, int(self.time_window)):]
            lo, hi = min(e for e, _ in runs), max(e for e, _ in runs)
            small = sorted(s / e for e, s in runs if e <= self.min_size_ratio * lo)
            large = sorted(s / e for e, s in runs if e * self.min_size_ratio >= hi)
            self._floor_memo = (lo, hi, small[(len(small) - 1) // 2], large[(len(large) - 1) // 2])
        lo, hi, small_rate, large_rate = self._floor_memo
        e = int(elements)
        if e <= lo:
            return None
        return e * (large_rate if e >= hi else small_rate)

    def rate_ratio(self) -> float | None:
        """The median measured seconds per element of the largest blocks (within ``min_size_ratio`` of the
        largest size) over the smallest blocks'; None before two sizes that far apart were timed. Above 1:
        larger blocks cost more per element; below: per-task costs weigh on small blocks."""
        return _rate_ratio(self._runs, self.min_size_ratio)

    def seconds_for(self, elements: int) -> float | None:
        """Compute seconds for a block of ``elements`` (halo included) where time is not proportional to its size.

        Where a curve counts (time grows faster than size), its fitted seconds;
        where it counts only in part (:meth:`time_curve_weight`), the rest is the
        fitted line held at no constant it was weighed against; never below
        :meth:`rising_floor` where the measured rates rise. Where no curve
        counts and the rates fall with size (:meth:`rates_fall`), the line between
        the smallest and the largest blocks timed (:meth:`falling_seconds`). Beyond
        the largest block a later call timed, never above what first calls of larger
        blocks bound it at (:meth:`first_call_ceiling`), where the median rate x
        ``elements`` would exceed that too. None otherwise: time is proportional to
        size and the planner uses :meth:`seconds_per_element`.
        """
        elements = int(elements)
        seconds = self._fitted_seconds(elements)
        ceiling = self.first_call_ceiling(elements)
        if ceiling is None:
            return seconds
        if seconds is None:
            rate = self.seconds_per_element()
            if rate is None or rate * elements <= ceiling:
                return None
            return ceiling
        return min(seconds, ceiling)

    def _fitted_seconds(self, elements: int) -> float | None:
        """:meth:`seconds_for` from the later calls alone, before :meth:`first_call_ceiling`."""
        weight, curve = self.time_curve_weight()
        if curve is None or weight <= 0.0:
            if elements not in self._falling:  # asked once per candidate plan
                self._falling[elements] = self.falling_seconds(elements) if self.rates_fall() else None
            return self._falling[elements]
        u = elements / MIB
        seconds = max(0.0, self._mean(curve, u))
        if weight < 1.0:
            seconds = weight * seconds + (1.0 - weight) * max(0.0, self._mean(LINEAR, u))
        floor = self.rising_floor(elements)
        return seconds if floor is None else max(seconds, floor)

    def _fitted_block_seconds(self, elements: int) -> float | None:
        """A block's compute seconds from the later calls alone (:meth:`_fitted_seconds`, else the median rate)."""
        seconds = self._fitted_seconds(elements)
        if seconds is not None:
            return seconds
        rate = self.seconds_per_element()
        return None if rate is None else rate * elements

    def first_call_ceiling(self, elements: int) -> float | None:
        """The most compute seconds a later call of a block of ``elements`` (halo included) takes, where it is
        larger than any block a later call timed and first calls timed larger blocks than those; None elsewhere.

        A worker's first call of a block pays its one-off cost and the block's compute, so a later call of a
        block no larger takes no longer. Each of the latest ``time_window`` first calls
        larger than every later call bounds a block up to its own size at its seconds (:meth:`compute_seconds`),
        and a larger block at its seconds scaled by the later calls' model's growth from its size; the bound is
        the median (the upper middle value) of theirs, never below the model at the largest later call (a larger
        block never reads faster). Among the sizes later calls timed, they are the evidence, and a first call
        run beside another task's (threads sharing cores) may have been the faster.

        A cold start whose large probes were all first calls learns its rates from its small blocks alone, which
        pay each task's fixed costs over few elements. The workload family's ``fam_autocorr`` (seed 1) then read
        a block of 1.28 M elements at 2.2 s and one of 0.6 M at 1.05 s, where the first calls of 0.6 M, one-off
        cost included, took 0.2-0.26 s of compute; a split-on-failure flow's whole-survey chunk ran in 1.7 s,
        both operators together, and was predicted at 3.5 s
        (``test_a_first_call_bounds_what_a_later_call_of_a_larger_block_than_any_timed_takes``).
        """
        e = int(elements)
        if not self._first_calls or not self._runs or e <= 0:
            return None
        if e not in self._ceilings:  # asked once per candidate plan
            self._ceilings[e] = self._ceiling(e, max(1, int(self.time_window)))
        return self._ceilings[e]

    def _ceiling(self, e: int, window: int) -> float | None:
        hi = max(size for size, _ in self._runs)
        beyond = [(size, seconds) for size, seconds in list(self._first_calls)[-window:] if size > hi]
        if e <= hi or not beyond:
            return None
        at_e, at_hi = self._fitted_block_seconds(e), self._fitted_block_seconds(hi)
        bounds = []
        for size, seconds in beyond:
            at_size = self._fitted_block_seconds(size)
            if e <= size:
                bounds.append(seconds)
            else:  # by the model's growth from the first call's size (by the size, where it reads none)
                bounds.append(seconds * (at_e / at_size if at_e and at_size else e / size))
        bounds.sort()
        return max(bounds[len(bounds) // 2], at_hi or 0.0)

    def _mean(self, form: str, u: float) -> float:
        """The fitted compute seconds of time form ``form`` for a block of ``u`` Mi-elements."""
        f = self._forms[form]
        return f.mean(u, f.fit(self.prior_noise, 1.0, self.min_noise))

    def summary(self) -> dict[str, Any]:
        """Plain figures for reports: seconds per element, the form and the curve counted (and how much), the
        rate ratio, runs learned and set aside, a first call's extra seconds, how far runs strayed from the model
        (:meth:`time_spread`), and the kernel seconds per GiB a worker's growth cost."""
        weight, curve = self.time_curve_weight()
        spb = self.touch_seconds_per_byte()
        return {
            "seconds_per_element": self.seconds_per_element(),
            "time_form": self.time_form(),
            "time_curve": curve,  # the curve counted in a block's seconds, if any
            "time_curve_weight": weight,  # how much (0..1; the fitted line, the rest)
            "time_rate_ratio": self.rate_ratio(),  # seconds per element, largest blocks over smallest
            "time_runs": len(self._rates),  # ok runs time is learned from (the latest RATE_HISTORY)
            "first_touch_runs": len(self._first_touch_rates),  # ok runs set aside: they grew their worker
            "first_call_runs": len(self._first_calls),  # ok runs set aside: a worker's first call of the operator
            "first_call_seconds": self.first_call_seconds(),  # what such a call took beyond a later one, seconds
            "time_spread": self.time_spread(),  # how far runs stray from the model: a log-normal's sigma
            "touch_seconds_per_gib": None if spb is None else spb * 2**30,  # kernel seconds per GiB grown
        }
