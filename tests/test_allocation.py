"""The allocation model: queue waits, per-job utilisation and P(U(T0) >= U0), against brute force (milliseconds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from memchunk_prefect.core.errors import SimulationInputError
from memchunk_prefect.sim.allocation import QueueWait, held_fraction, monte_carlo, p_utilisation

HOUR = 3600.0
U = np.random.default_rng(1).beta(8, 2, 400)  # per-job utilisation, mean 0.8


@pytest.mark.parametrize("wait, jobs, window, walltime, target", [
    ("lognormal:10min,1h", 4, 3 * HOUR, 4 * HOUR, 0.7),
    ("lognormal:10min,1h", 50, 2 * HOUR, 4 * HOUR, 0.6),
    ("exp:20min", 1, HOUR, None, 0.5),
    ("exp:20min", 8, 1800.0, 4 * HOUR, 0.3),
    ("exp:5min", 200, HOUR, 1800.0, 0.68),
    ("30min", 16, HOUR, None, 0.4),
])
def test_the_convolution_is_what_drawing_the_models_own_assumptions_gives(wait, jobs, window, walltime, target):
    q = QueueWait.parse(wait)
    m = p_utilisation(q, U, jobs=jobs, window=window, target=target, walltime=walltime)
    draws = 20_000
    brute = monte_carlo(q, U, jobs=jobs, window=window, target=target, walltime=walltime, draws=draws, seed=7)
    se = math.sqrt(max(brute * (1 - brute), 1e-4) / draws)
    assert abs(m.p_exact - brute) < 4 * se + 0.005, (m, brute)
    assert 0.0 <= m.p_exact <= 1.0 and 0.0 <= m.p_normal <= 1.0


def test_the_normal_approximation_agrees_for_many_jobs_and_not_for_one():
    q = QueueWait.parse("exp:10min")
    many = p_utilisation(q, U, jobs=400, window=HOUR, target=0.67)
    assert abs(many.p_normal - many.p_exact) < 0.03
    one = p_utilisation(q, U, jobs=1, window=HOUR, target=0.9)
    assert one.p_normal > 1.5 * one.p_exact, "one job's X is far from normal in its tail: the exact form is the answer"


def test_certain_cases():
    busy = p_utilisation(QueueWait.parse("0"), 1.0, jobs=10, window=HOUR, target=1.0)
    assert busy.p_exact == pytest.approx(1.0) and busy.mean == pytest.approx(1.0)
    too_late = p_utilisation(QueueWait.parse("2h"), 1.0, jobs=10, window=HOUR, target=0.01)
    assert too_late.p_exact == 0.0 and too_late.mean == 0.0, "no job leaves the queue within the window"
    # Every job waits 15 min of a 60 min window and is then busy 80% of its time: U = 0.75 x 0.8 = 0.6 exactly.
    fixed = p_utilisation(QueueWait.parse("15min"), 0.8, jobs=5, window=HOUR, target=0.6)
    assert fixed.mean == pytest.approx(0.6) and fixed.p_exact == pytest.approx(1.0)
    assert p_utilisation(QueueWait.parse("15min"), 0.8, jobs=5, window=HOUR, target=0.61).p_exact == 0.0


def test_the_walltime_caps_what_a_job_can_hold_within_the_window():
    # A 30 min walltime in a 60 min window: a job started at once holds all of min(W, T0), one started at 45 min
    # holds half of it, one started at 60 min nothing.
    assert held_fraction(np.array([0.0, 2700.0, 3600.0]), HOUR, 1800.0).tolist() == [1.0, 0.5, 0.0]
    assert held_fraction(np.array([0.0, 1800.0]), HOUR, None).tolist() == [1.0, 0.5]


@pytest.mark.parametrize("text, kind", [("0", "fixed"), ("20min", "fixed"), ("exp:10min", "exponential"),
                                        ("lognormal:10min,2h", "lognormal")])
def test_queue_waits_read_as_a_user_writes_them_and_draw_what_they_say(text, kind):
    q = QueueWait.parse(text)
    assert q.kind == kind
    draws = q.sample(np.random.default_rng(0), 50_000)
    points = q.quantiles(2000)
    assert draws.min() >= 0
    assert np.median(draws) == pytest.approx(np.median(points), rel=0.05, abs=1e-9)
    if kind == "lognormal":
        assert np.median(draws) == pytest.approx(600, rel=0.05) and np.percentile(draws, 90) == pytest.approx(
            7200, rel=0.08)


def test_measured_waits_come_from_a_file_and_a_bad_line_is_named(tmp_path):
    good = tmp_path / "waits.txt"
    good.write_text("# sacct Start - Submit, seconds\n12\n\n300.5\n7200 # a long one\n")
    q = QueueWait.parse(f"file:{good}")
    assert q.kind == "empirical" and q.samples == (12.0, 300.5, 7200.0)
    assert set(q.sample(np.random.default_rng(0), 100)) <= {12.0, 300.5, 7200.0}
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nsoon\n")
    with pytest.raises(SimulationInputError, match=r"bad.txt:2: 'soon' is not a number of seconds"):
        QueueWait.parse(f"file:{bad}")
    with pytest.raises(SimulationInputError, match="cannot read queue waits"):
        QueueWait.parse(f"file:{tmp_path / 'missing.txt'}")


@pytest.mark.parametrize("text, match", [
    ("lognormal:2h,10min", "median < p90"), ("exp:0", "positive"), ("later", "cannot read the queue wait"),
    ("lognormal:10min", "cannot read the queue wait"),
])
def test_queue_waits_that_make_no_sense_are_typed_errors(text, match):
    with pytest.raises(SimulationInputError, match=match):
        QueueWait.parse(text)


@pytest.mark.parametrize("kw, match", [
    ({"jobs": 0}, "at least one job"), ({"window": 0.0}, "window must be a positive"),
    ({"target": 1.5}, r"fraction in \(0, 1\]"), ({"walltime": -1.0}, "walltime must be a positive"),
])
def test_model_inputs_that_make_no_sense_are_typed_errors(kw, match):
    args = {"jobs": 4, "window": HOUR, "target": 0.5, "walltime": None, **kw}
    with pytest.raises(SimulationInputError, match=match):
        p_utilisation(QueueWait.parse("exp:10min"), U, **args)
    with pytest.raises(SimulationInputError, match="fractions in"):
        p_utilisation(QueueWait.parse("exp:10min"), [0.5, 1.5], jobs=4, window=HOUR, target=0.5)
