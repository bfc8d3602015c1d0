"""Energy: estimates labelled as such, measured runs sharing a device counter, the energy objective's plans."""

from __future__ import annotations

import math

import pytest

from memchunk_prefect.core.energy import (
    DeviceRun,
    check_watts,
    estimate_joules,
    kwh,
    plan_energy_joules,
    split_device_energy,
)
from memchunk_prefect.core.errors import EnergyInputError
from memchunk_prefect.core.estimates import Estimates
from memchunk_prefect.core.estimates import estimate_joules as plan_joules
from memchunk_prefect.core.policy import decide, plan
from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.core.settings import PolicySettings
from memchunk_prefect.learn.operator import OperatorModel

KEY = "op|float32|cpu"


def run(joules, *, source="estimate", start=0.0, seconds=1.0, cpu=1.0, host="h", elements=1000):
    return Observation(KEY, elements, (1, 1, elements), 4 * elements, 10 * 2**20, seconds=seconds,
                       cpu_seconds=cpu, energy_joules=joules, energy_source=source, started_at=start,
                       created_at=start + seconds, host=host)


# --------------------------------------------------------------------------- the split of a device counter


def test_overlapping_runs_share_the_device_so_the_shares_add_up_to_the_device_energy():
    # The device drew 10 W from 0 to 20 s: run a (0-10 s) read 100 J, b (5-20 s) read 150 J, c (5-10 s) 50 J.
    runs = [DeviceRun(0, 10, 100.0), DeviceRun(5, 20, 150.0), DeviceRun(5, 10, 50.0)]
    shares = split_device_energy(runs)
    assert math.isclose(sum(shares), 200.0)  # the device's energy over the union, counted once
    assert math.isclose(shares[0], 50 + 50 / 3) and math.isclose(shares[1], 50 / 3 + 100)
    # Weights (busy cores) divide a shared stretch: a run keeping 3 cores busy takes 3/4 of it.
    heavy, light = split_device_energy([DeviceRun(0, 10, 100.0, weight=3.0), DeviceRun(0, 10, 100.0, weight=1.0)])
    assert (round(heavy, 6), round(light, 6)) == (75.0, 25.0)


@pytest.mark.parametrize("bad", [DeviceRun(5, 4, 1.0), DeviceRun(0, 1, -1.0), DeviceRun(0, 1, 1.0, weight=0.0),
                                 DeviceRun(0, float("nan"), 1.0)])
def test_a_device_run_that_cannot_be_shared_is_a_typed_error(bad):
    with pytest.raises(EnergyInputError, match="device run"):
        split_device_energy([bad])


@pytest.mark.parametrize("value", [0, -5, "ten", None, float("inf"), True])
def test_a_power_figure_that_is_not_a_positive_number_is_refused_with_what_to_do(value):
    with pytest.raises(EnergyInputError, match=r"positive number of watts.*TDP"):
        check_watts(value)


def test_plan_energy_counts_busy_slots_overhead_and_the_idle_slots_of_the_last_wave():
    # 3 chunks of 10 s on 2 slots: 2 waves, 20 s; 30 busy slot-seconds at 10 W, 10 idle at 3 W, 3 x 1 s overhead.
    j = plan_energy_joules(n_chunks=3, slots=2, chunk_seconds=10.0, overhead_seconds=1.0, chunk_joules=None)
    assert j == 3 * 10 * 10 + 3 * 1 * 10 + (2 * 22 - 33) * 3
    # A learned figure per chunk replaces seconds x watts for the compute part only.
    assert plan_energy_joules(n_chunks=2, slots=2, chunk_seconds=10.0, overhead_seconds=0.0, chunk_joules=7.0) == 14.0
    assert estimate_joules(2.5, 4.0) == 10.0 and kwh(3.6e6) == 1.0


# --------------------------------------------------------------------------- learning joules per element


def test_estimates_are_learned_until_a_measured_run_exists_and_then_never_mixed_in():
    m = OperatorModel(KEY)
    assert m.joules_per_element() is None and m.summary()["joules_per_element"] is None
    for i in range(4):
        m.learn(run(10.0, start=10.0 * i))
    assert m.joules_per_element() == (0.01, "estimate")
    m.learn(run(30.0, source="rapl", start=100.0))
    assert m.joules_per_element() == (0.03, "rapl")  # measured only, however many estimates there are
    m.learn(run(10.0, start=200.0))
    assert m.joules_per_element() == (0.03, "rapl")
    s = m.summary()
    assert (s["joules_per_element"], s["energy_source"], s["energy_runs"]) == (0.03, "rapl", 6)
    assert m.joules_for(2000) == pytest.approx(60.0)


def test_two_chunks_measured_side_by_side_on_one_host_are_not_each_charged_for_both():
    m = OperatorModel(KEY)
    # Both read the host's RAPL counter over the same 10 s: 400 J of package energy, 200 J each.
    m.learn(run(400.0, source="rapl", start=0.0, seconds=10.0, cpu=10.0, host="n1"))
    m.learn(run(400.0, source="rapl", start=0.0, seconds=10.0, cpu=10.0, host="n1"))
    assert m.joules_per_element() == (0.2, "rapl")
    # The same pair on two hosts shares nothing: each host's counter saw one run.
    m2 = OperatorModel(KEY)
    m2.learn(run(400.0, source="rapl", start=0.0, seconds=10.0, cpu=10.0, host="n1"))
    m2.learn(run(400.0, source="rapl", start=0.0, seconds=10.0, cpu=10.0, host="n2"))
    assert m2.joules_per_element() == (0.4, "rapl")


