"""The simulator: the runner's own state machine and the baselines on a simulated cluster, from learned models."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from memchunk_prefect import cli
from memchunk_prefect.bandit import ArmLearner
from memchunk_prefect.errors import SimulationInputError
from memchunk_prefect.records import Prediction
from memchunk_prefect.settings import DEFAULT_SETTINGS
from memchunk_prefect.simulate import ClusterShape, Step, run_strategy, simulate
from memchunk_prefect.store import Store
from memchunk_prefect.testing import seed_store

MiB = 2**20
KEY = "op|float32|cpu"


@dataclass
class Known:
    """A learned model as the simulator reads it: ``bpe`` bytes per element held, a learned margin of ``margin``."""

    bpe: float = 100.0
    margin: float = 1.0  # the 95% quantile of needed / predicted: 1.0 draws the mean every time
    spe: float = 1e-6
    ready: bool = True
    learner: ArmLearner = field(default_factory=lambda: ArmLearner(KEY))

    def predict(self, extents):
        mean = self.bpe * math.prod(extents)
        return Prediction(mean, 1.2 * mean * self.margin, 10, self.ready, "" if self.ready else "0 observations",
                          tight_bytes=mean * self.margin)

    def seconds_per_element(self):
        return self.spe

    def seconds_for(self, elements):
        return None

    def joules_for(self, elements):
        return None

    def choose_arm(self, groups):
        return self.learner.choose(groups)


STEP = Step("op", KEY, (0, 0, 0), True)
SHAPE = (40, 40, 100)  # 160,000 elements: 16 MB at 100 B each, 0.16 s of compute at 1 us each
CLUSTER = ClusterShape(workers=2, memory_limit_bytes=100 * MiB, resting_bytes=40 * MiB, per_task_overhead_seconds=0.1)


def run(strategy, knowledge=None, shape=SHAPE, cluster=CLUSTER, seed=0, **kw):
    k = knowledge or Known()
    return run_strategy(strategy, [STEP], shape, cluster, lambda key: k, np.random.default_rng(seed),
                        time_sigma=0.0, **kw)


def test_a_static_plan_that_fits_takes_waves_of_compute_plus_overhead():
    # static-4 on 2 slots: two waves of 10 x 40 x 100 blocks (40,000 elements: 0.04 s + 0.1 s overhead).
    r = run("static-4")
    assert r.completed and r.out_of_memory == 0
    assert r.makespan_seconds == pytest.approx(2 * (0.04 + 0.1))
    assert r.slot_utilisation == pytest.approx(1.0)
    assert r.core_hours == pytest.approx(2 * r.makespan_seconds / 3600)
    assert r.peak_bytes == 100 * 40_000


def test_a_chunk_over_the_kill_line_fails_static_and_dask_auto_and_is_split_by_split_on_failure():
    # The whole volume needs 16 MB x 4 = 64 MB; a worker has 0.95 x 100 MiB - 40 MiB = 55 MiB below its kill line.
    heavy = Known(bpe=400.0)
    for strategy in ("static-1", "dask-auto"):
        r = run(strategy, heavy)
        assert not r.completed and r.out_of_memory == 1 and "KilledWorker" in r.failure
        assert r.lost_worker_seconds > 0
    # Split on failure: the whole volume (64 MB) dies, its halves (32 MB each) fit.
    split = run("split", heavy)
    assert split.completed and split.out_of_memory == 1 and split.lost_worker_seconds > 0
    assert split.maps[0].chunks == 2 and split.maps[0].tasks == 3


def test_memchunk_plans_under_the_budget_and_never_dies_when_the_model_is_right():
    r = run("memchunk", Known(bpe=400.0))
    assert r.completed and r.out_of_memory == 0
    (m,) = r.maps
    assert m.decisions[0] == "rechunk" and m.chunks >= 2
    assert r.peak_bytes <= CLUSTER.budget_bytes


def test_memchunk_recovers_when_the_model_is_low_by_splitting_as_the_runner_does():
    # The runner plans with 400 B per element; chunks really need 2.5 times that: workers are killed, the
    # machine splits those chunks (retry-smaller) and the run completes.
    plan_with, truth = Known(bpe=400.0), Known(bpe=1000.0)
    r = run_strategy("memchunk", [STEP], SHAPE, CLUSTER, lambda key: plan_with, np.random.default_rng(0),
                     truth_for=lambda key: truth)
    assert r.completed and r.out_of_memory >= 1 and r.lost_worker_seconds > 0
    assert "retry-smaller" in r.maps[0].decisions


def test_the_same_seed_gives_the_same_run_and_monte_carlo_gives_percentiles_and_a_deadline_chance():
    k = Known(margin=1.3)
    a = run_strategy("static-4", [STEP], SHAPE, CLUSTER, lambda key: k, np.random.default_rng(7))
    b = run_strategy("static-4", [STEP], SHAPE, CLUSTER, lambda key: k, np.random.default_rng(7))
    assert a.to_dict() == b.to_dict()
    (s,) = simulate(["static-4"], [STEP], SHAPE, CLUSTER, lambda key: k, runs=30, deadline=0.28)
    assert s.runs == 30 and s.completed == 30
    assert s.makespan_p50 <= s.makespan_p90
    assert 0.0 < s.p_deadline < 1.0, "times are drawn: some runs meet 0.28 s, some do not"


@pytest.mark.parametrize("make, match", [
    (lambda: ClusterShape(workers=0, memory_limit_bytes=MiB), "at least one worker"),
    (lambda: ClusterShape(workers=2, memory_limit_bytes=100 * MiB, resting_bytes=200 * MiB), "no room"),
    (lambda: run("static-0"), "unknown strategy"),
    (lambda: run("static-4", shape=(0, 10, 10)), "three positive extents"),
    (lambda: run("memchunk", Known(ready=False)), "too little history"),
    (lambda: Step.of("no_such_operator"), "unknown operator"),
])
def test_bad_input_is_a_typed_error_saying_what_to_do(make, match):
    with pytest.raises(SimulationInputError, match=match):
        make()


def test_the_command_line_simulates_from_a_store_and_says_which_strategies_fail(tmp_path, capsys):
    from memchunk_prefect.operators import operator_key
    from tasks import gst3d_dip

    key = operator_key(gst3d_dip, {}, dtype="float32")
    with Store(tmp_path / "s.sqlite") as store:
        seed_store(store, key, 40 * 4.0, sizes=(20_000, 50_000, 100_000, 200_000, 400_000, 800_000))
    argv = ["simulate", "--store", str(tmp_path / "s.sqlite"), "--steps", "gst3d_dip", "--shape", "128", "128", "400",
            "--workers", "2", "--memory-limit", "1GiB", "--runs", "3", "--strategies", "memchunk", "static-1"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "memchunk  3/3" in out and "static-1 failed 3 of 3 runs" in out, out
    assert cli.main([*argv, "--json"]) == cli.EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert [s["strategy"] for s in got["strategies"]] == ["memchunk", "static-1"]
    assert got["strategies"][0]["completed"] == 3 and got["strategies"][1]["completed"] == 0
    assert cli.main([*argv[:-3], "--steps-json", "not json"]) == cli.EXIT_USAGE
    assert "--steps-json is not JSON" in capsys.readouterr().err
    if sys.version_info >= (3, 11):  # the WfCommons trace needs wfcommons (Python >= 3.11)
        out_path = tmp_path / "sim.wfcommons.json"
        assert cli.main([*argv, "--trace", str(out_path)]) == cli.EXIT_OK
        assert f"wrote {out_path}" in capsys.readouterr().out
        doc = json.loads(out_path.read_text())
        assert doc["schemaVersion"] == "1.5" and doc["workflow"]["execution"]["tasks"]
    # The seeded store has no energy: the simulator says its figures rest on seconds x watts_per_core.
    assert got["strategies"][0]["energy_basis"] == "estimated from seconds"
    assert got["strategies"][0]["energy_joules_p50"] > 0


# =========================================================================== recommend


def _recommend(deadline, **kw):
    from memchunk_prefect.simulate import recommend

    k = Known(bpe=400.0, spe=1e-5)  # 160,000 elements: 1.6 s of compute on one slot
    return recommend([STEP], SHAPE, lambda key: k, deadline_seconds=deadline,
                     memory_options=kw.pop("memory_options", [100 * MiB, 200 * MiB]), resting_bytes=40 * MiB,
                     per_task_overhead_seconds=0.1, **kw)


def test_recommend_gives_the_fewest_workers_that_meet_the_deadline_and_the_jobqueue_arguments():
    easy = _recommend(60.0)
    assert easy.best is not None and easy.best.workers == 1, "one worker finishes in a minute"
    tight = _recommend(0.8, max_workers=16)
    assert tight.best is not None and tight.best.workers > 1
    assert tight.best.summary.p_deadline >= 0.9 and tight.best.summary.makespan_p90 <= 0.8
    fewer = [c for c in tight.tried if c.memory_limit_bytes == tight.best.memory_limit_bytes
             and c.workers == tight.best.workers - 1]
    assert all(c.summary.p_deadline < 0.9 for c in fewer), "one worker fewer would not meet it"
    jq = tight.jobqueue_kwargs()
    assert jq["walltime"] == "00:00:01" and jq["jobs"] == tight.best.workers and jq["processes"] == 1
    assert jq["memory"] in ("100.0MiB", "200.0MiB")


def test_a_runs_energy_is_its_tasks_at_the_busy_figure_plus_the_slots_it_held_idle():
    # static-3 on 2 slots: 3 blocks of 13-14 x 40 x 100 (~0.053 s compute + 0.1 s overhead each) in 2 waves.
    r = run("static-3")
    settings = DEFAULT_SETTINGS
    compute = [b * 40 * 100 * 1e-6 for b in (14, 13, 13)]
    busy = sum(c * settings.watts_per_core for c in compute) + 3 * 0.1 * settings.watts_per_core
    assert r.busy_joules == pytest.approx(busy)
    idle = 2 * r.makespan_seconds - r.busy_slot_seconds
    assert idle > 0  # the second wave leaves a slot waiting
    assert r.energy_joules == pytest.approx(busy + idle * settings.idle_watts_per_core)
    assert r.energy_basis == "estimated from seconds"


def test_learned_joules_per_block_are_what_the_simulator_charges_and_it_says_so():
    @dataclass
    class WithEnergy(Known):
        def joules_for(self, elements):
            return 5e-5 * elements  # 5x the seconds x 10 W the plain figure would give

    plain, learned = run("static-2"), run("static-2", knowledge=WithEnergy())
    overhead = 2 * 0.1 * 10.0
    assert learned.busy_joules - overhead == pytest.approx(5 * (plain.busy_joules - overhead))
    assert learned.energy_basis == "learned"


def test_recommend_for_energy_picks_the_least_energy_shape_that_meets_the_deadline():
    by_energy = _recommend(60.0, objective="energy", memory_options=[100 * MiB, 200 * MiB, 400 * MiB])
    meets = [c for c in by_energy.tried if c.summary.p_deadline is not None and c.summary.p_deadline >= 0.9]
    fewest = {m: min((c for c in meets if c.memory_limit_bytes == m), key=lambda c: c.workers)
              for m in {c.memory_limit_bytes for c in meets}}  # what recommend keeps per memory size
    assert by_energy.best is not None and by_energy.objective == "energy" and len(fewest) == 3
    assert by_energy.best.summary.energy_joules_p50 == min(c.summary.energy_joules_p50 for c in fewest.values())
    with pytest.raises(Exception, match="objective"):
        _recommend(60.0, objective="cheap")


def test_the_frontier_holds_the_fewest_workers_per_memory_size_and_plots(tmp_path):
    from memchunk_prefect.simulate import frontier, plot_recommendation

    rec = _recommend(0.8, max_workers=16, memory_options=[100 * MiB, 200 * MiB])
    points = frontier(rec)
    assert [c.memory_limit_bytes for c in points] == sorted(c.memory_limit_bytes for c in points)
    for c in points:
        fewer = [t for t in rec.tried if t.memory_limit_bytes == c.memory_limit_bytes and t.workers < c.workers]
        assert all(t.summary.p_deadline < 0.9 for t in fewer)
    assert rec.best in points
    png = plot_recommendation(rec, tmp_path / "rec.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SimulationInputError, match="nothing to plot"):
        plot_recommendation(_recommend(0.01, max_workers=4), tmp_path / "none.png")


def test_the_runners_own_work_per_map_is_measured_from_the_store_and_lengthens_only_its_runs(tmp_path):
    import dataclasses

    from memchunk_prefect.records import MapRun, Observation
    from memchunk_prefect.simulate import measured_map_work

    with Store(tmp_path / "s.sqlite") as store:
        assert measured_map_work(store) is None  # nothing recorded by a v5 runner yet
        for i, (before, after) in enumerate([(0.2, 0.1), (0.4, 0.3), (0.3, 0.2)]):
            start = 100.0 * i
            store.add_map(MapRun("fr", "op", KEY, "/s", f"/o{i}", (4, 4, 4), (0, 0, 0), 4, 2, 10**9, start,
                                 start + before + 5.0 + after, map_id=f"m{i}"))
            for t in (0.0, 2.0):  # two tasks: the first starts `before` after the map, the last ends 5 s later
                store.add(Observation(KEY, 64, (4, 4, 4), 256, 1000, seconds=3.0, started_at=start + before + t,
                                      created_at=start + before + t + 3.0, flow_run_id="fr", map_id=f"m{i}"))
        work = measured_map_work(store)
    assert (work.start_seconds, work.end_seconds, work.maps) == (pytest.approx(0.3), pytest.approx(0.2), 3)
    with_work = dataclasses.replace(CLUSTER, map_start_seconds=0.3, map_end_seconds=0.2)
    steps = [STEP, STEP]
    def go(strategy, cluster):
        return run_strategy(strategy, steps, SHAPE, cluster, lambda key: Known(), np.random.default_rng(0),
                            time_sigma=0.0)
    plain, worked = go("memchunk", CLUSTER), go("memchunk", with_work)
    assert worked.makespan_seconds == pytest.approx(plain.makespan_seconds + 2 * (0.3 + 0.2))
    assert worked.busy_slot_seconds == pytest.approx(plain.busy_slot_seconds)  # the slots wait, idle
    assert go("static-4", with_work).makespan_seconds == pytest.approx(go("static-4", CLUSTER).makespan_seconds)
    with pytest.raises(SimulationInputError, match="zero seconds or more"):
        dataclasses.replace(CLUSTER, map_start_seconds=-1.0)


def test_recommend_says_when_nothing_meets_the_deadline_and_refuses_nonsense():
    assert _recommend(0.01, max_workers=4).best is None
    with pytest.raises(SimulationInputError, match="positive"):
        _recommend(0.0)
    # A worker smaller than its resting memory is not a candidate: nothing else to try, no recommendation.
    assert _recommend(60.0, memory_options=[30 * MiB]).best is None


def test_durations_read_as_a_user_writes_them():
    from memchunk_prefect.errors import VolumeError
    from memchunk_prefect.units import parse_seconds

    assert parse_seconds("6h") == 21600 and parse_seconds("01:30:00") == 5400 and parse_seconds("90s") == 90
    with pytest.raises(VolumeError, match="HH:MM"):
        parse_seconds("tomorrow")


def test_a_worker_over_its_kill_line_takes_its_tasks_with_it_and_nothing_new_lands_on_it():
    from memchunk_prefect.chunks import Chunk
    from memchunk_prefect.simulate import SimulatedCluster, _Task

    c = Chunk((0, 0, 0), (1, 1, 1))
    sim = SimulatedCluster(ClusterShape(workers=1, threads_per_worker=3, memory_limit_bytes=100 * MiB,
                                        resting_bytes=40 * MiB, restart_seconds=2.0))
    sim.submit(_Task(0, c, (1, 1, 1), 30 * MiB, 50.0))
    sim.submit(_Task(1, c, (1, 1, 1), 30 * MiB, 10.0))  # 60 MiB on a worker with 55 MiB: it dies at t = 5
    sim.submit(_Task(2, c, (1, 1, 1), 1 * MiB, 1.0))  # waits: the worker is due to die
    ends = [sim.next() for _ in range(2)]
    assert [(e.task.sid, e.at, e.killed) for e in ends] == [(0, 5.0, True), (1, 5.0, True)]
    assert sim.kills == 1 and sim.lost_worker_seconds == 10.0
    # Back at t = 7: the waiting task runs then; a new task reusing submission id 0 ends at its own time.
    sim.submit(_Task(0, c, (1, 1, 1), 1 * MiB, 3.0))
    got = []
    while not sim.idle:
        e = sim.next()
        if e.task.sid >= 0:
            got.append((e.task.sid, e.at, e.killed))
    assert got == [(2, 8.0, False), (0, 10.0, False)]
    assert sim.last_end == 10.0


def test_an_operator_never_run_is_simulated_cold_from_a_stated_prior_and_flagged(tmp_path, capsys):
    from memchunk_prefect.simulate import PriorKnowledge, store_models

    with Store(tmp_path / "s.sqlite"):
        pass  # an empty store: nothing learned
    models = store_models(str(tmp_path / "s.sqlite"), prior=PriorKnowledge(40.0, 1e-6))
    step = Step.of("gst3d_dip")
    cluster = ClusterShape(workers=2, memory_limit_bytes=2**30, resting_bytes=250 * MiB)
    r = run_strategy("memchunk", [step], (64, 64, 200), cluster, models.knowledge, np.random.default_rng(0),
                     truth_for=models.truth)
    assert r.completed and models.from_prior == {step.key}
    # Cold, as the runner would be: it probes, learns from those chunks, then plans the rest.
    assert r.maps[0].decisions[0] == "probe" and "rechunk" in r.maps[0].decisions
    argv = ["simulate", "--store", str(tmp_path / "s.sqlite"), "--steps", "gst3d_dip", "--shape", "64", "64", "200",
            "--workers", "2", "--memory-limit", "1GiB", "--runs", "2", "--strategies", "memchunk"]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "too little history" in capsys.readouterr().err
    assert cli.main([*argv, "--prior-multiple", "40"]) == cli.EXIT_OK
    assert "simulated from a stated prior, not from what was learned (40x the input" in capsys.readouterr().out
