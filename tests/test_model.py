"""The memory model as a specification: synthetic observation streams in, predictions out."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest

from benchmarks.quality import repeatability
from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.learn.bank import ModelBank
from memchunk_prefect.learn.forms import MIB, _Form, _loo_weight
from memchunk_prefect.learn.operator import OperatorModel
from memchunk_prefect.learn.store import Store
from memchunk_prefect.learn.time import TimeModel

KEY = "op|float32|cpu"
SIZES = [(i, x, t) for i in (8, 16, 24, 32, 48) for x in (16, 32, 64) for t in (100, 200, 400)]


def linear(e):
    return 70 * MIB + 28 * e  # envelope-like: fixed ~70 MiB + 7x float32


def gst(e):
    return 5 * MIB + 240 * e  # GST3D-like: ~60x float32


def test_a_flow_runs_offset_is_the_median_miss_of_its_own_blocks_and_needs_two_of_them():
    """Two flow runs of the same block sizes, the second's blocks 1.3x the first's: each run's offset is the median
    ``ln(seconds / model)`` over its own blocks, so the two lie ln 1.3 apart; a run with one timed block, first
    calls, and rows written outside a flow run (no id) give none."""
    t = TimeModel()
    for flow, factor in (("a", 1.0), ("b", 1.3), ("", 2.0)):
        for n in (100_000, 200_000, 400_000):
            t.learn(Observation(KEY, n, (1, 1, n), 4 * n, MIB, seconds=1e-6 * n * factor, flow_run_id=flow))
    t.learn(Observation(KEY, 100_000, (1, 1, 100_000), 400_000, MIB, seconds=0.1, flow_run_id="c"))
    for _ in range(3):
        t.learn(Observation(KEY, 100_000, (1, 1, 100_000), 400_000, MIB, seconds=5.0, flow_run_id="d",
                            first_call=True))
    offsets = t.run_offsets()
    assert set(offsets) == {"a", "b"}
    assert offsets["b"] - offsets["a"] == pytest.approx(math.log(1.3))


def test_how_far_whole_flow_runs_stray_is_learned_from_pairs_of_runs_less_their_blocks_own_scatter():
    """Two operators, four flow runs each, every run's blocks off by one factor of the run (sigma 0.25) and by a
    factor of their own (sigma 0.3): the run spread learned is the run's 0.25, within what 12 pairs can tell, with
    12 blocks a run or 2 (the median over 15 such stores). Blocks that stray on their own in runs that do not give a spread near 0: the scatter a
    median of few blocks carries into its run's offset is taken off. Fewer than MIN_RUN_PAIRS pairs, pooled over
    the operators, say nothing."""
    from memchunk_prefect.learn.bank import MIN_RUN_PAIRS

    def bank(run_sigma, rng, blocks=12):
        b = ModelBank(None)
        for key in ("op-a|float32|cpu", "op-b|float32|cpu"):
            for flow in range(4):
                shared = math.exp(rng.gauss(0.0, run_sigma))
                for i in range(blocks):
                    n = (100_000, 200_000, 400_000)[i % 3]
                    b.learn(Observation(key, n, (1, 1, n), 4 * n, MIB, flow_run_id=f"run-{flow}",
                                        seconds=1e-6 * n * shared * math.exp(rng.gauss(0.0, 0.3))))
        return b

    for blocks in (12, 2):  # without the blocks' share taken off, runs of 2 that do not stray read about 0.23
        spreads = [bank(0.25, random.Random(seed), blocks).run_spread() for seed in range(15)]
        assert statistics.median(spreads) == pytest.approx(0.25, rel=0.3), (blocks, spreads)
        still = [bank(0.0, random.Random(seed), blocks).run_spread() for seed in range(15)]
        assert statistics.median(still) < 0.1, (blocks, still)
    pooled = ModelBank(None)
    for key in ("op-a|float32|cpu", "op-b|float32|cpu", "op-c|float32|cpu"):  # one pair of runs each
        assert (pooled.run_spread() is None) == (len(pooled.run_pairs()) < MIN_RUN_PAIRS)
        for flow in range(2):
            for n in (100_000, 200_000):
                pooled.learn(Observation(key, n, (1, 1, n), 4 * n, MIB, seconds=1e-6 * n * (1 + flow / 5),
                                         flow_run_id=f"run-{flow}"))
    assert len(pooled.run_pairs()) == MIN_RUN_PAIRS and pooled.run_spread() is not None


def superlinear(e):
    return 20 * MIB + 8 * e + 0.02 * e**1.5


def quadratic_in_traces(e):
    return 5 * MIB + 8 * e + 2e-5 * e**2  # e.g. all pairs of traces in a block of whole traces


def obs(extents, peak, *, outcome="ok", censored=False, key=KEY):
    e = extents[0] * extents[1] * extents[2]
    return Observation(key, e, extents, 4 * e, int(peak), outcome=outcome, censored=censored)


def timed(rows, key=KEY, **options):
    """A model taught a store's timed rows: (elements, extents, wall s, kernel s, bytes grown, peak bytes[, first
    call])."""
    m = OperatorModel(key, **options)
    for e, ext, secs, sys_secs, grew, peak, *first in rows:
        m.learn(Observation(key, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew,
                            first_call=first[0] if first else None))
    return m


def elements(ext):
    return ext[0] * ext[1] * ext[2]


def stream(truth, n, seed=0, noise=0.03, sizes=SIZES):
    rng = random.Random(seed)
    for _ in range(n):
        ext = rng.choice(sizes)
        yield obs(ext, truth(elements(ext)) * (1 + rng.gauss(0, noise)))


def trained(truth, n=12, seed=0, noise=0.03, sizes=SIZES):
    m = OperatorModel(KEY)
    for o in stream(truth, n, seed, noise, sizes):
        m.learn(o)
    return m


@pytest.mark.parametrize("n, ready", [(0, False), (1, False), (2, False), (3, True), (10, True)])
def test_ready_only_with_enough_observations(n, ready):
    m = OperatorModel(KEY)
    for ext in [(8, 16, 100), (16, 16, 100), (32, 16, 100), (48, 64, 400)] * 3:
        if m.n_observations >= n:
            break
        m.learn(obs(ext, linear(elements(ext))))
    p = m.predict((16, 16, 200))
    assert isinstance(p, Prediction)
    assert p.ready is ready and p.n_observations == n
    if not ready:
        assert "needed before planning" in p.reason


def test_one_size_only_is_not_ready_and_says_why():
    m = OperatorModel(KEY)
    for _ in range(5):
        m.learn(obs((16, 16, 100), linear(16 * 16 * 100)))
    p = m.predict((32, 32, 100))
    assert not p.ready and "one block size" in p.reason


@pytest.mark.parametrize("truth", [linear, gst, superlinear, quadratic_in_traces],
                         ids=["linear", "gst", "superlinear", "quadratic"])
def test_goal_figures_after_a_few_observations(truth):
    """The issue's goals, over 10 streams x every size: MAPE <= 10 %, coverage >= 95 %, bound within 25 %."""
    errors, covered, ratios = [], [], []
    for seed in range(10):
        m = trained(truth, n=8, seed=seed)
        for ext in SIZES:
            p, true = m.predict(ext), truth(elements(ext))
            assert p.ready
            errors.append(abs(p.mean_bytes / true - 1))
            covered.append(true <= p.upper_bytes)
            ratios.append(p.upper_bytes / true)
    assert sum(errors) / len(errors) <= 0.10
    assert sum(covered) / len(covered) >= 0.95
    assert sum(ratios) / len(ratios) <= 1.25


@pytest.mark.parametrize("truth, forms", [
    (superlinear, ("superlinear", "quadratic")),
    (quadratic_in_traces, ("quadratic", "superlinear")),
    (gst, ("linear",)),
])
def test_the_form_follows_the_operator(truth, forms):
    chosen = [trained(truth, n=30, seed=seed).form() for seed in range(5)]
    assert sum(c in forms for c in chosen) >= 4, chosen