def test_failed_runs_teach_no_energy_and_the_energy_error_is_scored_before_learning():
    m = OperatorModel(KEY)
    oom = run(50.0)
    oom.outcome, oom.censored = "memory_error", True
    m.learn(oom)
    assert m.joules_per_element() is None
    m.learn(run(10.0))
    m.learn(run(20.0, start=5.0))  # predicted 10 J, was 20 J: 50 % error
    assert m.summary()["energy_mape"] == pytest.approx(0.5)


# --------------------------------------------------------------------------- the energy objective


def _linear(bytes_per_element: float):
    def predict(ext):
        mean = bytes_per_element * math.prod(ext)
        return Prediction(mean, 1.1 * mean, 10, True)
    return predict


def test_the_energy_objective_takes_fewer_chunks_where_halos_and_overhead_cost_more_than_an_idle_slot():
    shape, halo = (64, 64, 100), (8, 8, 8)
    common = dict(budget_bytes=10**12, estimates=Estimates(_linear(10.0), seconds_per_element=1e-6), halo=halo,
                  slots=2)
    by_time = plan(shape, **common, settings=PolicySettings())
    by_energy = plan(shape, **common, settings=PolicySettings(objective="energy"))
    assert by_time.n_chunks == 2  # one chunk per slot: the shortest run
    assert by_energy.n_chunks == 1  # the halo of a second chunk and its overhead cost more than the idle slot
    assert by_energy.estimated_seconds > by_time.estimated_seconds
    assert by_energy.estimated_joules < by_time.estimated_joules
    assert "least energy" in by_energy.reason
    # Each plan's estimated joules is the cost model's figure for it.
    ext = (64, 64, 100)
    assert by_energy.estimated_joules == pytest.approx(plan_joules(1, ext, 2, PolicySettings(objective="energy"),
                                                                   1e-6))


def test_a_deadline_rules_out_the_slow_low_energy_plan_and_a_missed_one_falls_back_to_the_fastest():
    shape, halo = (64, 64, 100), (8, 8, 8)
    common = dict(budget_bytes=10**12, estimates=Estimates(_linear(10.0), seconds_per_element=1e-6), halo=halo,
                  slots=2)
    fastest = plan(shape, **common, settings=PolicySettings())
    slow = plan(shape, **common, settings=PolicySettings(objective="energy"))
    between = (fastest.estimated_seconds + slow.estimated_seconds) / 2
    met = plan(shape, **common, settings=PolicySettings(objective="energy", deadline_seconds=between))
    assert met.estimated_seconds <= between and met.n_chunks > 1
    assert f"within the {between:g} s deadline" in met.reason
    missed = plan(shape, **common, settings=PolicySettings(objective="energy", deadline_seconds=1e-6))
    assert missed.estimated_seconds == pytest.approx(fastest.estimated_seconds)
    assert "misses the" in missed.reason


def test_learned_joules_per_block_drive_the_energy_plan():
    # An operator whose learned energy per element grows with the block (cache misses, say): small chunks win.
    shape = (64, 64, 100)
    def joules_for(elements):
        return 1e-5 * elements * (elements / 1e4)
    common = dict(budget_bytes=10**12, slots=2, settings=PolicySettings(objective="energy"))
    plain = plan(shape, **common, estimates=Estimates(_linear(10.0), seconds_per_element=1e-6))
    learned = plan(shape, **common, estimates=Estimates(_linear(10.0), seconds_per_element=1e-6, joules_for=joules_for))
    assert learned.n_chunks > plain.n_chunks


def test_continue_gives_way_when_the_incoming_chunking_costs_much_more_energy():
    from memchunk_prefect.core.chunks import balanced_grid

    shape = (64, 64, 100)
    incoming = balanced_grid(shape, (8, 8, 1))  # 64 small chunks: 64 overheads
    common = dict(budget_bytes=10**12, estimates=Estimates(_linear(10.0), seconds_per_element=1e-6), slots=2,
                  halo=(0, 0, 0))
    d = decide(shape, incoming, **common, settings=PolicySettings(objective="energy", per_task_overhead_seconds=1.0))
    assert d.decision == "rechunk" and " J against " in d.reason


def test_the_runner_takes_the_objective_and_power_figures_and_refuses_bad_ones():
    from memchunk_prefect import MemoryAwareRunner

    r = MemoryAwareRunner(objective="energy", deadline="2min", watts_per_core=12, idle_watts_per_core=2)
    assert (r.policy.objective, r.policy.deadline_seconds, r.policy.watts_per_core, r.policy.idle_watts_per_core) == (
        "energy", 120.0, 12.0, 2.0)
    assert r.duplicate().policy == r.policy
    with pytest.raises(EnergyInputError, match="objective"):
        MemoryAwareRunner(objective="fast")
    with pytest.raises(EnergyInputError, match="deadline"):
        MemoryAwareRunner(deadline="by morning")
    with pytest.raises(EnergyInputError, match="watts_per_core"):
        MemoryAwareRunner(watts_per_core=0)