# Not the quadratic operator: its curvature is 7 % of the peak over these sizes (hidden in 3 % noise) and
# 44 % at 4x; no fit can see it. There the first out-of-memory record raises the bound (censored tests).
@pytest.mark.parametrize("truth", [linear, gst, superlinear], ids=["linear", "gst", "superlinear"])
def test_extrapolation_to_4x_the_largest_seen_chunk_stays_bounded(truth):
    small = [s for s in SIZES if elements(s) <= 24 * 32 * 200]
    largest = max(elements(s) for s in small)
    true = truth(4 * largest)
    covered, ratios = [], []
    for seed in range(10):
        p = trained(truth, n=20, sizes=small, seed=seed).predict((1, 1, 4 * largest))
        covered.append(p.upper_bytes >= true)
        ratios.append(p.upper_bytes / true)
    # A curve hidden in 3 % noise over the seen sizes cannot always be told from a line: the bound
    # covers most streams and is never far below the truth; and it stays useful (not 10x too high).
    # (Typically within 1.5x; the widest of these streams ~1.7x, where the noise leaves the curvature open:
    # over 100 streams of the linear truth the median is 1.3x and the 90th percentile 2.0x. The bound was
    # within 1.5x under the old prior, whose strength depended on the unit and was strong at these sizes.)
    assert sum(covered) >= 8, f"the bound must cover a chunk 4x larger than any seen: {ratios}"
    assert min(ratios) >= 0.9, f"and never fall far below it: {ratios}"
    assert sorted(ratios)[len(ratios) // 2] <= 1.5 and max(ratios) <= 2.0, f"and stay useful: {ratios}"


def test_summary_reports_fixed_overhead_and_bytes_per_element():
    m = trained(gst, n=30, noise=0.01)
    s = m.summary()
    assert s["n_observations"] == 30
    assert s["bytes_per_element"] == pytest.approx(240, rel=0.05)
    assert s["fixed_overhead_bytes"] == pytest.approx(5 * MIB, rel=0.2)
    assert 0 <= s["recent_mape"] < 0.05
    assert s["coverage"] >= 0.8
    assert s["form"] == "linear"


def test_one_100x_outlier_is_quarantined_and_predictions_stay_true():
    m = trained(linear, n=8)
    ext = (32, 32, 200)
    assert m.learn(obs(ext, 100 * linear(elements(ext)))) == "quarantined"
    for o in stream(linear, 4, seed=7):
        assert m.learn(o) == "learned"
    p = m.predict((48, 64, 400))
    assert abs(p.mean_bytes / linear(48 * 64 * 400) - 1) < 0.10
    assert m.summary()["n_quarantined"] == 1


def test_a_repeated_large_change_is_accepted():
    m = trained(linear, n=8)
    assert m.learn(obs((32, 32, 200), 10 * linear(32 * 32 * 200))) == "quarantined"
    assert m.learn(obs((16, 32, 200), 10 * linear(16 * 32 * 200))) == "accepted"
    assert m.n_observations == 10


def test_censored_observation_raises_the_bound_above_what_was_needed():
    m = trained(linear, n=8, sizes=[s for s in SIZES if elements(s) <= 16 * 32 * 200])
    big = (48, 64, 400)
    before = m.predict(big)
    # It actually ran out of memory at 2x what the model expected.
    needed = 2 * before.upper_bytes
    assert m.learn(obs(big, needed, outcome="memory_error", censored=True)) == "censored"
    after = m.predict(big)
    assert after.upper_bytes > needed
    # Half the failed size is raised too (the policy's split must not fail again) ...
    half = m.predict((24, 64, 400))
    assert half.upper_bytes > 1.5 * before.upper_bytes * 0.5
    # ... while small chunks far below it keep their fit.
    small = (8, 16, 100)
    assert m.predict(small).upper_bytes == pytest.approx(before_small(m, small), rel=1e-9)
    assert "out-of-memory" in after.reason


def before_small(m, ext):
    # the uncensored bound, recomputed from the fit directly
    return m.memory._predict_u(elements(ext) / MIB, apply_censored=False).upper_bytes


def test_censored_is_not_fitted_as_a_point():
    m = trained(linear, n=8)
    n = m.n_observations
    m.learn(obs((48, 64, 400), 10 * linear(48 * 64 * 400), outcome="killed", censored=True))
    assert m.n_observations == n
    assert m.predict((8, 16, 100)).mean_bytes == pytest.approx(linear(8 * 16 * 100), rel=0.1)


def test_censored_point_contradicted_by_a_larger_ok_run_is_dropped():
    m = trained(linear, n=8, sizes=[s for s in SIZES if math.prod(s) < 16 * 32 * 200])
    m.learn(obs((16, 32, 200), 5 * linear(16 * 32 * 200), outcome="killed", censored=True))
    assert m.predict((16, 32, 200)).upper_bytes > 4 * linear(16 * 32 * 200)
    m.learn(obs((32, 32, 200), linear(32 * 32 * 200)))
    assert m.predict((16, 32, 200)).upper_bytes < 1.25 * linear(16 * 32 * 200)


def test_a_kill_at_a_size_that_already_ran_needing_less_does_not_floor_that_size_for_good():
    """A worker killed under a block of a size that had already run, at least as large, needing less died of
    something else (another thread's first use of a library, what a co-tenant held). On the validation's w2 at 4x,
    such a record (306 MiB at 62,400 elements, where 170 runs up to that size peaked at 125 MiB or less) floored
    every larger block at 643 MiB: no plan ran that size again to drop it, and the warm maps ran 359 and 565
    chunks where the cold one ran 173. A kill no ok run contradicts still floors the block."""
    m = trained(linear, n=8, sizes=[s for s in SIZES if math.prod(s) <= 16 * 32 * 200])
    assert m.learn(obs((16, 32, 200), 5 * linear(16 * 32 * 200), outcome="killed", censored=True)) == "censored"
    assert m.predict((16, 32, 200)).upper_bytes < 1.25 * linear(16 * 32 * 200)
    assert m.summary()["n_censored"] == 1  # still counted
    fresh = trained(linear, n=8, sizes=[s for s in SIZES if math.prod(s) < 16 * 32 * 200])
    fresh.learn(obs((16, 32, 200), 5 * linear(16 * 32 * 200), outcome="killed", censored=True))
    assert fresh.predict((16, 32, 200)).upper_bytes > 4 * linear(16 * 32 * 200)


def test_errors_and_empty_peaks_are_ignored():
    m = OperatorModel(KEY)
    assert m.learn(obs((8, 8, 8), 100, outcome="error")) == "ignored"
    assert m.learn(obs((8, 8, 8), 0)) == "ignored"
    assert m.n_observations == 0


def test_cold_model_guesses_the_block_itself_and_is_not_ready():
    p = OperatorModel(KEY).predict((10, 10, 10), itemsize=4)
    assert not p.ready and p.mean_bytes == 4000


@pytest.mark.parametrize("kwargs", [{"confidence": 1.2}, {"min_observations": 1}, {"outlier_ratio": 1.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        OperatorModel(KEY, **kwargs)


def test_unknown_settings_are_refused_by_name_and_shared_ones_reach_every_model_that_takes_them():
    with pytest.raises(TypeError, match="min_sise_ratio"):
        OperatorModel(KEY, min_sise_ratio=2.0)
    m = OperatorModel(KEY, min_size_ratio=2.0, first_touch_bytes=2**20, metric_window=5, time_window=7, energy_window=3)
    assert m.memory.min_size_ratio == m.time.min_size_ratio == 2.0
    assert m.memory.first_touch_bytes == m.time.first_touch_bytes == 2**20
    assert m.memory.metric_window == m.energy.metric_window == 5
    assert m.time.time_window == 7 and m.energy.energy_window == 3


def test_the_windows_a_plan_reads_rates_over_are_the_models_own():
    """The median of seconds (and joules) per element a plan reads is over the model's time_window (energy_window)
    latest runs: one home for each, set through the bank's model options."""
    from memchunk_prefect.core.settings import DEFAULT_SETTINGS
    from memchunk_prefect.learn.bank import BankKnowledge

    def bank(**options):
        b = ModelBank(None, **options)
        for i, seconds in enumerate((1.0, 2.0, 9.0)):
            b.learn(Observation(KEY, 1000, (1, 10, 100), 4000, 2**20, seconds=seconds, created_at=10.0 * i,
                                energy_joules=seconds, energy_source="estimate"))
        return BankKnowledge(b, KEY, DEFAULT_SETTINGS)

    median, latest = bank(), bank(time_window=1, energy_window=1)
    assert median.seconds_per_element() == pytest.approx(2.0 / 1000) and median.joules_for(1000) == pytest.approx(2.0)
    assert latest.seconds_per_element() == pytest.approx(9.0 / 1000) and latest.joules_for(1000) == pytest.approx(9.0)


def test_wrong_key_is_refused():
    with pytest.raises(ValueError, match="other"):
        OperatorModel(KEY).learn(obs((8, 8, 8), 100, key="other"))


def test_bank_replays_the_store_and_persists_what_it_learns(tmp_path):
    path = tmp_path / "obs.sqlite"
    with Store(path) as store:
        bank = ModelBank(store)
        for o in stream(linear, 10):
            bank.learn(o)
        p1 = bank.predict(KEY, (32, 32, 200))
    with Store(path) as store:
        bank2 = ModelBank(store)
        p2 = bank2.predict(KEY, (32, 32, 200))
        assert p2 == p1  # same rows, same order, same model
        assert bank2.keys() == [KEY]
        assert bank2.model("unknown|float32|cpu").n_observations == 0


#: trace_correlation's first touches on 192 x 192 x 100 (heterogeneous benchmark at 4222c16, a warm night's first
#: flow run): elements, wall and kernel seconds, bytes the run grew its worker, peak. Two probes, two large blocks
#: on fresh workers, then the same blocks again below the marks they set (grew < 1 MiB: no first touch).
TOUCH_ROWS = [(232_800, 0.109, 0.023919, 32_354_304, 48_324_608), (232_800, 0.109, 0.014658, 17_317_888, 48_898_048),
              (834_200, 1.364, 0.699982, 526_090_240, 571_367_424), (834_200, 1.503, 0.767752, 526_360_576, 571_805_696),
              (834_200, 0.746, 0.105368, 499_712, 566_726_656), (834_200, 0.753, 0.145298, 933_888, 567_091_200)]


def _touch_obs(key, e, secs, sys_secs, grew, peak):
    return Observation(key, e, (1, 1, e), 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew)


def test_what_growing_a_worker_costs_is_learned_from_the_first_touches_weighted_by_the_bytes_they_grew(tmp_path):
    m = OperatorModel(KEY)
    assert m.touch_seconds_per_byte() is None
    for row in TOUCH_ROWS:
        m.learn(_touch_obs(KEY, *row))
    # The runs below their marks paid 0.105 and 0.145 s of kernel time for 834,200 elements (the median taken:
    # the upper of two, 0.174 us per element); what the first touches paid beyond that at their size is the
    # growth's: nothing of the probes' 0.015-0.024 s (0.04 s expected at 232,800 elements), 0.555 and 0.623 s of
    # the large blocks' 0.700 and 0.768 s; over the 1,102 MB all four grew, summed: 1.15 s/GiB.
    assert m.resting_sys_per_element() == pytest.approx(0.145298 / 834_200)
    assert m.touch_seconds_per_byte() * 2**30 == pytest.approx(1.147, abs=0.005)
    assert m.summary()["touch_seconds_per_gib"] == pytest.approx(1.147, abs=0.005)
    assert m.touch_costs()[1] == sum(r[3] for r in TOUCH_ROWS[:4])
    assert m.growth_kernel_seconds(0.699982, 834_200) == pytest.approx(0.699982 - 0.145298)
    # A bank: an operator whose own runs grew little takes the machine's figure, pooled over what it has loaded.
    with Store(tmp_path / "obs.sqlite") as store:
        bank = ModelBank(store)
        other = "envelope|float32|cpu"
        assert bank.touch_seconds_per_byte(other) is None
        for row in TOUCH_ROWS:
            bank.learn(_touch_obs(KEY, *row))
        bank.learn(_touch_obs(other, 240_000, 0.08, 0.01, 20 * MIB, 21 * MIB))
        # envelope's one run grew 20 MiB for 0.01 s (nothing known of what it pays below the mark: all of it).
        pooled = (m.touch_costs()[0] + 0.01) / (m.touch_costs()[1] + 20 * MIB)
        assert bank.touch_seconds_per_byte(other) == pytest.approx(pooled)
        assert bank.touch_seconds_per_byte(KEY) == pytest.approx(m.touch_seconds_per_byte())


def test_bank_refresh_sees_rows_written_by_another_process(tmp_path):
    path = tmp_path / "obs.sqlite"
    with Store(path) as mine, Store(path) as theirs:
        bank = ModelBank(mine)
        assert bank.model(KEY).n_observations == 0
        theirs.add_many(list(stream(linear, 5)))
        bank.refresh()
        assert bank.model(KEY).n_observations == 5
        bank.learn(obs((8, 16, 100), linear(8 * 16 * 100)))
        assert bank.model(KEY).n_observations == 6
        assert mine.count(KEY) == 6


def test_predict_is_fast_enough_for_the_planner():
    import time

    m = trained(gst, n=50)
    t0 = time.perf_counter()
    for i in range(2000):
        m.predict((1 + i, 64, 400))
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("outcome, censored, result", [
    ("memory_error", True, "censored"),
    ("killed", True, "censored"),
    ("killed", False, "ignored"),  # killed for something else: nothing about memory
    ("error", False, "ignored"),
])
def test_outcomes(outcome, censored, result):
    m = trained(linear, n=5)
    assert m.learn(obs((16, 16, 100), 10 * MIB, outcome=outcome, censored=censored)) == result


# --------------------------------------------------------------------------- the learned margin


def test_the_conformal_margin_is_the_quantile_of_what_runs_needed_over_what_was_predicted():
    rng = random.Random(7)
    m = OperatorModel(KEY)
    assert m.conformal_factor() is None
    for k in range(60):
        ext = SIZES[k % len(SIZES)]
        m.learn(obs(ext, gst(elements(ext)) * rng.uniform(0.9, 1.15)))
    q = m.conformal_factor()
    ratios = sorted(m.memory._ratios)
    assert q == ratios[math.ceil((len(ratios) + 1) * 0.95) - 1]
    assert 1.0 < q < 1.2, "runs up to 15% over a mean near the middle: the factor lands in between"
    p = m.predict((64, 64, 400))
    assert p.upper_bytes >= q * p.mean_bytes * 0.999
    assert m.summary()["margin"] == q


def test_on_a_worker_of_two_threads_the_runs_that_had_it_alone_are_learned_and_overlapped_peaks_set_aside():
    """A run that overlapped another on its worker reads the process's peak: the other's memory in it, or its
    release under it. Learned as points, such peaks give a table operator a slope it does not have, and plans of many
    small chunks; once the runs that ran
    alone suffice, the fit is theirs. Before that, every run counts (a worker that is never idle still plans)."""
    rng = random.Random(3)

    def table(e):
        return 192 * MIB + 4 * e

    def run(ext, alone):
        peak = table(elements(ext)) * (rng.uniform(0.998, 1.004) if alone else rng.uniform(0.55, 2.1))
        o = obs(ext, peak)
        o.shared, o.retained_bytes = True, (0 if alone else None)  # what the monitor records on a 2-thread worker
        return o

    sizes = [(i, 32, 400) for i in (4, 8, 12, 16, 24)]
    history = [run(sizes[k % 5], alone=k % 3 == 0) for k in range(45)]
    assert [o.alone for o in history[:3]] == [True, False, False]
    m = OperatorModel(KEY)
    for o in history[:4]:
        m.learn(o)
    assert m.predict(sizes[0]).ready and m.n_observations >= 3, "too few alone runs yet: every run counts"
    for o in history[4:]:
        m.learn(o)
    everything = OperatorModel(KEY)
    for o in history:
        everything.learn(dataclasses.replace(o, retained_bytes=None))  # as if none had been alone
    far = (96, 32, 400)  # 4x the largest block learned
    truth = table(elements(far))
    alone = OperatorModel(KEY)
    for o in history:
        if o.alone:
            alone.learn(o)
    p, p_alone, p_all = m.predict(far), alone.predict(far), everything.predict(far)
    assert m.n_observations == 15 and m.summary()["n_observations"] == 15
    assert abs(p.mean_bytes / truth - 1) < 0.02
    assert truth <= p.upper_bytes <= 1.05 * p_alone.upper_bytes
    assert "had their worker to themselves (of 45)" in p.reason
    assert p_all.upper_bytes > 2 * p.upper_bytes, "mixed peaks bound the same block far wider"


def test_memory_a_run_started_with_above_the_assumed_resting_level_is_the_workers_not_the_operators():
    """Where a worker stood when a run began (above the resting memory the budget read) is reported for the map's
    budget to take off its kill headroom (machine.Start.drift_bytes); the operator's bound and margin are its own
    peaks: a worker whose memory creeps up over a long map must not make every chunk of every operator look
    larger (under a user's small cap a map of thousands of chunks stopped on it)."""
    calm, drifting = OperatorModel(KEY), OperatorModel(KEY)
    for k in range(30):
        ext = SIZES[k % 12]
        peak = linear(elements(ext)) * (1 + 0.02 * (-1) ** k)
        calm.learn(obs(ext, peak))
        o = obs(ext, peak)
        o.baseline_bytes, o.resting_bytes = 300 * MIB, 250 * MIB  # the worker held 50 MiB the budget did not see
        drifting.learn(o)
    ext = (64, 64, 400)
    assert drifting.unseen_bytes() == 50 * MIB and calm.unseen_bytes() == 0
    assert drifting.predict(ext) == calm.predict(ext)
    assert drifting.conformal_factor() == calm.conformal_factor() < 1.1


def test_what_a_first_use_left_held_is_the_workers_and_the_block_is_learned_without_it():
    """On an H100 the demo's host model of a GPU key bounded the next chunk of 1 x 26 traces at 178.6 MiB after each
    worker's first chunk (which loads CUDA's libraries and keeps them), and the map planned chunks of 4 x 4
    traces. The log has the bounds, not the peaks: first chunks of ~150 MiB and later ones of ~1 MiB, rebuilt
    here, give that bound. What a run left held is a first use: the block is learned without it, and the model
    reports it for a map to budget a worker yet to pay it."""
    def host(ext, working_mib, left_mib=0.0):
        o = obs(ext, (working_mib + left_mib) * MIB)
        o.retained_bytes = int(left_mib * MIB) + 100_000  # what any run leaves: allocator pages
        return o

    def runs():
        # Host memory of a GPU task: the block read, a copy back, a fixed ~1 MiB; both workers' first chunks pay
        # the first use.
        yield host((1, 23, 400), 1.2, 150.0)
        yield host((1, 23, 400), 1.2, 148.0)
        for ext in ((1, 1, 400), (1, 1, 400), (4, 23, 400), (4, 23, 400), (12, 23, 400), (12, 23, 400)):
            yield host(ext, 1.0 + 8 * elements(ext) / MIB)

    def truth(ext):
        return (1.0 + 8 * elements(ext) / MIB) * MIB

    fixed, unaware = OperatorModel(KEY), OperatorModel(KEY)
    for k, o in enumerate(runs()):
        fixed.learn(o)
        unaware.learn(dataclasses.replace(o, retained_bytes=None))  # the same runs as before v10 measured them
        if k == 3:  # the probes are back: the plan after probing is made now
            nxt = (1, 26, 400)
            assert fixed.predict(nxt).upper_bytes < 1.5 * truth(nxt) < 100 * truth(nxt) < unaware.predict(
                nxt).upper_bytes, (fixed.predict(nxt), unaware.predict(nxt))
    nxt = (16, 23, 400)
    assert fixed.predict(nxt).upper_bytes < 1.5 * truth(nxt) < unaware.predict(nxt).upper_bytes
    assert fixed.first_use_bytes() == pytest.approx(150 * MIB, rel=0.01)
    assert unaware.first_use_bytes() == 0 and fixed.summary()["first_use_bytes"] == fixed.first_use_bytes()
    first = host((1, 23, 400), 1.2, 150.0)
    assert fixed.working_bytes(first) == pytest.approx(1.2 * MIB, rel=0.1)
    # What every run leaves (0.1 MiB here) is below first_touch_bytes and its share of the peak: not a first use.
    plain = host((12, 23, 400), 3.0)
    assert fixed.first_use(plain) == 0 and fixed.working_bytes(plain) == plain.peak_bytes
    # A run that failed left whatever its failure left: never a first use.
    died = dataclasses.replace(first, outcome="memory_error", censored=True)
    assert fixed.first_use(died) == 0


def test_what_a_workers_first_call_left_held_is_a_first_use_however_small_a_share_of_its_peak():
    """The workload family's ``fam_table`` (a 128 MiB table built per call, 3x the block; seed 4, workload w4): a
    cold run's rows (elements, extents, peak, bytes left held, first call). Each worker's first call imported
    its libraries and left 22-23 MiB held, 15% of its peak: under the share that makes a later run's leftovers a
    first use. Learned as the block's, those 22 MiB over three sizes 1.6x apart read the peak as quadratic in
    the block: a whole-survey chunk 4.5x the largest measured at 913 MiB, where the table and three copies of
    the block need about 136 MiB, and the simulator predicted a split-on-failure flow killed and split where
    it ran whole (139% long)."""
    rows = [(147_600, (36, 41, 100), 158_568_448, 23_969_792, True), (147_600, (36, 41, 100), 157_622_272, 22_704_128, True),
            (90_200, (22, 41, 100), 136_167_424, 172_032, False), (90_200, (22, 41, 100), 135_921_664, 204_800, False),
            (106_600, (26, 41, 100), 136_306_688, 57_344, False), (106_600, (26, 41, 100), 136_232_960, 200_704, False)]
    known, unknown = OperatorModel(KEY), OperatorModel(KEY)
    for e, ext, peak, left, first in rows:
        o = Observation(KEY, e, ext, 4 * e, peak, retained_bytes=left, first_call=first)
        known.learn(o)
        unknown.learn(dataclasses.replace(o, first_call=None))  # records older than schema v12
    whole = (82, 82, 100)
    need = 128 * MIB + 3 * 4 * elements(whole)
    assert known.first_use_bytes() == pytest.approx(23_969_792, rel=0.01)  # the worker's from now on
    assert 0.7 * need < known.predict(whole).mean_bytes < 1.3 * need
    assert unknown.first_use_bytes() == 0 and unknown.predict(whole).mean_bytes > 4 * need
    # A later call's leftovers stay the block's below the share, however many bytes: only a first call loads once.
    later = Observation(KEY, 90_200, (22, 41, 100), 360_800, 150 * MIB, retained_bytes=20 * MIB, first_call=False)
    assert known.memory.first_use(later) == 0
    assert known.memory.first_use(dataclasses.replace(later, first_call=True)) == 20 * MIB


def test_a_gpu_model_never_takes_the_hosts_first_use_off_a_gpu_peak():
    from memchunk_prefect.learn.bank import gpu_view

    o = obs((8, 16, 400), 200 * MIB)
    o.retained_bytes, o.gpu_peak_bytes, o.gpu_budget_bytes = 150 * MIB, 2 * 2**30, 40 * 2**30
    assert gpu_view(o).retained_bytes is None and gpu_view(o).peak_bytes == 2 * 2**30


def test_the_tight_bound_is_the_mean_times_the_learned_margin_up_to_twice_the_largest_block_measured():
    rng = random.Random(3)
    m = OperatorModel(KEY)
    sizes = [(i, 32, 400) for i in (4, 8, 12, 16)]
    for k in range(40):
        ext = sizes[k % len(sizes)]
        m.learn(obs(ext, superlinear(elements(ext)) * rng.uniform(0.97, 1.03)))
    q = m.conformal_factor()
    assert q is not None
    inside, reach, beyond = m.predict((16, 32, 400)), m.predict((32, 32, 400)), m.predict((40, 32, 400))
    assert inside.tight_bytes == pytest.approx(inside.mean_bytes * q) and inside.tight_bytes <= inside.upper_bytes
    # Beyond the largest block the line and the superlinear curve the runs cannot rule out part: the tight bound
    # holds the curve by its weight (the truth here), below the widened upper bound.
    w, other = m.memory._curved_weight()
    assert other is not None and w > 0.5
    assert reach.mean_bytes * q < reach.tight_bytes and superlinear(elements((32, 32, 400))) <= reach.tight_bytes
    assert reach.tight_bytes < reach.upper_bytes, "twice the largest block: the bold bet, below the widened bound"
    assert beyond.tight_bytes == beyond.upper_bytes, "past twice the largest block measured, no bet"
    # A censored run at a size raises the tight bound there as it raises the upper bound.
    m.learn(obs((24, 32, 400), 10 * reach.upper_bytes, outcome="memory_error", censored=True))
    assert m.predict((32, 32, 400)).tight_bytes >= 10 * reach.upper_bytes


def test_before_a_margin_is_learned_the_tight_bound_is_the_in_data_prediction_interval():
    m = trained(linear, n=6)
    assert m.conformal_factor() is None
    largest = max(m.memory._sizes)
    p = m.predict((1, 1, largest))  # the largest block measured: no extrapolation
    assert p.mean_bytes < p.tight_bytes <= p.upper_bytes
    assert p.tight_bytes < 1.3 * p.mean_bytes


def test_a_time_curve_that_falls_at_the_smallest_block_is_noise_and_the_line_is_kept():
    # envelope's cold probes in a heterogeneous benchmark run (elements, seconds): the first wave carried
    # first-call costs, so the smallest block took longer than one 3.3x larger; a quadratic through them is
    # U-shaped, wins on leave-one-out error, and told the planner smaller chunks were faster.
    m = OperatorModel(KEY)
    runs = [(240_000, 0.0565), (240_000, 0.0872), (801_600, 0.0500), (1_603_200, 0.1843), (801_600, 0.0439)]
    for e, secs in runs:
        ext = (1, 1, e)
        m.learn(Observation(KEY, e, ext, 4 * e, int(5 * MIB + 16 * e), seconds=secs))
    assert m.time_form() == "linear"
    # No curve; the rates fall with size (first-call costs on the small blocks), so a block is planned on the line
    # between the smallest and the largest blocks timed, and smaller chunks never read cheaper per element.
    assert m.time.rates_fall()
    # Beyond the largest block: its seconds, and for the rest the cost per element measured into it, which here
    # exceeds the largest block's own rate (a negative fixed cost): that rate, at most.
    assert m.time.robust_slope() > 0.1843 / 1_603_200
    assert m.seconds_for(1_843_200) == pytest.approx(0.1843 / 1_603_200 * 1_843_200)
    assert m.seconds_for(240_000) / 240_000 > m.seconds_for(801_600) / 801_600


def test_rates_that_fall_with_size_plan_a_block_on_the_line_between_the_smallest_and_largest_blocks():
    """A table operator's cold map on the workload family (one store's rows: elements, extents, wall and kernel
    seconds, bytes the run grew its worker, peak): each task pays a fixed cost that weighs on the small probes.
    The warm run's two chunks of 636,000 elements then took 0.30-0.38 s of compute; the median rate over all
    runs read 1.43 s, and the simulator predicted the warm run twice as long as it ran."""
    rows = [(62100, (18, 23, 150), 0.629, 0.347, 222449664, 222449664),
            (70200, (18, 26, 150), 0.698, 0.313, 222580736, 222580736),
            (62100, (18, 23, 150), 0.14, 0.056, 4165632, 202854400),
            (70200, (18, 26, 150), 0.144, 0.043, 2764800, 202784768),
            (34500, (10, 23, 150), 0.079, 0.024, 2437120, 202125312),
            (39000, (10, 26, 150), 0.07, 0.023, 1486848, 202137600),
            (39000, (10, 26, 150), 0.137, 0.022, 565248, 202145792),
            (34500, (10, 23, 150), 0.085, 0.02, 143360, 202076160),
            (174150, (27, 43, 150), 0.08, 0.029, 2199552, 203743232),
            (174150, (27, 43, 150), 0.09, 0.023, 2285568, 203796480),
            (406350, (63, 43, 150), 0.106, 0.034, 2883584, 206573568),
            (406350, (63, 43, 150), 0.168, 0.034, 135168, 206581760)]
    m = timed(rows)
    assert m.time_form() == "linear" and m.time.rates_fall()
    assert m.seconds_per_element() * 636_000 > 1.4  # the median over every size: the probes'
    # Beyond the largest size: the 406,350-element runs' seconds (the upper middle of two), and the measured cost
    # per element for the rest; not their rate, which counts the fixed cost again in proportion.
    assert m.seconds_for(636_000) == pytest.approx(0.168 + m.time.robust_slope() * (636_000 - 406_350))
    assert 0.168 < m.seconds_for(636_000) < 0.168 / 406_350 * 636_000
    small = 0.085 / 34_500  # the upper middle rate of the four runs of 34,500 and 39,000 elements
    assert m.seconds_for(220_425) == pytest.approx((small * 34_500 + 0.168) / 2)  # half way: half of each end
    # Below the smallest block timed the line goes on: its fixed cost stays, where the small blocks' rate alone
    # would scale it away.
    fixed = 0.085 - (0.168 - 0.085) / (406_350 - 34_500) * 34_500
    assert m.seconds_for(30_000) == pytest.approx(fixed + (0.168 - 0.085) / (406_350 - 34_500) * 30_000)
    assert m.seconds_for(3_000) > 9 * small * 3_000  # a tenth of the smallest block: mostly its fixed cost
    sizes = range(2_000, 800_000, 2_000)
    seconds = [m.seconds_for(e) for e in sizes]
    assert all(b >= a for a, b in zip(seconds, seconds[1:]))  # a larger block never reads faster
    assert all(b / eb <= a / ea * (1 + 1e-12) for a, b, ea, eb in zip(seconds, seconds[1:], sizes, sizes[1:]))
    # Rates about flat leave time proportional to size: the median rate plans it.
    flat = timed([(e, ext, 1e-6 * e, sys_secs, grew, peak) for e, ext, _, sys_secs, grew, peak in rows[8:]])
    assert not flat.time.rates_fall() and flat.seconds_for(636_000) is None


def test_below_the_smallest_block_a_line_of_negative_fixed_cost_gives_way_to_the_small_blocks_rate():
    """The rates fall by their medians (0.03 us per element small, 0.0255 large) while the upper middle values the
    line is drawn through rise (0.03 and 0.05 us): through them the line would cost a block a tenth of the smallest
    size below zero seconds; it takes the small blocks' rate there instead."""
    t = TimeModel()
    for n, rate in [(100_000, 0.03e-6)] * 4 + [(1_000_000, 0.001e-6)] * 2 + [(1_000_000, 0.05e-6)] * 2:
        t.learn(Observation(KEY, n, (1, 1, n), 4 * n, 2**20, seconds=rate * n))
    assert t.rates_fall()
    line = 0.003 + (0.05 - 0.003) * (10_000 - 100_000) / (1_000_000 - 100_000)
    assert line < 0
    assert t.falling_seconds(10_000) == pytest.approx(0.03e-6 * 10_000)
    assert t.falling_seconds(500_000) == pytest.approx(0.003 + 0.047 * 400_000 / 900_000)  # between: the line


def test_a_workers_first_call_is_learned_apart_and_does_not_read_small_blocks_as_slow():
    """A library loaded at a worker's first call (the workload family's ``fam_first_use``: one store's rows, a cold
    run then a warm one, each on a fresh cluster of 2 workers; elements, extents, wall and kernel seconds, bytes
    the run grew its worker, peak, first call). Each worker's first call took 0.2 s more than a later call of its
    block. Fitted as a block's time, that read every block as 0.25 s or more: the simulator charged each of a
    static-32 plan's 64 tasks for it, and predicted the run 46% long."""
    rows = [(145800, (9, 81, 200), 0.317, 0.085, 183205888, 183205888, True),
            (145800, (9, 81, 200), 0.518, 0.272, 184713216, 184713216, True),
            (486000, (30, 81, 200), 0.027, 0.004, 9240576, 11177984, False),
            (486000, (30, 81, 200), 0.035, 0.007, 729088, 11161600, False),
            (2025000, (125, 81, 200), 0.192, 0.046, 13811712, 24780800, False),
            (2025000, (125, 81, 200), 0.126, 0.011, 319488, 24940544, False),
            (2592000, (81, 160, 200), 0.579, 0.266, 209956864, 209956864, True),
            (2592000, (81, 160, 200), 0.654, 0.268, 208965632, 208965632, True)]
    known, unknown = OperatorModel(KEY), OperatorModel(KEY)
    for e, ext, secs, sys_secs, grew, peak, first in rows:
        o = Observation(KEY, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew,
                        first_call=first)
        known.learn(o)
        unknown.learn(dataclasses.replace(o, first_call=None))  # records older than schema v12
    assert unknown.time.rates_fall() and unknown.seconds_for(600_000) > 0.25
    assert unknown.time.first_call_seconds() is None
    # The first calls set apart, time is proportional to the block, at the later calls' rate (upper middle).
    assert not known.time.rates_fall() and known.seconds_for(600_000) is None
    assert known.seconds_per_element() == pytest.approx((0.035 - 0.0) / 486000)
    # What a first call took beyond its block's compute: the upper middle of 0.22, 0.24 (the probes) and 0.13,
    # 0.20 (the warm chunks), each its wall less its kernel seconds (all grew their worker) less 2.59 M x the rate.
    rate = 0.035 / 486000
    extras = sorted([0.317 - 0.085 - 145800 * rate, 0.518 - 0.272 - 145800 * rate,
                     0.579 - 0.266 - 2592000 * rate, 0.654 - 0.268 - 2592000 * rate])
    assert known.time.first_call_seconds() == pytest.approx(extras[2])
    assert known.summary()["first_call_runs"] == 4 and known.summary()["first_call_seconds"] == pytest.approx(extras[2])
    # A cold start's first wave is all first calls: they give a rate until a later run is learned.
    first = OperatorModel(KEY)
    e, ext, secs, sys_secs, grew, peak, _ = rows[0]
    first.learn(Observation(KEY, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew,
                            first_call=True))
    assert first.seconds_per_element() == pytest.approx((0.317 - 0.085) / 145800)
    assert first.time.first_call_seconds() is None


def test_a_first_call_bounds_what_a_later_call_of_a_larger_block_than_any_timed_takes():
    """The workload family's ``fam_autocorr`` (seed 1), a cold start's rows: its two large probes were both
    workers' first calls, so its rates were learned from three small blocks alone, which pay each task's fixed
    costs over few elements (elements, extents, wall and kernel seconds, bytes grown, peak, first call). The
    model read a block of 0.6 M at 1.05 s, where the first calls of that very size, one-off cost included, took
    0.2-0.26 s of compute; a split-on-failure flow's whole-survey chunk was predicted twice as long as it ran."""
    rows = [(600000, (75, 40, 200), 0.279, 0.081, 17125376, 17125376, True),
            (600000, (75, 40, 200), 0.399, 0.143, 17420288, 17420288, True),
            (40000, (5, 40, 200), 0.080, 0.010, 0, 10657792, False),
            (20000, (5, 20, 200), 0.088, 0.004, 0, 10518528, False),
            (20000, (5, 20, 200), 0.046, 0.007, 0, 10240000, False)]
    m = timed(rows)
    t = m.time
    fitted = t.falling_seconds
    assert t.rates_fall() and fitted(600_000) > 1.0, "the small blocks alone read it 4x slower"
    bound = max(0.279 - 0.081, 0.399 - 0.143)  # the upper middle of the two first calls' compute seconds
    assert t.first_call_ceiling(600_000) == pytest.approx(bound)
    assert m.seconds_for(600_000) == pytest.approx(bound) and m.seconds_for(300_000) == pytest.approx(bound)
    # Beyond the first calls' size, the bound grows as the later calls' model does.
    assert m.seconds_for(1_280_000) == pytest.approx(bound * fitted(1_280_000) / fitted(600_000))
    # Among the sizes later calls timed, they stand: the line between the small blocks.
    assert t.first_call_ceiling(30_000) is None and m.seconds_for(30_000) == pytest.approx(fitted(30_000))
    assert t.first_call_seconds() == 0.0, "a first call took no longer than the later call it bounds"

    # Rates that rise with size (time quadratic in the block, later calls of 0.1-0.4 M): a first call of 0.6 M
    # bounds the blocks beyond 0.4 M, carried past its size by the curve's growth; one among the later calls'
    # sizes bounds nothing (run beside another task, a first call may have been the faster).
    rising = OperatorModel(KEY)
    for e in (100_000, 100_000, 400_000, 400_000, 200_000, 200_000):
        rising.learn(Observation(KEY, e, (1, 1, e), 4 * e, 8 * e, seconds=0.5 * (e / 400_000) ** 2,
                                 sys_seconds=0.0, grew_bytes=0))
    curve = rising.seconds_for
    before = {e: curve(e) for e in (300_000, 500_000, 600_000, 1_200_000)}
    for e, seconds in ((300_000, 0.05), (600_000, 1.0)):
        rising.learn(Observation(KEY, e, (1, 1, e), 4 * e, 8 * e, seconds=seconds, sys_seconds=0.0, grew_bytes=0,
                                 first_call=True))
    assert rising.rates_rise() and before[600_000] == pytest.approx(0.5 * 1.5**2, rel=0.05)
    assert curve(300_000) == before[300_000] and curve(500_000) == before[500_000]  # below the bound of 1.0 s
    assert curve(600_000) == pytest.approx(1.0)
    assert curve(1_200_000) == pytest.approx(1.0 * before[1_200_000] / before[600_000])
    # A larger block never reads faster: a first call faster than the largest later call bounds at that call.
    flat = OperatorModel(KEY)
    flat.learn(Observation(KEY, 100_000, (1, 1, 100_000), 400_000, 800_000, seconds=0.1, sys_seconds=0.0,
                           grew_bytes=0))
    flat.learn(Observation(KEY, 200_000, (1, 1, 200_000), 800_000, 1_600_000, seconds=0.05, sys_seconds=0.0,
                           grew_bytes=0, first_call=True))
    assert flat.seconds_for(100_000) is None, "a later call's size: the rate stands"
    assert flat.seconds_for(150_000) == pytest.approx(0.1) and flat.seconds_for(200_000) == pytest.approx(0.1)
    assert flat.seconds_for(400_000) == pytest.approx(0.1), "0.05 s x 2, the rate's growth"
    assert flat.seconds_for(1_000_000) == pytest.approx(0.25)


def test_rates_that_rise_with_size_never_read_a_larger_block_cheaper_per_element():
    """fam_gram (compute quadratic in the traces of a block) on the workload family: many runs bunched at
    0.48-0.66 M elements, one at 1.33 M that ran 1.66x dearer per element. The line fitted beside the curve took
    a large constant and read a 1.92 M-element block at 0.32 s (it took 0.82 s of compute): the warm plan cut
    the map in 2 chunks where 8 had run 1.4x faster."""
    rates = [2.68, 2.9, 2.93, 3.44, 3.59, 3.83, 4.27, 4.54, 4.62, 4.75, 4.98, 5.02, 5.89, 7.78]  # 1e-7 s/element
    runs = [(480_000, r) for r in rates] + [(592_000, 2.13), (592_000, 2.21), (664_000, 2.04), (664_000, 2.23),
                                             (664_000, 2.65), (664_000, 3.23), (664_000, 3.27), (664_000, 8.46),
                                             (1_328_000, 5.84)]
    m = OperatorModel(KEY)
    for e, r in runs:
        m.learn(Observation(KEY, e, (1, 1, e), 4 * e, 8 * e, seconds=r * 1e-7 * e, sys_seconds=0.0, grew_bytes=0))
    assert m.rates_rise()
    for e in (1_328_000, 1_920_000, 4_000_000):  # at and beyond the largest: never below its rate
        assert m.seconds_for(e) >= 5.84e-7 * e * (1 - 1e-9)
    small = sorted(r for e, r in runs if e <= 1.5 * 480_000)[(22 - 1) // 2] * 1e-7  # the lower middle rate
    assert m.seconds_for(1_000_000) >= small * 1_000_000 * (1 - 1e-9)
    assert m.time.rising_floor(480_000) is None and m.time.rising_floor(400_000) is None
    # Where the rates do not rise, no floor.
    flat = OperatorModel(KEY)
    for e in (480_000, 1_328_000) * 4:
        flat.learn(Observation(KEY, e, (1, 1, e), 4 * e, 8 * e, seconds=3e-7 * e, sys_seconds=0.0, grew_bytes=0))
    assert flat.time.rising_floor(2_000_000) is None


def test_a_block_beyond_the_largest_timed_pays_the_fixed_cost_once_at_the_slope_one_wild_run_cannot_move():
    """Seconds of ``0.05 + 1e-7 x elements`` (a fixed cost per call, then a cost per element) at three sizes, one
    run of the middle size 5x slow. The median of the pairs' slopes is the true slope; a block twice the largest
    reads the true 0.13 s, where the large blocks' rate (0.09 s over 400,000 elements) read 0.18 s."""
    m = OperatorModel(KEY)
    for i, e in enumerate((100_000, 200_000, 400_000) * 2 + (200_000,)):
        secs = 0.5 if i == 6 else 0.05 + 1e-7 * e
        m.learn(Observation(KEY, e, (1, 1, e), 4 * e, int(5 * MIB + 16 * e), seconds=secs))
    assert m.time_form() == "linear" and m.time.rates_fall()
    assert m.time.robust_slope() == pytest.approx(1e-7)
    assert m.seconds_for(400_000) == pytest.approx(0.09)
    assert m.seconds_for(800_000) == pytest.approx(0.13)
    assert m.seconds_for(4_000_000) == pytest.approx(0.45)


def test_the_slope_beyond_the_largest_block_is_measured_into_it_however_many_runs_of_one_size_follow():
    """A cold start's probes, then a warm run's many chunks of one size (more than the time window): the slope
    still pairs the latest large runs with the latest probes, and a block twice the chunks' size reads the fixed
    cost once (0.05 + 1e-7 x elements). Over the latest runs alone, all of one size, no pair is that far apart."""
    m = OperatorModel(KEY)
    for e in (50_000,) * 5 + (500_000,) * 25:
        m.learn(Observation(KEY, e, (1, 1, e), 4 * e, int(5 * MIB + 16 * e), seconds=0.05 + 1e-7 * e))
    assert m.time.rates_fall()
    assert m.time.robust_slope() == pytest.approx(1e-7)
    assert m.seconds_for(1_000_000) == pytest.approx(0.15)
    assert m.time.robust_slope(window=20) == m.time.robust_slope()  # the default window, memoised per run learned


def test_where_the_smallest_blocks_took_longer_than_the_largest_the_largest_decide_the_line():
    """fam_table in a cold run of the workload family (seed 1; its store's rows: elements, extents, wall and kernel
    seconds, bytes grown, peak, first call). One probe of 44,000 elements took 0.27 s beside another worker's first
    call, where 42,000 took 0.04 s and the block of 590,400, 0.11 s. A larger block is never faster, so one end is
    noise: the line held the largest end up to the smallest's 0.26 s and read the split-on-failure flow's
    whole-survey chunk of 1,312,000 elements at 1.15 s; the simulator predicted that run 2.2x as long as it ran."""
    rows = [(590400, (72, 41, 200), 0.5214, 0.2861, 148090880, 159318016, True),
            (590400, (72, 41, 200), 0.1109, 0.0423, 1146880, 141611008, False),
            (82000, (10, 41, 200), 0.5179, 0.2221, 143208448, 153534464, True),
            (44000, (10, 22, 200), 0.2717, 0.1472, 0, 135139328, False),
            (42000, (10, 21, 200), 0.0402, 0.0192, 0, 135102464, False)]
    m = timed(rows)
    assert m.time.rates_fall() and m.time_form() == "linear"
    assert m.seconds_for(590_400) == pytest.approx(0.1109)
    assert m.seconds_for(1_312_000) == pytest.approx(0.1109 + m.time.robust_slope() * (1_312_000 - 590_400))
    assert m.seconds_for(1_312_000) < 0.1109 / 590_400 * 1_312_000
    assert m.seconds_for(42_000) == pytest.approx(0.1109)  # the smallest end at the largest's seconds
    sizes = range(20_000, 2_000_000, 20_000)
    seconds = [m.seconds_for(e) for e in sizes]
    assert all(b >= a for a, b in zip(seconds, seconds[1:]))  # a larger block never reads faster


def test_a_time_curve_whose_rise_lies_beyond_every_run_measured_is_not_named():
    """fam_table (a 64 MiB table built per task, then a small cost per element) in a cold run of the workload
    family (its store's rows: elements, extents, wall and kernel seconds, bytes the run grew its worker, peak,
    first call). A quadratic held at no slope, ``a + c u^2``, beat the line on leave-one-out error over these
    noisy runs, with its cheapest rate at 0.93x the largest block: its whole rise lay beyond the runs. Named, it
    read the split-on-failure flow's one chunk of 5,120,000 elements at 2.25 s, and the simulator predicted that
    run 94% long; the warm runs' first calls of 2,656,000 elements later ran in 0.21-0.33 s."""
    rows = [(132800, (8, 83, 200), 0.294, 0.167, 67665920, 69455872, True),
            (132800, (8, 83, 200), 0.25, 0.147, 884736, 69111808, False),
            (149400, (9, 83, 200), 0.169, 0.038, 663552, 69369856, False),
            (149400, (9, 83, 200), 0.091, 0.015, 45285376, 69472256, True),
            (265600, (16, 83, 200), 0.079, 0.009, 2240512, 70778880, False),
            (265600, (16, 83, 200), 0.15, 0.03, 1630208, 70709248, False),
            (478800, (42, 57, 200), 0.124, 0.012, 3280896, 73605120, False),
            (495600, (42, 59, 200), 0.187, 0.027, 3665920, 73728000, False),
            (478800, (42, 57, 200), 0.126, 0.016, 0, 73236480, False),
            (470400, (42, 56, 200), 0.188, 0.025, 53248, 73134080, False),
            (495600, (42, 59, 200), 0.092, 0.028, 327680, 73428992, False),
            (470400, (42, 56, 200), 0.102, 0.051, 0, 73158656, False),
            (1211800, (73, 83, 200), 0.209, 0.01, 9084928, 82034688, False),
            (1211800, (73, 83, 200), 0.282, 0.092, 8990720, 82071552, False)]
    m = timed(rows)
    fits = m.time.time_fits([5_120_000])
    # What named the curve before: it beats the line on held-out runs, and no gap between sizes is wider than 3x.
    assert fits["quadratic"]["press"] < 0.9 * fits["linear"]["press"] and m.time.curve_supported()
    assert fits["quadratic"]["seconds"][0] > 2.0
    assert m.time_form() == "linear" and m.time_curve_weight() == (0.0, None) and m.time.rates_fall()
    # Beyond the largest block, the largest blocks' seconds (upper middle of two) and the measured cost per element
    # for the rest: 0.47 s at the warm runs' 2,656,000 elements, whose first calls took 0.21-0.33 s, one-off cost
    # included. Scaled at the large blocks' rate, 0.62 s; the curve, more still.
    assert m.seconds_for(5_120_000) == pytest.approx(0.282 + m.time.robust_slope() * (5_120_000 - 1_211_800))
    assert m.seconds_for(2_656_000) == pytest.approx(0.47, abs=0.01)
    # A fixed cost and a curvature whose rise the runs measured (the cheapest rate at 0.3 Mi-elements, runs to 2)
    # still name the curve.
    curved = OperatorModel(KEY)
    rng = random.Random(3)
    for _ in range(2):
        for u in (0.1, 0.2, 0.4, 0.8, 1.2, 1.6, 2.0):
            e = int(u * MIB)
            secs = (0.09 + 1.0 * u * u) * (1 + rng.gauss(0, 0.03))
            curved.learn(Observation(KEY, e, (1, 1, e), 4 * e, 8 * e, seconds=secs, sys_seconds=0.0, grew_bytes=0))
    assert curved.time_form() == "quadratic" and curved.time_curve_weight() == (1.0, "quadratic")


def test_a_time_curve_needs_the_runs_cpu_seconds_to_rise_with_size_too():
    """The workload family's ``fam_autocorr`` (work linear in the traces of a block cut along inlines; seed 2, w0): a
    cold run's rows (elements, extents, wall, CPU and kernel seconds, bytes grown, peak, first call). Tasks of
    0.1-0.35 s, of which the thread worked half: the wall rates of the largest blocks ran 0.79x the smallest's and a
    quadratic won on leave-one-out error, reading the whole survey (1.3 M elements with its halo) at 1.6 s where
    it took 0.8; a split-on-failure flow of two such blocks was predicted 118% long. The CPU seconds per element
    did not rise (0.87x): no curve. ``fam_gram`` (a traces x traces matrix: work quadratic in the traces; seed 0,
    w3), whose CPU rates rose over its probes (its largest a first touch, the kernel time of its growth set aside),
    keeps its curve."""
    autocorr = [(330000, (33, 50, 200), 0.16, 0.098, 0.027, 15302656, 15302656, True),
                (330000, (33, 50, 200), 0.258, 0.132, 0.076, 14852096, 14852096, True),
                (336000, (30, 56, 200), 0.173, 0.094, 0.056, 4341760, 13307904, False),
                (270000, (27, 50, 200), 0.152, 0.098, 0.06, 3284992, 12283904, False),
                (336000, (30, 56, 200), 0.206, 0.098, 0.055, 700416, 12857344, False),
                (135000, (27, 25, 200), 0.124, 0.051, 0.03, 0, 11071488, False),
                (135000, (27, 25, 200), 0.086, 0.039, 0.015, 0, 11194368, False),
                (470400, (42, 56, 200), 0.353, 0.171, 0.098, 2400256, 13914112, False),
                (310800, (42, 37, 200), 0.277, 0.087, 0.031, 1716224, 13836288, False),
                (260400, (42, 31, 200), 0.114, 0.07, 0.045, 0, 12259328, False)]
    gram = [(592000, (37, 80, 200), 0.179, 0.066, 0.035, 54243328, 75964416, True),
            (592000, (37, 80, 200), 0.136, 0.055, 0.015, 61546496, 75857920, True),
            (664000, (83, 40, 200), 0.491, 0.307, 0.259, 82325504, 91045888, False),
            (1328000, (83, 80, 200), 1.446, 1.101, 0.879, 289050624, 361267200, False),
            (664000, (83, 40, 200), 0.247, 0.063, 0.014, 0, 90791936, False),
            (592000, (37, 80, 200), 0.121, 0.049, 0.011, 0, 72294400, False),
            (592000, (37, 80, 200), 0.12, 0.051, 0.017, 0, 72331264, False),
            (448000, (14, 160, 200), 0.15, 0.04, 0.006, 0, 41963520, False),
            (448000, (14, 160, 200), 0.188, 0.03, 0.01, 0, 41951232, False),
            (448000, (14, 160, 200), 0.196, 0.035, 0.004, 0, 41910272, False),
            (448000, (14, 160, 200), 0.335, 0.037, 0.011, 0, 41893888, False),
            (448000, (14, 160, 200), 0.254, 0.029, 0.005, 0, 41938944, False),
            (208000, (13, 80, 200), 0.161, 0.013, 0.006, 0, 9433088, False),
            (208000, (13, 80, 200), 0.09, 0.009, 0.003, 0, 9347072, False)]

    def taught(rows: list, cpu: bool = True, gpu: bool = False) -> OperatorModel:
        m = OperatorModel(KEY)
        for e, ext, secs, cpu_secs, sys_secs, grew, peak, first in rows:
            m.learn(Observation(KEY, e, ext, 4 * e, peak, seconds=secs, cpu_seconds=cpu_secs if cpu else None,
                                sys_seconds=sys_secs, grew_bytes=grew, first_call=first, gpu_peak_bytes=peak,
                                gpu_budget_bytes=2**30 if gpu else None))
        return m

    whole = 64 * 104 * 200  # the seed's 60 x 100 x 200 survey with the halo
    wall_only, both = taught(autocorr, cpu=False), taught(autocorr)
    assert wall_only.time_form() == "quadratic" and wall_only.seconds_for(whole) > 1.5
    assert both.time.cpu_rate_ratio() == pytest.approx(0.87, abs=0.02) and both.time.cpu_rates_flat()
    assert both.time_form() == "linear" and both.time_curve_weight() == (0.0, None)
    assert both.seconds_for(whole) < 1.0
    # A run of a map on a GPU: the work is the device's, its thread's CPU seconds say nothing of a curve. (Every run
    # above carries an NVML reading of the device, as a CPU run does on a machine with a GPU: that is no GPU run.)
    assert taught(autocorr, gpu=True).time.cpu_rate_ratio() is None
    curved = taught(gram)
    assert curved.time.cpu_rate_ratio() > 2 and not curved.time.cpu_rates_flat()
    assert curved.time_curve_weight()[1] is not None
    assert curved.time_form() == taught(gram, cpu=False).time_form()


def test_a_time_curve_the_measured_rates_do_not_show_is_not_taken():
    """gst3d_dip's cold map in one round of the full benchmark (its store's rows: elements, extents, wall and
    kernel seconds, bytes the run grew its worker, peak): the probes' time was mostly per task and the two large
    chunks ran in a slow spell. A quadratic through the two clusters won on leave-one-out error, read 3.0 s for
    2,252,800 elements against 7.9 s for 3,891,200, and the warm plan cut 4 chunks where 2 ran as fast per
    element. The rates measured fall with size (2.5 us per element at the probes, 2.0 at the chunks): no curve."""
    rows = [(176_800, (13, 34, 400), 0.531, 0.048, 0, 31_469_568),
            (239_200, (13, 46, 400), 0.584, 0.068, 9_203_712, 42_278_912),
            (343_200, (13, 66, 400), 0.596, 0.067, 27_455_488, 58_875_904),
            (280_800, (13, 54, 400), 0.684, 0.131, 7_454_720, 48_132_096),
            (3_891_200, (128, 76, 400), 9.548, 1.985, 621_813_760, 669_335_552),
            (3_891_200, (128, 76, 400), 10.387, 2.140, 611_237_888, 669_450_240)]
    m = timed(rows)
    assert not m.rates_rise() and not m.curve_supported()  # 343,200 -> 3,891,200: an 11x gap
    assert m.time_form() == "linear" and m.time.rates_fall()
    # Planned on the line from the probes' rate to the large chunks' own (25% lower), not at a median rate the
    # probes' four runs decide: 2 chunks of 3,891,200 read cheaper per element than 4 of half that.
    large_rate = max(10.387 - 2.140, 9.548 - 1.985) / 3_891_200  # first touches: wall less kernel seconds
    assert m.seconds_for(3_891_200) == pytest.approx(large_rate * 3_891_200)
    assert m.seconds_per_element() > 1.1 * large_rate
    assert large_rate < m.seconds_for(2_252_800) / 2_252_800 < m.seconds_per_element()
    curved = timed(rows)  # the same rows, the rates left unchecked: what the planner was told
    curved.time.curve_supported = lambda: True  # type: ignore[method-assign]
    assert curved.time_form() == "quadratic"
    assert curved.seconds_for(2_252_800) < 0.7 * 2_252_800 / 3_891_200 * curved.seconds_for(3_891_200)
    with pytest.raises(ValueError, match="time_curve_margin"):
        OperatorModel(KEY, time_curve_margin=-0.1)
    with pytest.raises(ValueError, match="time_gap_ratio"):
        OperatorModel(KEY, time_gap_ratio=1.0)


def test_rates_that_rise_let_a_curve_stand_that_predicts_held_out_runs_as_well_as_the_line():
    """trace_correlation on 256 x 128 x 200 (heterogeneous benchmark, nights at 6cd1778, the heuristic store's
    first rows: elements, extents, wall and kernel seconds, bytes the run grew its worker, peak). Its seconds per
    element rise with the block (0.30 us at 845,000 elements, 0.38 us at 1,677,000), yet a line with a negative
    constant fits the runs as well as a curve; at the bar of 0.9x the line's leave-one-out error the form read
    linear, and a line is planned through zero at the median rate: 0.27 s for 845,000 elements that measured
    0.23-0.28 s, 0.54 s for 1,677,000 that measured 0.57-0.73 s, so the planner saw no gain in smaller chunks.
    The rise is itself the evidence of a curve: the curve need only do as well as the line. And the line compared
    is the one planned: held at no constant, it misses the runs by far more than the curve, which then stands even
    at the 0.9x bar."""
    rows = [(234_000, (18, 65, 200), 0.035, 0.004, 0, 16_359_424),
            (234_000, (18, 65, 200), 0.051, 0.007, 0, 16_146_432),
            (1_456_000, (112, 65, 200), 0.839, 0.366, 419_995_648, 451_633_152),
            (1_456_000, (112, 65, 200), 0.878, 0.408, 418_795_520, 451_420_160),
            (1_690_000, (130, 65, 200), 0.825, 0.134, 152_137_728, 593_321_984),
            (1_690_000, (130, 65, 200), 1.072, 0.379, 152_285_184, 593_580_032),
            (845_000, (65, 65, 200), 0.230, 0.042, 98_836_480, 161_075_200),
            (845_000, (65, 65, 200), 0.378, 0.122, 98_811_904, 161_218_560),
            (858_000, (66, 65, 200), 0.255, 0.032, 5_513_216, 158_023_680),
            (858_000, (66, 65, 200), 0.271, 0.061, 5_197_824, 157_663_232),
            (845_000, (65, 65, 200), 0.279, 0.040, 0, 152_895_488),
            (845_000, (65, 65, 200), 0.233, 0.025, 0, 152_780_800),
            (1_677_000, (129, 65, 200), 0.873, 0.364, 535_322_624, 597_393_408),
            (1_677_000, (129, 65, 200), 1.101, 0.510, 535_588_864, 597_700_608),
            (1_677_000, (129, 65, 200), 0.625, 0.076, 487_424, 582_742_016),
            (1_677_000, (129, 65, 200), 0.571, 0.071, 749_568, 582_782_976),
            (1_677_000, (129, 65, 200), 0.664, 0.079, 1_085_440, 582_737_920),
            (1_677_000, (129, 65, 200), 0.725, 0.108, 958_464, 582_701_056)]

    def taught(**options: float) -> OperatorModel:
        m = OperatorModel("trace_correlation|float32|cpu", **options)
        for e, ext, secs, sys_secs, grew, peak in rows:
            m.learn(Observation(m.key, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew))
        return m

    before, m = taught(time_rising_gain=0.9), taught()
    assert m.rates_rise()
    fits = m.time_fits()
    assert fits["quadratic"]["press"] < 0.5 * fits["linear"]["press"]  # free, the line's constant was negative: 0.9-1x
    assert before.time_form() in ("quadratic", "superlinear") and m.time_form() in ("quadratic", "superlinear")
    small, large = m.seconds_for(845_000), m.seconds_for(1_677_000)
    assert small == pytest.approx(0.256, rel=0.1) and large == pytest.approx(0.645, rel=0.1)  # measured medians
    line = m.seconds_per_element()
    assert line * 845_000 > 1.05 * small and line * 1_677_000 < 0.9 * large
    with pytest.raises(ValueError, match="time_rising_gain"):
        OperatorModel(KEY, time_rising_gain=1.5)


def test_rates_that_rise_between_two_clusters_of_sizes_are_a_curve_once_the_constant_is_held_at_zero_or_above():
    """trace_correlation's cold map on 192 x 192 x 100 (``python -m benchmarks.heterogeneous`` at c828ad3, its
    store's rows: elements, extents, wall and kernel seconds, bytes the run grew its worker, peak): probes of
    232,800 elements, then 843,900 and 824,500, two clusters 3.6x apart. Its compute per element rose 2.7x
    between them, yet with a free constant every form fit two clusters alike (the line's constant negative),
    leave-one-out kept the line, and the line is planned at the median rate: 4 chunks of 940,900 elements looked
    faster than 6 or 8, and ran 3.3-3.6 s where the heuristic's 6 ran 2.3-3.2 s. With every form's constant
    held at 0 or above, the line misses both clusters and a curve through them is chosen."""
    rows = [(232_800, (24, 97, 100), 0.081, 0.016, 33_034_240, 48_578_560),
            (232_800, (24, 97, 100), 0.092, 0.023, 16_977_920, 48_484_352),
            (843_900, (87, 97, 100), 1.095, 0.623, 539_467_776, 584_871_936),
            (843_900, (87, 97, 100), 1.390, 0.731, 539_246_592, 585_043_968),
            (824_500, (85, 97, 100), 0.623, 0.122, 0, 553_791_488),
            (824_500, (85, 97, 100), 0.747, 0.110, 0, 553_721_856)]
    key = "trace_correlation|float32|cpu"

    def taught(rows: list) -> OperatorModel:
        return timed(rows, key)

    m = taught(rows)
    fits = m.time_fits([100])
    assert all(f["seconds"][0] >= 0 for f in fits.values())  # no form reads a negative constant
    assert 4 * min(fits["superlinear"]["press"], fits["quadratic"]["press"]) < fits["linear"]["press"]
    assert m.rate_ratio() == pytest.approx(2.66, abs=0.05) and m.time_form() in ("superlinear", "quadratic")
    assert m.time_curve_weight() == (1.0, m.time_form())  # a curve named counts whole, not by its weight
    small = statistics.median([0.081 - 0.016, 0.092 - 0.023])  # compute seconds: first touches less kernel time
    large = statistics.median([1.095 - 0.623, 1.390 - 0.731, 0.623, 0.747])
    assert m.seconds_for(232_800) == pytest.approx(small, rel=0.2)
    assert m.seconds_for(834_200) == pytest.approx(large, rel=0.2)
    for e in (232_800, 500_000, 940_900):
        assert m.seconds_for(e) >= 0 and m.seconds_for(2 * e) > 2 * m.seconds_for(e)  # rising rates everywhere
    # The planner now sees smaller chunks cost less per element: 8 of 499,200 elements before 4 of 940,900.
    assert 4 * m.seconds_for(499_200) < 2 * m.seconds_for(940_900)
    # Rates that fall between two clusters (per-task costs weigh on small blocks) leave the line: its constant
    # is positive, nothing is held.
    falling = [(e, ext, secs * 0.3, sys_secs * 0.3, grew, peak) if e > 300_000 else (e, ext, secs, sys_secs, grew, peak)
               for e, ext, secs, sys_secs, grew, peak in rows]  # rates 0.8x the probes'
    assert taught(falling).rate_ratio() < 1
    assert taught(falling).time_form() == "linear" and taught(falling).time.rates_fall()
    assert taught(falling).seconds_for(940_900) / 940_900 < 0.9 * taught(falling).seconds_for(232_800) / 232_800
    # One run per cluster: two runs, fewer than a curve needs (p + 2) for leave-one-out to choose it.
    assert taught([rows[0], rows[4]]).time_form() == "linear"
    # Rates that rise faster than a square (10x over a 3.6x step in size) read as the steepest form, the
    # quadratic, which under-reads the large cluster (measured medians 0.067 and 2.56 s): no form steeper than a
    # square is fitted. (The two-cluster rule this replaced kept the line there, reading the rise as a slow spell.)
    steep = [(e, ext, secs * 4, sys_secs * 4, grew, peak) if e > 300_000 else (e, ext, secs, sys_secs, grew, peak)
             for e, ext, secs, sys_secs, grew, peak in rows]
    fast = taught(steep)
    assert fast.rate_ratio() > 10 and fast.time_form() == "quadratic"
    assert fast.seconds_for(834_200) < 0.5 * statistics.median([4 * (1.095 - 0.623), 4 * (1.390 - 0.731), 4 * 0.623,
                                                                  4 * 0.747])


def test_a_noisy_probe_leaves_the_curve_counting_by_its_leave_one_out_weight_not_dropped():
    """trace_correlation's cold map on 192 x 192 x 100 (``python -m benchmarks.heterogeneous`` at 8b753f0, store
    ``heterogeneous-8b753f0-memchunk-192x192x100-1``, its rows: elements, extents, wall and kernel seconds, bytes
    the run grew its worker, peak). The two probes of one block taught 0.078 and 0.139 s (the second grew its
    worker by just under 16 MiB, so it is not a first touch and keeps its kernel time), the rest 0.45-0.59 s:
    rates 1.22x apart, and leave-one-out preferred the line through zero (0.124 against 0.140). Named linear, the
    time model planned blocks at one rate, and the next warm plan was 4 chunks where 12 ran faster. The best curve
    now counts by its leave-one-out weight: smaller blocks read cheaper per element, by less than the curve says.
    """
    rows = [(232_800, (24, 97, 100), 0.111, 0.033, 32_886_784, 48_857_088),
            (232_800, (24, 97, 100), 0.139, 0.056, 16_748_544, 48_447_488),
            (834_200, (86, 97, 100), 1.063, 0.604, 525_651_968, 571_514_880),
            (834_200, (86, 97, 100), 1.045, 0.596, 526_225_408, 571_895_808),
            (834_200, (86, 97, 100), 0.489, 0.087, 655_360, 566_804_480),
            (834_200, (86, 97, 100), 0.586, 0.101, 1_036_288, 567_435_264)]
    key = "trace_correlation|float32|cpu"
    m = OperatorModel(key)
    for e, ext, secs, sys_secs, grew, peak in rows:
        m.learn(Observation(key, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew))
    fits = m.time_fits([470_000])
    assert m.rate_ratio() == pytest.approx(1.22, abs=0.01) and m.rates_rise()
    assert fits["linear"]["press"] < min(fits["superlinear"]["press"], fits["quadratic"]["press"])
    assert m.time_form() == "linear"  # the form named follows the lower error
    weight, curve = m.time_curve_weight()
    assert curve in ("superlinear", "quadratic")
    assert weight == pytest.approx(_loo_weight(fits[curve]["press"], fits["linear"]["press"], 6))
    assert 0.3 < weight < 0.5  # counted, less than the line
    line, curved = fits["linear"]["seconds"][0], fits[curve]["seconds"][0]
    assert m.seconds_for(470_000) == pytest.approx(weight * curved + (1 - weight) * line)
    assert min(line, curved) < m.seconds_for(470_000) < max(line, curved)
    # What the planner sees: half the block, cheaper per element (the line alone reads the same rate).
    assert m.seconds_for(417_100) / 417_100 < 0.95 * m.seconds_for(834_200) / 834_200
    assert m.summary()["time_curve"] == curve and m.summary()["time_curve_weight"] == pytest.approx(weight)


def test_leave_one_out_weight_is_a_half_at_a_tie_and_follows_the_better_form():
    assert _loo_weight(0.1, 0.1, 6) == pytest.approx(0.5)
    assert _loo_weight(0.01, 0.1, 6) > 0.99  # the curve far better
    assert _loo_weight(1.0, 0.1, 6) < 0.01  # the line far better
    assert _loo_weight(0.05, 0.1, 20) > _loo_weight(0.05, 0.1, 6)  # more runs, surer
    assert _loo_weight(0.1, 0.0, 6) == 0.0 and _loo_weight(math.inf, 0.1, 6) == 0.0


def test_time_fits_give_each_form_s_error_and_predictions_where_asked():
    m = OperatorModel(KEY)
    assert m.time_fits([1000]) == {}
    for e in (100_000, 200_000, 400_000, 800_000, 1_600_000) * 2:  # 1 us per element squared-ish: a curve
        secs = 1e-6 * e * (1 + e / 800_000)
        m.learn(Observation(KEY, e, (1, 1, e), 4 * e, 20 * e, seconds=secs))
    fits = m.time_fits([400_000, 1_600_000])
    assert set(fits) == {"linear", "superlinear", "quadratic"} and all(f["n"] == 10 for f in fits.values())
    assert fits["quadratic"]["press"] < fits["linear"]["press"]
    assert fits["quadratic"]["seconds"] == [pytest.approx(0.6, rel=0.05), pytest.approx(4.8, rel=0.05)]


def test_a_cold_start_s_waves_alone_do_not_stand_a_time_curve_on_leave_one_out():
    """gst3d_dip's cold map on 256 x 128 x 200 (heterogeneous benchmark, its store's rows): two probes of 228,000
    elements, two of 896,800 (3.9x), then 2,969,600 and 3,302,400; seconds per element flat (ratio 0.99). Each
    wave's twin stays in the fit when one chunk is left out, so leave-one-out never tested the 3.9x gaps and a
    superlinear form won there; with gaps up to 3x allowed it is a line. Rates that rise support a curve."""
    rows = [(228_000, (15, 76, 200), 0.248, 0.032, 40_112_128), (228_000, (15, 76, 200), 0.253, 0.025, 39_981_056),
            (896_800, (59, 76, 200), 0.723, 0.046, 154_050_560), (896_800, (59, 76, 200), 0.834, 0.198, 154_001_408),
            (2_969_600, (116, 128, 200), 3.303, 0.990, 510_652_416),
            (3_302_400, (129, 128, 200), 3.542, 0.855, 567_836_672)]

    def taught(rows: list, **options: float) -> OperatorModel:
        m = OperatorModel(KEY, **options)
        for e, ext, secs, sys_secs, peak in rows:
            m.learn(Observation(KEY, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=0))
        return m

    m = taught(rows)
    assert m.rate_ratio() == pytest.approx(0.99, abs=0.01) and not m.curve_supported()
    assert m.time_form() == "linear"
    assert taught(rows, time_gap_ratio=4.0).time_form() == "superlinear", "the 3.9x gaps let the curve stand"
    rising = [(e, ext, secs * (e / 228_000) ** 0.5, sys_secs, peak) for e, ext, secs, sys_secs, peak in rows]
    assert taught(rising).rates_rise() and taught(rising).curve_supported()


def test_time_that_grows_with_the_square_of_the_block_is_learned_and_a_line_is_left_to_the_median():
    rng = random.Random(5)
    quad, lin = OperatorModel(KEY), OperatorModel(KEY)
    for k in range(24):
        ext = SIZES[k % len(SIZES)]
        e = elements(ext)
        noise = 1 + rng.gauss(0, 0.03)
        quad.learn(Observation(KEY, e, ext, 4 * e, int(gst(e)), seconds=(0.02 + 1e-12 * e * e) * noise))
        lin.learn(Observation(KEY, e, ext, 4 * e, int(gst(e)), seconds=(2e-6 * e) * noise))
    assert quad.time_form() == "quadratic" and lin.time_form() == "linear"
    big = 2_000_000  # beyond the largest block seen (1.2 M elements)
    assert quad.seconds_for(big) == pytest.approx(0.02 + 1e-12 * big * big, rel=0.15)
    assert lin.seconds_for(big) is None, "proportional: the planner uses the median seconds per element"
    assert lin.summary()["time_form"] == "linear" and lin.summary()["seconds_per_element"] > 0


def test_a_worker_s_first_touch_of_memory_does_not_teach_time_and_a_quadratic_under_it_is_found():
    """trace_correlation in a heterogeneous benchmark run: the same block took 1.63-1.75 s on a worker's first
    call (its Gram matrix faulted in for the first time) and 0.40-0.45 s later; fitted together the line won and
    the planner cut 4 chunks where 6 were faster. Runs that grew the worker teach time only when nothing else
    has: a cold start's probes still give a seconds-per-element figure."""
    rng = random.Random(11)
    sizes = [200_000, 400_000, 600_000, 834_200, 1_000_000]

    def run(e: int, first: bool) -> Observation:
        steady = (0.02 + 5e-13 * e * e) * (1 + rng.gauss(0, 0.02))
        peak = int(8 * e + 20 * MIB)
        secs = steady + (1.2 if first else 0.0) * peak / (545 * MIB)  # ~1.2 s per 545 MiB faulted in
        return Observation(KEY, e, (1, 1, e), 4 * e, peak, seconds=secs, grew_bytes=peak if first else 0)

    m, unaware = OperatorModel(KEY), OperatorModel(KEY)
    for k in range(20):
        e = sizes[k % len(sizes)]
        obs = run(e, first=k < 2 * len(sizes))  # two workers, each touching every size once first
        m.learn(obs)
        unaware.learn(Observation(**{**obs.to_dict(), "grew_bytes": None}))
    assert m.time_form() == "quadratic"
    assert m.seconds_for(834_200) == pytest.approx(0.02 + 5e-13 * 834_200**2, rel=0.15)
    # Over the sizes run and one 1.6x beyond them, the fit that knew the first touches stays within 10%; the one
    # that fitted them is off by more than 15% somewhere (it read 1.00 s for 1.6 M elements where 1.30 s is true).
    probe_sizes = (200_000, 400_000, 600_000, 1_000_000, 1_600_000)

    def worst(model: OperatorModel) -> float:
        got = [model.seconds_for(e) or model.seconds_per_element() * e for e in probe_sizes]
        return max(abs(g / (0.02 + 5e-13 * e * e) - 1) for g, e in zip(got, probe_sizes))

    assert worst(m) < 0.10 < 0.15 < worst(unaware)

    cold = OperatorModel(KEY)
    cold.learn(run(200_000, first=True))
    assert cold.seconds_per_element() is not None and cold.seconds_per_element() > 0
    assert not cold.first_touch(Observation(KEY, 10, (1, 1, 10), 40, 100 * MIB, grew_bytes=16 * MIB))


def test_first_touches_teach_time_less_their_kernel_time_so_a_cold_start_finds_the_quadratic():
    """A cold start on fresh workers: every probe wave is larger than any block before it, so every run but the
    repeats grows its worker (a first touch). Set aside, they left trace_correlation's time a line (two clean
    sizes in the heterogeneous benchmark's store) and the planner cut it in 4 where 8 halves of a quarter the
    time each were faster. Less their kernel CPU time (``sys_seconds``, where the faulting lands:
    benchmarks.studies.first_touch), they teach the quadratic."""
    rng = random.Random(5)

    def run(e: int, first: bool) -> Observation:
        steady = (0.02 + 5e-13 * e * e) * (1 + rng.gauss(0, 0.03))
        peak = int(8 * e + 20 * MIB)
        zeroing = 0.05 * steady  # the kernel time every large allocation pays, first touch or not
        touch = 1.2 * peak / (545 * MIB) if first else 0.0  # ~1.2 s per 545 MiB faulted in for the first time
        return Observation(KEY, e, (1, 1, e), 4 * e, peak, seconds=steady + touch, sys_seconds=zeroing + touch,
                           grew_bytes=peak if first else 0)

    rows = [run(e, first=True) for e in (200_000, 400_000, 600_000, 834_200, 1_000_000) for _ in range(2)]
    rows += [run(1_000_000, first=False) for _ in range(2)]
    m, unaware = OperatorModel(KEY), OperatorModel(KEY)
    for obs in rows:
        m.learn(obs)
        unaware.learn(dataclasses.replace(obs, sys_seconds=None))
    assert m.compute_seconds(rows[0]) == pytest.approx(rows[0].seconds - rows[0].sys_seconds)
    assert m.compute_seconds(rows[-1]) == rows[-1].seconds, "a run that did not grow its worker keeps its wall time"
    assert unaware.compute_seconds(dataclasses.replace(rows[0], sys_seconds=None)) is None
    assert m.time_form() == "quadratic" and unaware.time_form() == "linear"
    for e in (400_000, 600_000):  # half and two thirds of the largest: where a plan of more chunks would cut
        assert m.seconds_for(e) == pytest.approx(0.02 + 5e-13 * e * e, rel=0.15)
    # The line from the one clean size reads half the largest block at half its time: twice what it costs.
    line = unaware.seconds_per_element() * 500_000
    assert line > 1.5 * (0.02 + 5e-13 * 500_000**2)


def test_a_prediction_below_the_blocks_own_bytes_does_not_teach_the_margin():
    """Regression (a quick benchmark's store, 2026-11-23): three probes whose peaks fell as blocks grew fitted a
    line sloping down; its mean for the next, 60x larger block was ~1 byte, the ratio needed / predicted 41
    million, and the learned margin made every later plan need terabytes (BudgetTooSmallError)."""
    key = "envelope|float32|cpu"
    m = OperatorModel(key)
    rows = [(6400, (1, 16, 400), 7172096), (12800, (1, 32, 400), 8896512), (19200, (1, 48, 400), 5873664),
            (1209600, (63, 48, 400), 26931200), (1209600, (63, 48, 400), 33366016),
            (1228800, (32, 96, 400), 27525120), (1228800, (32, 96, 400), 39096320)]
    peaks = [16306176, 23302144, 21155840, 23801856, 29560832, 19054592, 19386368, 19341312, 10604544, 17874944,
             21585920, 28053504, 23429120, 17649664, 19087360, 22683648]
    rows += [(307200, (8, 96, 400), p) for p in peaks]
    for elements, extents, peak in rows:
        m.learn(Observation(key, elements, extents, 4 * elements, peak, seconds=0.05))
    margin = m.conformal_factor()
    assert margin is not None and margin < 5, margin
    assert m.predict((8, 96, 400)).upper_bytes < 2**30


def test_a_form_fit_from_running_sums_and_a_press_window_equals_the_fit_over_every_row(monkeypatch):
    """The residual sum of squares comes from running sums (O(1) per refit); PRESS from the latest window."""
    import numpy as np

    from memchunk_prefect.learn import forms as m

    rng = np.random.default_rng(4)
    us = rng.uniform(0.01, 4.0, 60)
    ys = 3.0 + 40.0 * us * rng.uniform(0.9, 1.1, 60)
    monkeypatch.setattr(m, "PRESS_WINDOW", 25)
    form = m._Form(m.LINEAR, prior_variance=1e4, curvature_sd=2.5)
    for u, y in zip(us, ys):
        form.learn(u, y, float(np.hypot(y, 1.0)))
    fit = form.fit(prior_s=0.1, prior_dof=2.0, min_s=0.0)
    scale = np.hypot(ys, 1.0)
    # The fit's rows, in the form's units (the largest block learned, and its scale).
    X = np.stack([np.ones_like(us), us / form.u_ref], axis=1) * (form.y_ref / scale[:, None])
    y = ys / scale
    assert form.u_ref > us.max() / m.REFIT_GROWTH
    resid = y - X @ fit.coef
    assert fit.s == pytest.approx(np.sqrt((2.0 * 0.1**2 + resid @ resid) / (2.0 + 60 - 2)), rel=1e-9)
    last = slice(60 - 25, 60)
    lev = np.einsum("ij,jk,ik->i", X[last], fit.cov, X[last])
    assert fit.press == pytest.approx(np.mean((resid[last] / (1 - lev)) ** 2), rel=1e-9)
    assert form.max_per_u == pytest.approx(max(ys / us))


def test_a_heavy_operator_on_small_blocks_is_learned_as_measured_not_shrunk_by_the_prior():
    """Regression (python -m benchmarks.many_chunks, cold store, 2026-11-24): three clean probes of memory_hog
    (~3.9 KiB per element) on blocks of 5,200-16,100 elements lie on a line, but a prior of variance 1e6 in MiB per
    Mi-element outweighed them: the fit read 113 bytes per element plus a 30 MiB fixed part, one trace's bound was
    92 MiB and the map stopped with BudgetTooSmallError under a 48 MiB budget. Fitted in the form's own units the
    probes say what they measured."""
    key = "memory_hog[multiple=1000]|float32|cpu"
    m = OperatorModel(key)
    for elements, peak in [(5200, 24141824), (10400, 45215744), (16100, 64462848)]:
        m.learn(Observation(key, elements, (1, elements // 100, 100), 4 * elements, peak, seconds=0.1))
    s = m.summary()
    assert s["bytes_per_element"] == pytest.approx(3789, rel=0.02)
    assert s["fixed_overhead_bytes"] == pytest.approx(4.4 * MIB, abs=1 * MIB)
    one_trace = m.predict((1, 1, 100))
    assert one_trace.upper_bytes < 48 * MIB / 2, one_trace


@pytest.mark.parametrize("bytes_per_element", [8, 240, 4000, 2e5])
def test_what_is_learned_does_not_depend_on_the_operators_scale(bytes_per_element):
    """The same stream scaled by 25,000x in cost per element is learned the same, relative to its scale (peaks of
    kilobytes are another matter: below the model's 4 MiB noise floor the bound is set by the floor, so at 8 bytes
    per element, peaks of 0.07-1.3 MiB, its excess over the truth is held in bytes, under a quarter of the floor)."""
    sizes = [(1, n, 100) for n in (50, 100, 150, 400, 800)]
    m = OperatorModel(KEY)
    for k, ext in enumerate(sizes * 2):
        e = elements(ext)
        m.learn(obs(ext, (2 * MIB * (bytes_per_element / 240) + bytes_per_element * e) * (1 + 0.02 * (-1) ** k)))
    s = m.summary()
    assert s["bytes_per_element"] == pytest.approx(bytes_per_element, rel=0.05)
    p = m.predict((1, 1600, 100))
    truth = 2 * MIB * (bytes_per_element / 240) + bytes_per_element * 160_000
    assert truth <= p.upper_bytes
    if truth > 4 * MIB:
        assert p.upper_bytes <= 1.3 * truth
    else:
        assert p.upper_bytes - truth <= MIB


def test_runs_at_sizes_a_few_percent_apart_do_not_make_the_model_ready():
    """Regression (python -m benchmarks.heterogeneous, heuristic-warm, 2026-11-24): a cold probe of
    trace_correlation was killed and split, so every run it learned sat within 2% of one size; two 'distinct'
    sizes made the model ready, the line through them read 0 bytes for a 3 x 3-trace block with an upper bound of
    2.7 GiB, and the next run stopped with BudgetTooSmallError before running anything. Too close to tell a
    fixed part from a slope: not ready (the runner probes another size), and no mean below the block's bytes."""
    key = "trace_correlation|float32|cpu"
    m = OperatorModel(key)
    m.learn(Observation(key, 1862400, (192, 97, 100), 4 * 1862400, 765_984_768, outcome="killed", censored=True))
    for elements, extents, peak in [(960000, (192, 50, 100), 757_927_936), (940800, (192, 49, 100), 719_323_136),
                                    (940900, (97, 97, 100), 719_630_336), (940900, (97, 97, 100), 719_630_336)]:
        m.learn(Observation(key, elements, extents, 4 * elements, peak, seconds=1.0))
    p = m.predict((3, 3, 100))
    assert not p.ready and "less than 1.5x apart" in p.reason, p
    m.learn(Observation(key, 470400, (96, 49, 100), 4 * 470400, 195_000_000, seconds=0.3))
    small, half = m.predict((3, 3, 100)), m.predict((96, 48, 100))
    assert small.ready and small.upper_bytes < 64 * MIB, small
    assert half.mean_bytes >= 4 * 96 * 48 * 100 and half.tight_bytes >= half.mean_bytes, half


def test_beyond_two_sizes_the_bound_grows_at_least_quadratically_until_curvature_can_be_fitted():
    """Two probe sizes: a line through them under-predicts every larger block of an operator quadratic in its
    block. Until a third size and enough runs let the quadratic form be fitted, the bound beyond the largest
    block grows as the square of the size, for a linear operator as well: two sizes cannot tell them apart.
    A third size gives the bound back to the fit, and the linear operator's to its line."""
    quad, lin = OperatorModel(KEY), OperatorModel(KEY)
    for n in (1000, 1000, 4000, 4000):
        ext = (1, n // 100, 100)
        quad.learn(obs(ext, 2 * MIB + 40.0 * n * n))  # 8 N^2-like: 40 bytes per element squared
        lin.learn(obs(ext, 2 * MIB + 240 * n))
    big = (1, 60, 100)  # 1.5x the largest block measured
    truth = 2 * MIB + 40.0 * 6000 ** 2
    p = quad.predict(big)
    assert p.ready and p.upper_bytes >= 0.95 * truth and p.tight_bytes >= 0.95 * truth, (p, truth)
    assert "grows as size^" in p.reason
    line = lin.predict(big)
    assert "grows as size^2.00" in line.reason
    assert line.upper_bytes == pytest.approx((2 * MIB + 240 * 4000) * 1.5 ** 2, rel=0.01), line
    # A third size and enough runs: the forms are fitted, and the rule gives way to them.
    for n in (2000, 6000):
        quad.learn(obs((1, n // 100, 100), 2 * MIB + 40.0 * n * n))
        lin.learn(obs((1, n // 100, 100), 2 * MIB + 240 * n))
    assert "grows as" not in quad.predict(big).reason and quad.predict(big).upper_bytes >= 0.95 * truth
    farther = lin.predict((1, 90, 100))
    assert "grows as" not in farther.reason and farther.upper_bytes < 1.2 * (2 * MIB + 240 * 9000), farther


def test_two_sizes_whose_small_peaks_hide_a_quadratic_phase_bound_a_far_block_as_quadratic():
    """Regression (``python -m benchmarks.sim_validation --scale 4``, workload w2: 2 workers x 600 MiB x 2
    threads, a zarr survey of 200 x 200 x 200): the cold probes of an operator whose memory is 8 bytes per pair
    of traces (a Gram matrix) peaked 8-9 MiB at 312 traces and 16-18 MiB at 1,404. A block's peak is the largest
    of its phases, and at 312 traces reading the block (not the 0.8 MiB matrix) set it, so the two sizes grew
    as size^0.46. The line's bound, blended with the quadratic fitted through both sizes, read 330 MiB for
    91 x 102 traces, 6.4x the largest probe; both such chunks needed over 434 MiB (the matrix alone is
    657 MiB) and took their workers and seven other chunks with them. With two sizes, the bound beyond them is
    the largest peak times the square of the reach."""
    key = "fam_gram|float32|cpu"
    m = OperatorModel(key)
    for extents, peak_mib in [((6, 52, 200), 8.9), ((6, 54, 200), 9.0), ((6, 54, 200), 7.6), ((6, 52, 200), 7.8),
                              ((27, 52, 200), 17.0), ((27, 54, 200), 18.3), ((27, 54, 200), 17.3),
                              ((27, 52, 200), 16.1)]:
        elements = math.prod(extents)
        m.learn(Observation(key, elements, extents, 4 * elements, peak_mib * MIB, seconds=0.05))
    far = (91, 102, 200)
    needed = 8.0 * (91 * 102) ** 2
    p = m.predict(far)
    assert p.ready and p.upper_bytes >= needed and p.tight_bytes >= needed, p
    # Inside the sizes measured, the fit is what it was.
    assert m.predict((27, 54, 200)).upper_bytes < 25 * MIB


def test_a_quadratic_operator_measured_at_two_close_large_sizes_is_bounded_beyond_them():
    """Regression (python -m benchmarks.heterogeneous, 2026-11-24 17:06, survey 192 x 192 x 100): the six cold
    runs of trace_correlation (memory 8 N^2 bytes for N traces), two of them 2.4% apart in size and 5.6% in peak.
    River's noise precision is fixed (beta = 1 on relative targets), so a curvature prior of sd 2.5 acted as
    2.5 x the measured noise (2.8%): the quadratic's curvature was shrunk to 0.003 of the ~1 the runs hold, and
    the bound at 940,900 elements (1.11x the largest block, where the warm plan went) read 670 MiB, under the
    694 MiB measured there; the tight bound the bold arm plans with, 663 MiB."""
    key = "trace_correlation|float32|cpu"
    m = OperatorModel(key)
    for extents, peak in [((24, 97, 100), 48_513_024), ((24, 97, 100), 48_312_320),
                          ((87, 97, 100), 584_949_760), ((87, 97, 100), 584_937_472),
                          ((85, 97, 100), 554_000_384), ((85, 97, 100), 553_771_008)]:
        elements = math.prod(extents)
        m.learn(Observation(key, elements, extents, 4 * elements, peak, seconds=1.0))
    p = m.predict((97, 97, 100))
    measured = 694.3 * MIB
    assert p.ready and m.form() != "linear", (p, m.form())
    assert p.tight_bytes >= measured and p.upper_bytes >= measured, p
    assert p.mean_bytes == pytest.approx(measured, rel=0.05), p
    # Fitted with the curvature free, the quadratic falls before it rises (a negative per-element cost from the
    # two close sizes' noise); memory does not fall as a block grows, so it is fitted with that cost held at 0.
    assert m.summary()["bytes_per_element"] >= 0.0


def test_a_memory_curve_fitted_across_a_gap_the_runs_do_not_support_is_not_planned_by():
    """Regression (python -m benchmarks, 2026-11-26, store kept as stores-2026-11-26/full4-b4e3440-memchunk-store-1):
    gaussian_smooth's cold run, probes of 0.13-0.24 M elements, then 1.90 M and 2.25 M, an 8x gap. The two top
    sizes rose a little more steeply than the line from the probes, so the superlinear form won on leave-one-out
    error and read 43.4 MiB for the warm chunk (72 x 128 x 400), which peaked 35.0 MiB. Its bytes per element
    fall with size: nothing supports a curve. Linear, the mean is within 5% of the peak and the tight bound
    within 1.15x; the upper bound still leans towards the curve."""
    key = "gaussian_smooth[sigma=2,2,2]|float32|cpu"
    rows = [((9, 58, 400), 8806400), ((9, 66, 400), 7913472), ((66, 72, 400), 22233088),
            ((66, 72, 400), 22724608), ((78, 72, 400), 26013696), ((78, 72, 400), 26202112),
            ((9, 36, 400), 9842688)]
    measured = 36675584  # (72, 128, 400), the warm chunk's peak

    def taught(**options):
        m = OperatorModel(key, **options)
        for extents, peak in rows:
            m.learn(obs(extents, peak, key=key))
        return m

    m = taught()
    assert not m.memory_curve_supported() and m.form() == "linear"
    p = m.predict((72, 128, 400))
    before = taught(memory_gap_ratio=math.inf)  # any gap supports a curve: the model before the test
    curve = before.predict((72, 128, 400))
    assert before.form() == "superlinear" and curve.mean_bytes > 1.2 * measured and curve.tight_bytes > 1.3 * measured
    assert p.mean_bytes == pytest.approx(measured, rel=0.05), p
    # Neither taken nor ruled out, the curve's mean is what the tight bound holds; its own margin is not added.
    assert p.tight_bytes == pytest.approx(curve.mean_bytes, rel=0.01) and measured <= p.tight_bytes <= 1.25 * measured
    assert p.upper_bytes > p.tight_bytes  # the curve's bound still counts in the upper one
    with pytest.raises(ValueError, match="memory_gap_ratio"):
        OperatorModel(key, memory_gap_ratio=1.0)
    with pytest.raises(ValueError, match="memory_curve_margin"):
        OperatorModel(key, memory_curve_margin=-1.0)
    with pytest.raises(ValueError, match="memory_gap_gain"):
        OperatorModel(key, memory_gap_gain=1.5)


def test_an_unsupported_memory_curve_holds_the_tight_bound_where_the_operator_does_curve():
    """Regression (python -m benchmarks.heterogeneous at 2effcc0, survey 256 x 128 x 200): envelope's cold run,
    probes of 243,200 elements, then 1.28 M and 1.75 M (a 5.3x gap), the superlinear form ahead of the line on
    leave-one-out error. Its memory does curve: the warm chunk of 3.28 M elements peaked 66.7 MiB, and the line's
    tight bound read 60.4 MiB (0.91x), which the bold arm plans to. The curve's mean holds it."""
    key = "envelope|float32|cpu"
    m = OperatorModel(key)
    for extents, peak in [((19, 64, 200), 9752576), ((19, 64, 200), 11530240), ((137, 64, 200), 35409920),
                          ((137, 64, 200), 35016704), ((50, 128, 200), 25698304), ((50, 128, 200), 25493504)]:
        m.learn(obs(extents, peak, key=key))
    p = m.predict((128, 128, 200))
    measured = 69959680
    assert m.form() == "linear" and m.memory._unsupported_curve() == "superlinear"
    assert p.mean_bytes < 0.9 * measured, p  # the line's mean under-reads
    assert measured <= p.tight_bytes <= 1.25 * measured, p


def test_a_memory_curve_across_a_gap_stands_where_it_predicts_held_out_blocks_far_better_than_the_line():
    """An operator quadratic in its traces with a fixed cost of its own: its bytes per element fall with size
    and the sizes leave an 18x gap, so nothing but leave-one-out supports the curve; there it wins by far
    (under memory_gap_gain of the line's error), and the mean follows the quadratic beyond the largest block.
    Taken as a line, the tight bound would under-read the next chunk."""
    def taught(**options):
        m = OperatorModel(KEY, **options)
        for ext in [(10, 10, 100), (12, 12, 100), (14, 14, 100), (60, 60, 100), (66, 66, 100)]:
            for _ in range(2):
                m.learn(obs(ext, quadratic_in_traces(elements(ext))))
        return m

    m = taught()
    assert not m.memory_curve_supported() and m.form() != "linear"
    for ext in [(72, 72, 100), (90, 90, 100)]:
        p = m.predict(ext)
        assert p.mean_bytes == pytest.approx(quadratic_in_traces(elements(ext)), rel=0.05), (ext, p)
    line = taught(memory_gap_gain=0.0)  # an unsupported curve never taken
    assert line.form() == "linear" and line.predict((90, 90, 100)).tight_bytes < quadratic_in_traces(90 * 90 * 100)


def test_a_curved_fit_held_at_zero_slope_is_the_same_update_river_makes_on_the_features_kept():
    """The slope-held-at-0 posterior is computed from the sums a form keeps, not by River: it must be the
    conjugate update River would make on the two features left (same prior, beta = 1)."""
    from river import linear_model

    form = _Form("quadratic", 1e6, 250.0)
    river = linear_model.BayesianLinearRegression(alpha=1e-6, beta=1.0)
    rng = random.Random(3)
    for u in (0.2, 0.2, 0.9, 0.92, 1.0, 1.0):
        y = 40.0 * u * u + 3.0 + rng.uniform(-1, 1)
        form.learn(u, y, y)
    for u, y, scale in form._rows:  # in the units the form settled on (it refits as larger blocks arrive)
        x = form.design(u, scale)
        river.learn_one({"const": x[0], "u^2": x[2]}, y / scale)
    coef, cov = form._without([1])
    assert coef[1] == 0.0 and cov[1, 1] == 0.0
    assert coef[0] == pytest.approx(river.predict_one({"const": 1.0, "u^2": 0.0}), rel=1e-6)
    assert coef[2] == pytest.approx(river.predict_one({"const": 0.0, "u^2": 1.0}), rel=1e-6)
    var_c = river.predict_one({"const": 0.0, "u^2": 1.0}, with_dist=True).sigma ** 2 - 1.0
    assert cov[2, 2] == pytest.approx(var_c, rel=1e-4)



def _run(key: str, extents: tuple[int, int, int], peak_mib: float, outcome: str = "ok") -> Observation:
    n = extents[0] * extents[1] * extents[2]
    return Observation(key, n, extents, 4 * n, int(peak_mib * MIB), outcome=outcome)


def test_the_floor_of_repeated_blocks_is_the_best_any_shape_only_predictor_reaches():
    """The floor is what the best constant per block shape scores, found here by brute force over a fine grid;
    shapes run once, other keys and runs that are not ``ok`` are left out."""
    rng = random.Random(7)
    key = "op|float32|cpu"
    # Skewed on purpose: the plain median (20) is not the best constant here (10 is), and the 95% bound of 40
    # runs leaves the two highest out (32 MiB, not the 50 MiB outlier).
    groups = {(4, 10, 100): [10.0, 10.0, 20.0, 20.0, 20.0],
              (8, 10, 100): [30.0] * 36 + [31.0, 32.0, 33.0, 50.0]}
    rows = [_run(key, e, p) for e, ps in groups.items() for p in ps]
    rows += [_run(key, (2, 10, 100), 99.0),  # one run: no spread to learn from
             _run("other|float32|cpu", (4, 10, 100), 500.0),
             _run(key, (4, 10, 100), 400.0, outcome="memory_error")]
    rng.shuffle(rows)
    r = repeatability(rows, key)
    assert (r["groups"], r["runs"]) == (2, 45)
    best_total = bound_total = 0.0
    for peaks in groups.values():
        ys = [int(p * MIB) for p in peaks]
        grid = [min(ys) + (max(ys) - min(ys)) * i / 20_000 for i in range(20_001)]
        best_total += min(sum(abs(c - y) / y for y in ys) for c in grid)
        covering = sorted(ys)[math.ceil(0.95 * len(ys)) - 1]  # the least constant under which 95% of the peaks lie
        assert sum(y <= covering for y in ys) >= 0.95 * len(ys)
        bound_total += sum(covering / y for y in ys)
    assert r["floor_mape"] == pytest.approx(best_total / 45, rel=1e-4)
    assert r["floor_bound_over_peak"] == pytest.approx(bound_total / 45)


def test_no_repeated_block_gives_no_floor():
    key = "op|float32|cpu"
    r = repeatability([_run(key, (i, 10, 100), 10.0 * i) for i in range(1, 6)], key)
    assert r == {"key": key, "runs": 0, "groups": 0, "floor_mape": None, "floor_bound_over_peak": None}
    assert repeatability([_run(key, (1, 10, 100), 10.0)] * 3, key, min_repeats=4)["floor_mape"] is None


def test_replay_quality_tells_extrapolated_runs_from_runs_inside_the_sizes_learned():
    """Runs are counted beyond when their block is larger than every block learned before them (by 5%)."""
    from benchmarks.quality import replay_quality

    key = "op|float32|cpu"
    sizes = [10, 20, 30, 40, 50, 60, 30, 40, 120, 50, 240]  # 60, 120 and 240 are beyond; 30, 40, 50 inside
    rows = [_run(key, (n, 10, 100), 2.0 + 0.01 * n * 1000 / MIB * 100) for n in sizes]
    q = replay_quality(rows, key)
    assert q["scored"] == 6
    assert q["scored_beyond"] == 3
    assert q["mape_within"] is not None and q["mape_beyond"] is not None
    assert q["mape"] == pytest.approx((q["mape_within"] * 3 + q["mape_beyond"] * 3) / 6)


# gaussian_smooth sigma 2 in the full benchmark (2026-11-25, `python -m benchmarks --workdir D`, D/memchunk-store.sqlite
# through `memchunk export`): (extents read, halo included; peak bytes) in the order they ran. Memory per element
# falls from 37 to 8.6 bytes as the block grows: a fixed part that is not fixed over the probes, then a line.
GAUSSIAN_RUNS = [((9, 58, 400), 7774208), ((9, 66, 400), 8044544), ((66, 72, 400), 27983872),
                 ((66, 72, 400), 29462528), ((78, 72, 400), 33103872), ((78, 72, 400), 35221504),
                 ((9, 36, 400), 10158080), ((72, 128, 400), 35885056), ((72, 128, 400), 38342656),
                 ((136, 128, 400), 63934464), ((136, 128, 400), 64765952), ((264, 128, 400), 116375552),
                 ((264, 128, 400), 116137984)]


@pytest.mark.parametrize("size_weight, within", [(0.5, True), (0.0, False)])
def test_a_concave_start_does_not_bend_the_line_the_large_blocks_follow(size_weight, within):
    """The real runs above, each predicted before it is learned: the blocks at 1.9x and 3.7x the probes' largest
    (the sizes the planner chose) are read within 10% of their peaks and under the upper bound once small blocks
    count less than large ones; with every block counting alike (size_weight 0) the slope bent to the probes
    read at least one of them more than 10% high."""
    m = OperatorModel("gaussian_smooth[sigma=2,2,2]|float32|cpu", size_weight=size_weight)
    errors = []
    for k, (ext, peak) in enumerate(GAUSSIAN_RUNS):
        if k >= 9:
            p = m.predict(ext)
            assert p.ready and peak <= p.upper_bytes, (ext, peak, p)
            errors.append(abs(p.mean_bytes / peak - 1))
        m.learn(obs(ext, peak, key="gaussian_smooth[sigma=2,2,2]|float32|cpu"))
    assert (max(errors) <= 0.10) == within, errors


def test_a_first_call_of_about_a_blocks_size_says_what_a_fresh_workers_first_task_of_it_takes():
    """Probes of 20,000-40,000 elements after the first calls read 2 us per element (a per-task cost weighs on
    them); the first calls of 600,000 elements took 0.40-0.44 s in all. A first task of 640,000 elements takes
    what those took, scaled by the model's growth (proportional here: 0.42 s x 640/600); a size no first call was
    near (within min_size_ratio) says nothing."""
    t = TimeModel()
    for s in (0.40, 0.44):
        t.learn(Observation(KEY, 600_000, (1, 1, 600_000), 2_400_000, MIB, seconds=s, first_call=True))
    for n in (20_000, 40_000, 20_000, 40_000):
        t.learn(Observation(KEY, n, (1, 1, n), 4 * n, MIB, seconds=2e-6 * n))
    assert 2e-6 * 640_000 == pytest.approx(1.28)  # the probes' rate, which the first calls bound the block below
    assert t.block_compute_seconds(640_000) == pytest.approx(0.44 * 640 / 600)  # (TimeModel.first_call_ceiling)
    assert t.first_call_block_seconds(640_000) == pytest.approx(0.44 * 640 / 600)  # the upper middle of two
    assert t.first_call_block_seconds(1_000_000) is None and t.first_call_block_seconds(300_000) is None
    # A run of many workers at another size (25 first calls of 100,000 elements) does not push out the first calls
    # of this size: the window is of those near the size.
    for _ in range(25):
        t.learn(Observation(KEY, 100_000, (1, 1, 100_000), 400_000, MIB, seconds=0.1, first_call=True))
    assert t.first_call_block_seconds(640_000) == pytest.approx(0.44 * 640 / 600)


def test_the_time_spread_is_1_4826_times_the_median_miss_from_the_model_from_five_timed_runs():
    """Five runs of one block size, off the median rate by factors e^-0.4 .. e^0.3: the model is the median run, the
    misses 0.4, 0.2, 0, 0.1 and 0.3, their median 0.2; four runs say nothing."""
    t = TimeModel()
    n = 100_000
    for i, x in enumerate((0.0, 0.1, -0.2, 0.3, -0.4)):
        assert (t.time_spread() is None) == (i < 5)
        t.learn(Observation(KEY, n, (1, 1, n), 4 * n, MIB, seconds=0.5 * math.exp(x)))
    assert t.time_spread() == pytest.approx(1.4826 * 0.2)


@pytest.mark.parametrize("sigma", [0.02, 0.3])
def test_how_far_runs_stray_from_the_time_model_is_learned_as_a_log_normal_spread(sigma):
    """Runs of a block timed at 1 us per element, each off by a log-normal factor of ``sigma``: the spread learned
    is that sigma, within what 20 runs can tell; first calls (a one-off cost beside the block) are not counted,
    and fewer than MIN_SPREAD_RUNS timed runs say nothing."""
    from memchunk_prefect.learn.time import MIN_SPREAD_RUNS

    rng = random.Random(3)
    t = TimeModel()
    sizes = [200_000, 400_000] * 10
    for i, n in enumerate(sizes):
        if i == MIN_SPREAD_RUNS - 1:
            assert t.time_spread() is None  # MIN_SPREAD_RUNS - 1 timed runs so far
        t.learn(Observation(KEY, n, (1, 1, n), 4 * n, MIB, seconds=1e-6 * n * math.exp(rng.gauss(0.0, sigma))))
        t.learn(Observation(KEY, n, (1, 1, n), 4 * n, MIB, seconds=5.0, first_call=True))  # far off: not counted
    assert t.time_spread() == pytest.approx(sigma, rel=0.5)
    assert t.summary()["time_spread"] == t.time_spread()
