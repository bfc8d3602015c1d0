"""The simulator: the runner's own state machine and the baselines on a simulated cluster, from learned models."""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from memchunk_prefect.cli import app as cli
from memchunk_prefect.core.errors import SimulationInputError
from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.core.settings import DEFAULT_SETTINGS
from memchunk_prefect.learn.bandit import ArmLearner
from memchunk_prefect.learn.store import Store
from memchunk_prefect.sim.inputs import RUN_SPREAD, ClusterShape, Step
from memchunk_prefect.sim.runs import run_strategy
from memchunk_prefect.sim.simulate import simulate
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
    touch: float | None = None  # kernel seconds per byte to grow a worker (None: nothing learned, nothing paid)
    first_call: float | None = None  # seconds a worker's first task of the operator pays (None: nothing learned)

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

    def touch_seconds_per_byte(self):
        return self.touch

    def first_call_seconds(self):
        return self.first_call

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


def test_a_task_that_grows_its_worker_pays_the_growth_once_per_worker_and_memchunk_plans_for_it():
    # 10 ns per byte grown: static-2's 8 MB chunks grow each fresh worker 8 MB (0.08 s on top of 0.08 + 0.1);
    # static-4's first wave grows them 4 MB (0.04 s), its second wave nothing.
    touch = Known(touch=1e-8)
    assert run("static-2", touch).makespan_seconds - run("static-2").makespan_seconds == pytest.approx(0.08)
    assert run("static-4", touch).makespan_seconds - run("static-4").makespan_seconds == pytest.approx(0.04)
    # A worker the nanny restarts is a new process: it has held nothing, and grows again.
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    sim = SimulatedCluster(ClusterShape(workers=1, memory_limit_bytes=100 * MiB, resting_bytes=40 * MiB))
    box = Chunk((0, 0, 0), (1, 1, 1))
    sim.submit(_Task(0, box, (1, 1, 1), 30 * MiB, 1.0, touch_seconds_per_byte=1e-9))
    first = sim.next()
    assert sim.marks[0] == 30 * MiB and first.task.seconds == pytest.approx(1.0 + 30 * MiB * 1e-9)
    sim.submit(_Task(1, box, (1, 1, 1), 20 * MiB, 1.0, touch_seconds_per_byte=1e-9))
    assert sim.next().task.seconds == 1.0, "below the mark: nothing to grow"
    sim.submit(_Task(2, box, (1, 1, 1), 80 * MiB, 1.0, touch_seconds_per_byte=1e-9))  # over the 55 MiB line
    assert sim.next().killed and sim.marks[0] == 0
    # The runner's own machine, simulated, knows each worker's mark: at 50 ns per byte, growing each worker 8 MB
    # for one chunk per slot (0.4 s) costs more than a second wave's overhead and compute (0.14 s) saves, so it
    # cuts finer than without the cost (one chunk per slot), and finishes before static-2 does.
    dear = Known(touch=5e-8)
    plain, costed = run("memchunk"), run("memchunk", dear)
    assert plain.maps[0].chunks == 2 and costed.maps[0].chunks > 2
    assert costed.makespan_seconds < run("static-2", dear).makespan_seconds


def test_a_workers_first_task_of_an_operator_pays_its_first_call_once_per_worker_process():
    # 0.3 s per worker process: static-2 (one chunk per worker) and static-8 (four per worker) both pay it once.
    once = Known(first_call=0.3)
    for strategy in ("static-2", "static-8"):
        assert run(strategy, once).makespan_seconds - run(strategy).makespan_seconds == pytest.approx(0.3)
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    sim = SimulatedCluster(ClusterShape(workers=1, memory_limit_bytes=100 * MiB, resting_bytes=40 * MiB,
                                        threads_per_worker=2))
    box = Chunk((0, 0, 0), (1, 1, 1))
    # Two tasks that start together on a fresh worker both wait on its first call (a run is a first call until
    # one of its operator has ended there); the next one does not.
    for sid in (0, 1):
        sim.submit(_Task(sid, box, (1, 1, 1), MiB, 1.0, operator_key="a", first_call_seconds=0.5))
    assert [sim.next().task.seconds for _ in range(2)] == [1.5, 1.5]
    sim.submit(_Task(2, box, (1, 1, 1), MiB, 1.0, operator_key="a", first_call_seconds=0.5))
    assert sim.next().task.seconds == 1.0
    # Another operator's first call is its own; a restarted worker is a new process that has called nothing.
    sim.submit(_Task(3, box, (1, 1, 1), MiB, 1.0, operator_key="b", first_call_seconds=0.2))
    assert sim.next().task.seconds == 1.2
    sim.submit(_Task(4, box, (1, 1, 1), 80 * MiB, 1.0, operator_key="a", first_call_seconds=0.5))
    assert sim.next().killed and sim.called[0] == set()


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
    (lambda: ClusterShape(workers=2, memory_limit_bytes=100 * MiB, walltime_seconds=0), "walltime is a positive"),
    (lambda: simulate(["memchunk"], [STEP], SHAPE, CLUSTER, lambda k: Known(), runs=1, window=1.0),
     "needs both a window and a target"),
])
def test_bad_input_is_a_typed_error_saying_what_to_do(make, match):
    with pytest.raises(SimulationInputError, match=match):
        make()


def test_the_command_line_simulates_from_a_store_and_says_which_strategies_fail(tmp_path, capsys):
    from memchunk_prefect.operators import gst3d_dip, operator_key

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
    from memchunk_prefect.sim.recommend import recommend

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
    meets = [c for c in by_energy.tried  # a screened shape had one run, while searching: not a verdict
             if not c.screened and c.summary.p_deadline is not None and c.summary.p_deadline >= 0.9]
    fewest = {m: min((c for c in meets if c.memory_limit_bytes == m), key=lambda c: c.workers)
              for m in {c.memory_limit_bytes for c in meets}}  # what recommend keeps per memory size
    assert by_energy.best is not None and by_energy.objective == "energy" and len(fewest) == 3
    assert by_energy.best.summary.energy_joules_p50 == min(c.summary.energy_joules_p50 for c in fewest.values())
    with pytest.raises(Exception, match="objective"):
        _recommend(60.0, objective="cheap")


def test_the_frontier_holds_the_fewest_workers_per_memory_size_and_plots(tmp_path):
    from memchunk_prefect.sim.recommend import frontier, plot_recommendation

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

    from memchunk_prefect.core.records import MapRun, Observation
    from memchunk_prefect.sim.inputs import measured_map_work

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
    span = run_strategy("memchunk", [STEP], SHAPE, CLUSTER, lambda key: Known(), np.random.default_rng(0),
                        time_sigma=0.0).makespan_seconds  # one map's tasks, from its first start to its last end
    assert plain.makespan_seconds == pytest.approx(2 * span)  # the chained map runs as its upstream's writes end
    # The first map decides 0.3 s after the flow starts; the chained map is called 0.3 s after the first was
    # (map_start_seconds stands for the offset the store did not measure), waits for the upstream's writes, and
    # ends 0.2 s after its last task. The first map's end work is done beside the chained map's tasks.
    assert worked.makespan_seconds == pytest.approx(0.3 + span + span + 0.2)
    assert worked.busy_slot_seconds == pytest.approx(plain.busy_slot_seconds)  # the slots wait, idle
    # Called after its upstream's writes ended, a chained map starts at its call.
    late = go("memchunk", dataclasses.replace(with_work, chained_map_offset_seconds=0.3 + span + 0.25))
    assert late.makespan_seconds == pytest.approx(0.3 + span + 0.25 + span + 0.2)
    assert go("static-4", with_work).makespan_seconds == pytest.approx(go("static-4", CLUSTER).makespan_seconds)
    with pytest.raises(SimulationInputError, match="zero seconds or more"):
        dataclasses.replace(CLUSTER, map_start_seconds=-1.0)


def test_the_runners_cost_per_task_is_its_median_hand_over_and_only_its_tasks_pay_it(tmp_path):
    """Per worker, a task's end to the next task's start there, of any map of the flow run (its maps share the
    workers); tasks side by side on a worker of two threads are not hand-overs. Fewer than MIN_TASK_GAPS of them:
    the stated per-task overhead stands."""
    import dataclasses

    from memchunk_prefect.core.records import MapRun, Observation
    from memchunk_prefect.sim.inputs import MIN_TASK_GAPS, measured_map_work

    def add(store, map_id, spans, flow="fr"):
        store.add_map(MapRun(flow, "op", KEY, "/s", f"/{map_id}", (4, 4, 4), (0, 0, 0), 4, 2, 10**9, 100.0,
                             120.0, map_id=map_id))
        for worker, start, end in spans:  # seconds after 100.0
            store.add(Observation(KEY, 64, (4, 4, 4), 256, 1000, seconds=end - start, started_at=100.0 + start,
                                  created_at=100.0 + end, flow_run_id=flow, map_id=map_id, worker=worker))

    with Store(tmp_path / "s.sqlite") as store:
        # Worker a: hand-overs of 0.05, 0.02 and 0.5 s (the last a wait for a decision); worker b runs two at
        # once (not a hand-over), then hands over in 0.04 s.
        add(store, "m1", [("a", 0.0, 1.0), ("a", 1.05, 2.0), ("a", 2.02, 3.0), ("a", 3.5, 4.0),
                          ("b", 0.0, 2.0), ("b", 0.5, 1.5), ("b", 2.04, 3.0)])
        few = measured_map_work(store)
        add(store, "m2", [("a", 10.0, 11.0), ("a", 11.03, 12.0)], flow="fr2")  # another flow run: no hand-over
        work = measured_map_work(store)
        # A chained map's task that takes over a worker's thread from its upstream's task is a hand-over.
        add(store, "m3", [("c", 0.0, 1.0)], flow="fr3")
        add(store, "m4", [("c", 1.01, 2.0)], flow="fr3")
        across = measured_map_work(store)
    assert few.gaps == MIN_TASK_GAPS - 1 and few.task_seconds is None
    assert across.gaps == MIN_TASK_GAPS + 1 and across.task_seconds == pytest.approx(0.035)
    assert work.gaps == MIN_TASK_GAPS and work.task_seconds == pytest.approx(0.04)
    assert work.cluster_kwargs()["runner_task_seconds"] == pytest.approx(0.04)

    def go(strategy, cluster):
        return run_strategy(strategy, [STEP], SHAPE, cluster, lambda key: Known(), np.random.default_rng(0),
                            time_sigma=0.0)
    cheap = dataclasses.replace(CLUSTER, runner_task_seconds=0.0)
    assert go("memchunk", cheap).makespan_seconds < go("memchunk", CLUSTER).makespan_seconds
    assert go("static-8", cheap).makespan_seconds == pytest.approx(go("static-8", CLUSTER).makespan_seconds)
    with pytest.raises(SimulationInputError, match="zero seconds or more"):
        dataclasses.replace(CLUSTER, runner_task_seconds=-0.1)


def test_a_chained_map_is_simulated_from_its_call_beside_its_upstream_and_its_wait_is_not_the_runners_work(
        tmp_path):
    """A map over a map still running (the demo's pipeline) is called at once and waits for the upstream's
    writes. The simulator runs it beside its upstream, gated on those writes, so the store gives the time from
    the upstream's call to its own, not its wait, and the first maps' wait before their first task apart."""
    from memchunk_prefect.core.records import MapRun, Observation
    from memchunk_prefect.sim.inputs import measured_map_work

    def add(store, flow, name, source, start, first_task, end):
        store.add_map(MapRun(flow, "op", KEY, source, f"/{flow}/{name}", (4, 4, 4), (0, 0, 0), 4, 2, 10**9, start,
                             end, map_id=f"{flow}-{name}"))
        store.add(Observation(KEY, 64, (4, 4, 4), 256, 1000, seconds=1.0, started_at=first_task,
                              created_at=end - 0.05, flow_run_id=flow, map_id=f"{flow}-{name}"))

    with Store(tmp_path / "s.sqlite") as store:
        # Flow a: the second map is called 0.1 s into the first (which ends at 3.0); the third is called at 3.1,
        # 3.0 s after the second.
        add(store, "a", "m1", "/survey.sgy", 0.0, 0.4, 3.0)
        add(store, "a", "m2", "/a/m1", 0.1, 3.2, 6.0)
        add(store, "a", "m3", "/a/m2", 3.1, 6.3, 9.0)
        # Flow b: the same output path names in another flow run are not its upstream; its second map is called
        # 0.1 s after the first.
        add(store, "b", "m1", "/survey.sgy", 100.0, 100.5, 103.0)
        add(store, "b", "m2", "/b/m1", 100.1, 102.0, 106.0)
        work = measured_map_work(store)
    # The first maps wait 0.4 and 0.5 s for their first task; the chained ones are called 0.1, 3.0 and 0.1 s after
    # their upstream (their waits, 3.2, 3.2 and 1.9 s from their call, are the upstream's work, not the runner's).
    assert work.maps == 5
    assert work.start_seconds == pytest.approx(0.45)
    assert work.chained_offset_seconds == pytest.approx(0.1)
    assert work.end_seconds == pytest.approx(0.05)
    # Simulated, a two-map chain pays the first map's wait once; the second map, called 0.1 s after the first
    # map was, decides after it and waits for the first map's writes, so its call costs nothing more.
    import dataclasses

    def go(cluster):
        return run_strategy("memchunk", [STEP, STEP], SHAPE, cluster, lambda key: Known(), np.random.default_rng(0),
                            time_sigma=0.0).makespan_seconds
    both = dataclasses.replace(CLUSTER, **work.cluster_kwargs())
    none = dataclasses.replace(CLUSTER, map_end_seconds=work.end_seconds, runner_task_seconds=work.task_seconds)
    assert go(both) == pytest.approx(go(none) + 0.45)


def test_recommend_says_when_nothing_meets_the_deadline_and_refuses_nonsense():
    assert _recommend(0.01, max_workers=4).best is None
    with pytest.raises(SimulationInputError, match="positive"):
        _recommend(0.0)
    # A worker smaller than its resting memory is not a candidate: nothing else to try, no recommendation.
    assert _recommend(60.0, memory_options=[30 * MiB]).best is None


def test_durations_read_as_a_user_writes_them():
    from memchunk_prefect.core.errors import VolumeError
    from memchunk_prefect.core.units import parse_seconds

    assert parse_seconds("6h") == 21600 and parse_seconds("01:30:00") == 5400 and parse_seconds("90s") == 90
    with pytest.raises(VolumeError, match="HH:MM"):
        parse_seconds("tomorrow")


def test_a_worker_over_its_kill_line_takes_its_tasks_with_it_and_nothing_new_lands_on_it():
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    c = Chunk((0, 0, 0), (1, 1, 1))
    sim = SimulatedCluster(ClusterShape(workers=1, threads_per_worker=3, memory_limit_bytes=100 * MiB,
                                        resting_bytes=40 * MiB, restart_seconds=2.0))
    sim.submit(_Task(0, c, (1, 1, 1), 30 * MiB, 50.0))
    # 80 MiB on a worker with 55 MiB: the second task's memory, rising evenly to its 50 MiB peak half way through
    # its 20 s, crosses the kill line when it holds the 25 MiB left above the first's: the worker dies at t = 5.
    sim.submit(_Task(1, c, (1, 1, 1), 50 * MiB, 20.0))
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


def test_a_task_needing_far_more_than_its_worker_has_dies_as_soon_as_its_memory_reaches_the_kill_line():
    """Memory rises evenly to a task's peak half way through its run: one needing 10x the headroom left dies a
    tenth of that way in (a whole survey tried first by split-on-failure is killed early, not half way through a
    run it never gets to do), and one that only just crosses the line dies near half way."""
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    c = Chunk((0, 0, 0), (1, 1, 1))
    shape = ClusterShape(workers=1, memory_limit_bytes=100 * MiB, resting_bytes=40 * MiB, kill_fraction=0.9)
    ends = []
    for need in (500 * MiB, 100 * MiB, 52 * MiB, 50 * MiB):
        sim = SimulatedCluster(shape)  # 50 MiB above the resting 40 MiB before the kill line at 90 MiB
        sim.submit(_Task(0, c, (1, 1, 1), need, 40.0))
        end = sim.next()
        ends.append((end.at, end.killed))
    assert ends == [(2.0, True), (10.0, True), (pytest.approx(20 * 50 / 52), True), (40.0, False)]


def test_a_task_dies_when_its_memory_reaches_the_kill_line_on_the_rise_its_operator_was_measured_to_have(tmp_path):
    """An operator that reached half its peak 0.6 of the way through its runs and 90% of it 0.9 of the way (a
    Gram matrix filled by BLAS) dies late; one that reached them 0.05 and 0.1 of the way (a block read first)
    dies early; the learned rise reaches the simulated task from the store's models."""
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.learn.bank import BankKnowledge, ModelBank
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import Draws, _Task

    c = Chunk((0, 0, 0), (1, 1, 1))
    shape = ClusterShape(workers=1, memory_limit_bytes=100 * MiB, resting_bytes=40 * MiB, kill_fraction=0.9)
    ends = []
    for rise in (None, (0.6, 0.9), (0.05, 0.1)):
        sim = SimulatedCluster(shape)  # 50 MiB of headroom: a 100 MiB task dies when it holds half its peak
        sim.submit(_Task(0, c, (1, 1, 1), 100 * MiB, 40.0, rise=rise))
        end = sim.next()
        ends.append((end.at, end.killed))
    assert ends == [(10.0, True), (pytest.approx(24.0), True), (pytest.approx(2.0), True)]

    with Store(tmp_path / "obs.sqlite") as store:
        store.add_many(Observation("late|float32|cpu", n, (1, 1, n), 4 * n, 20 * MiB + 40 * n, seconds=1.0,
                                   rise_50=0.5 + 0.05 * i, rise_90=0.9)
                       for i, n in enumerate((2**16, 2**17, 2**18, 2**19)))
    bank = ModelBank(Store(tmp_path / "obs.sqlite"))
    draws = Draws(BankKnowledge(bank, "late|float32|cpu", DEFAULT_SETTINGS), "late|float32|cpu", 0.0)
    assert draws.rise == (pytest.approx(0.575), 0.9)
    assert draws.task(0, c, (1, 1, 2**18), np.random.default_rng(0)).rise == draws.rise
    assert Draws(BankKnowledge(bank, "other|float32|cpu", DEFAULT_SETTINGS), "other", 0.0).rise is None


def _where(seconds: float) -> str:
    import time

    from distributed import get_worker

    time.sleep(seconds)
    return get_worker().address


def test_tasks_go_to_the_least_occupied_worker_as_on_a_real_dask_cluster():
    """Two tasks on two idle workers of two threads: Dask runs one on each; so does the simulator (a map of two
    chunks would otherwise double the memory of one worker and leave the other idle)."""
    from distributed import Client, LocalCluster

    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    with LocalCluster(n_workers=2, threads_per_worker=2, processes=False, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        client.wait_for_workers(2)
        real = client.gather([client.submit(_where, 0.5, pure=False) for _ in range(2)])
    sim = SimulatedCluster(ClusterShape(workers=2, threads_per_worker=2, memory_limit_bytes=1000 * MiB))
    for sid in range(2):
        sim.submit(_Task(sid, Chunk((sid, 0, 0), (sid + 1, 1, 1)), (1, 1, 1), 10 * MiB, 0.5))
    simulated = [w for w, tasks in sim.running.items() for _ in tasks]
    assert len(set(real)) == len(set(simulated)) == 2


@pytest.mark.parametrize("threads_per_core, tasks, ends", [(1.0, 4, 1.0), (2.0, 4, 2.0), (2.0, 2, 1.0)])
def test_tasks_beyond_the_cores_share_them_and_take_as_much_longer(threads_per_core, tasks, ends):
    """2 workers x 2 threads on 2 cores (2 threads a core): 4 tasks of 1 s of compute run at half speed and end
    at 2 s; 2 of them have a core each. With a core per thread, 4 end at 1 s."""
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    sim = SimulatedCluster(ClusterShape(workers=2, threads_per_worker=2, memory_limit_bytes=1000 * MiB,
                                        threads_per_core=threads_per_core))
    for sid in range(tasks):
        sim.submit(_Task(sid, Chunk((sid, 0, 0), (sid + 1, 1, 1)), (1, 1, 1), 10 * MiB, 1.0))
    assert [round(sim.next().at, 6) for _ in range(tasks)] == [ends] * tasks


@pytest.mark.parametrize("seconds, overhead, ends", [(1.0, 0.0, 2.0), (1.0, 0.8, 0.8 * 2 + 0.2),
                                                     (1.5, 0.5, 0.5 * 2 + 1.0 * (4 * (1.0 / 1.5)) * 2 / 4)])
def test_the_cores_are_shared_by_the_work_running_not_by_the_tasks_overhead(seconds, overhead, ends):
    """4 tasks on 2 workers x 2 threads over 2 cores. All work, each takes twice its 1 s. With 0.8 s of each
    second Prefect's and Dask's hand-over, the overhead takes twice as long (4 tasks in flight on 2 cores) but the
    0.2 s of work (0.8 of a task's worth on 4 half-cores) fits the cores; with 0.5 s of 1.5 s overhead, the work
    (2/3 of each task, 8/3 tasks' worth) runs 4/3 as long."""
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import _Task

    sim = SimulatedCluster(ClusterShape(workers=2, threads_per_worker=2, memory_limit_bytes=1000 * MiB,
                                        threads_per_core=2.0))
    for sid in range(4):
        sim.submit(_Task(sid, Chunk((sid, 0, 0), (sid + 1, 1, 1)), (1, 1, 1), 10 * MiB, seconds,
                         overhead_seconds=overhead))
    assert [round(sim.next().at, 6) for _ in range(4)] == [round(ends, 6)] * 4


def test_an_operator_never_run_is_simulated_cold_from_a_stated_prior_and_flagged(tmp_path, capsys):
    from memchunk_prefect.sim.inputs import PriorKnowledge, store_models

    with Store(tmp_path / "s.sqlite"):
        pass  # an empty store: nothing learned
    models = store_models(str(tmp_path / "s.sqlite"), prior=PriorKnowledge(40.0, 1e-6))
    step = Step.of("gst3d_dip")
    cluster = ClusterShape(workers=2, memory_limit_bytes=2**30, resting_bytes=250 * MiB)
    # A survey larger than the probe waves: nothing learned before, the runner probes twice, then plans the rest.
    r = run_strategy("memchunk", [step], (256, 256, 200), cluster, models.knowledge, np.random.default_rng(0),
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


# =========================================================================== HPC allocations: queue waits, walltime


def _hpc(**kw):
    from dataclasses import replace

    from memchunk_prefect.sim.allocation import QueueWait

    wait = kw.pop("wait", None)
    return replace(CLUSTER, queue_wait=QueueWait.parse(wait) if wait else None, **kw)


def test_workers_that_cannot_hold_one_trace_column_are_a_labelled_failure_saying_what_to_do():
    r = run("memchunk", Known(bpe=1e6))  # one 100-sample trace column: 100 MB of a 55 MiB budget
    assert not r.completed and "even the smallest chunk allowed (one trace column" in r.failure
    assert "Give workers more memory" in r.failure and r.out_of_memory == 0, "refused before anything ran"


def test_jobs_that_wait_in_the_queue_start_the_work_late_and_are_charged_from_their_start():
    r = run("static-4", cluster=_hpc(wait="5s"))
    assert r.completed and r.makespan_seconds == pytest.approx(5 + 2 * (0.04 + 0.1)), "submission to the end"
    assert r.core_hours == pytest.approx(2 * 2 * (0.04 + 0.1) / 3600), "held from each job's start, not submission"
    assert r.slot_utilisation == pytest.approx(1.0)
    assert r.energy_joules == pytest.approx(run("static-4").energy_joules), "waiting in the queue costs no energy"


def test_no_queue_wait_and_no_walltime_simulate_exactly_as_before():
    for strategy in ("memchunk", "static-4", "split"):
        a, b = run(strategy, Known(bpe=400.0), seed=3), run(strategy, Known(bpe=400.0), seed=3, cluster=_hpc(wait="0"))
        assert (a.makespan_seconds, a.out_of_memory, a.core_hours) == (b.makespan_seconds, b.out_of_memory,
                                                                        b.core_hours)


def test_a_walltime_before_the_work_is_done_loses_the_running_tasks_and_fails_saying_so():
    r = run("static-4", cluster=_hpc(walltime_seconds=0.2))
    assert not r.completed and r.walltime_losses == 2 and r.out_of_memory == 0
    assert "every worker reached its 0.2 s walltime with work left" in r.failure
    assert "--walltime" in r.failure
    m = run("memchunk", cluster=_hpc(walltime_seconds=0.1))
    assert not m.completed and "walltime" in m.failure and m.out_of_memory == 0


def test_jobs_arriving_one_by_one_each_work_as_soon_as_they_join():
    # Eight jobs, waits exponential with a 2 s mean, ~13 s of work for one slot. On the runner's own cluster
    # the map plans for the eight requested; on a scheduler started elsewhere it sees one worker at its start,
    # so cuts the survey for it, and follows the slots as jobs join (machine.SlotsChanged): where the budget
    # cuts the survey into more chunks than one slot's cap of 2, the late jobs get work as they join (without
    # following them: 2 at once, 26.6 s against 10.5 s).
    for external, know, shape in ((False, Known(spe=8e-5), SHAPE), (True, Known(bpe=800.0, spe=8e-5), (160, 40, 100))):
        cluster = _hpc(wait="exp:2s", workers=8, external=external)
        r = run("memchunk", know, shape=shape, cluster=cluster, seed=1)
        assert r.completed and min(r.joins) > 0
        first = min(r.joins)
        assert all(e.task.started >= first for e in r.ended), "nothing runs before the first job starts"
        spans = [(e.task.started, e.at) for e in r.ended]
        most = max(sum(a <= t < b for a, b in spans) for t, _ in spans)
        assert most >= 6, f"external={external}: at most {most} chunks ran at once: joined jobs were left idle"


def test_window_utilisation_is_the_mean_of_each_jobs_share_and_the_model_sits_beside_the_simulation():
    from memchunk_prefect.sim.allocation import held_fraction
    from memchunk_prefect.sim.simulate import allocation_check, window_utilisation

    cluster = _hpc(wait="exp:2s", workers=6, walltime_seconds=30.0)
    results = [run("memchunk", Known(spe=8e-5), cluster=cluster, seed=s) for s in range(12)]
    window = 4.0
    for r in results:  # U(T0) = (1/N) sum u_i a(Q_i), by construction
        u_run, _ = window_utilisation(r, cluster, window)
        held = held_fraction(np.asarray(r.joins), window, cluster.walltime_seconds)
        busy = [0.0] * cluster.workers
        for e in r.ended:
            busy[e.task.worker] += max(0.0, min(e.at, window) - min(e.task.started, window))
        assert u_run == pytest.approx(sum(b / (cluster.threads_per_worker * window) for b in busy) / cluster.workers)
        assert all(h >= 0 for h in held)
    a = allocation_check(results, cluster, window=window, target=0.5)
    assert a.runs == 12 and 0.0 <= a.p_simulated <= 1.0
    # The work outlasts the window: jobs are busy from their arrival, and the independent-jobs model holds.
    assert a.job_utilisation_p50 > 0.9
    assert abs(a.model.mean - np.mean([window_utilisation(r, cluster, window)[0] for r in results])) < 0.05
    assert abs(a.model.p_exact - a.p_simulated) < 0.35


def test_the_command_line_simulates_an_allocation_and_its_utilisation(tmp_path, capsys):
    from memchunk_prefect import operators
    from memchunk_prefect.operators import operator_key

    key = operator_key(operators.OPERATORS["gst3d_dip"], {}, dtype="float32")
    with Store(tmp_path / "s.sqlite") as store:
        seed_store(store, key, 40 * 4.0, sizes=(20_000, 50_000, 100_000, 200_000, 400_000, 800_000))
    argv = ["simulate", "--store", str(tmp_path / "s.sqlite"), "--steps", "gst3d_dip", "--shape", "128", "128", "400",
            "--workers", "4", "--memory-limit", "1GiB", "--runs", "3", "--strategies", "memchunk",
            "--queue-wait", "lognormal:1s,5s", "--walltime", "1h", "--utilisation", "0.5", "--window", "10"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "an allocation of 4 batch jobs (one worker each), log-normal queue waits, median 1 s, p90 5 s" in out, out
    assert "memchunk: P(U >= 0.5 within 10 s) simulated" in out and "model" in out
    assert cli.main([*argv, "--json"]) == cli.EXIT_OK
    got = json.loads(capsys.readouterr().out)["strategies"][0]["allocation"]
    assert got["runs"] == 3 and 0 <= got["model"]["p_exact"] <= 1 and "u_samples" not in got
    assert cli.main([*argv[:-4], "--utilisation", "0.5"]) == cli.EXIT_USAGE
    assert "needs a window" in capsys.readouterr().err
    assert cli.main([*argv[:-6], "--queue-wait", "soon"]) == cli.EXIT_USAGE
    assert "cannot read the queue wait 'soon'" in capsys.readouterr().err


def test_recommend_with_queue_waits_needs_more_workers_and_asks_for_the_walltime_given():
    easy = _recommend(3.0, max_workers=16)
    queued = _recommend(3.0, max_workers=16, queue_wait=__import__(
        "memchunk_prefect.sim.allocation", fromlist=["QueueWait"]).QueueWait.parse("1s"), walltime_seconds=600.0)
    assert easy.best is not None and queued.best is not None
    assert queued.best.workers >= easy.best.workers, "a second of each deadline is spent in the queue"
    assert queued.jobqueue_kwargs()["walltime"] == "00:10:00"
    confirmed = [c for c in queued.tried if not c.screened]
    assert queued.best in confirmed and all(c.summary.runs <= 20 for c in queued.tried)
    assert any(c.screened and c.summary.runs == 1 for c in queued.tried), "the search screens with one run"
    assert easy.jobqueue_kwargs()["walltime"] == "00:00:03"


def test_a_workers_first_task_takes_what_first_calls_of_its_size_took_even_below_the_models_later_call():
    """The model reads a block of 80,000 elements (static-2's) at 0.8 s; first calls of that size took 0.3 s, one-off
    cost and compute together: each worker's first task takes 0.3 s and its overhead, not 0.8 s and a first call;
    static-4's second task on each worker, not a first call, takes the model's seconds."""

    @dataclass
    class Timed(Known):
        whole: float | None = 0.3

        def first_call_block_seconds(self, elements):
            return self.whole if elements == 80_000 else None

    assert run("static-2", Timed(spe=1e-5)).makespan_seconds == pytest.approx(0.3 + 0.1)
    assert run("static-2", Timed(spe=1e-5, whole=None, first_call=0.2)).makespan_seconds == pytest.approx(
        0.8 + 0.2 + 0.1)  # no first call of its size: the model's seconds and the learned first call
    # static-4: blocks of 40,000 elements, no first call of that size timed: the learned first call, then the model.
    assert run("static-4", Timed(spe=1e-5, first_call=0.2)).makespan_seconds == pytest.approx(2 * (0.4 + 0.1) + 0.2)


def test_a_first_task_drawn_from_first_calls_of_its_size_strays_with_them_and_is_charged_its_own_energy():
    """With a spread of 0.4, a first task of a block whose first calls took 0.3 s (the model reads 0.8 s) takes
    0.3 s x the drawn factor and its overhead: its 90th percentile 0.3 x e^(0.4 x 1.28) + 0.1, never below the
    overhead; a first task shorter than its drawn seconds is charged the energy of the time it ran."""
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.sim.cluster import SimulatedCluster
    from memchunk_prefect.sim.inputs import Draws

    @dataclass
    class Timed(Known):
        def first_call_block_seconds(self, elements):
            return 0.3

    draws, rng = Draws(Timed(spe=1e-5), KEY, 0.1, time_sigma=0.4), np.random.default_rng(5)
    box = Chunk((0, 0, 0), (20, 40, 100))
    tasks = [draws.task(i, box, box.shape, rng) for i in range(2000)]
    first = np.array([t.seconds + t.first_call_seconds for t in tasks])
    assert first.min() > 0.1
    assert np.quantile(first, 0.9) == pytest.approx(0.3 * math.exp(0.4 * 1.2816) + 0.1, rel=0.05)
    assert np.median(first) == pytest.approx(0.4, rel=0.05)
    sim = SimulatedCluster(dataclasses.replace(CLUSTER, workers=1))
    task = tasks[0]
    per_second = task.joules / task.seconds
    sim.submit(task)
    ended = sim.next()
    assert ended.task.seconds == pytest.approx(first[0]) and sim.busy_joules == pytest.approx(per_second * first[0])


def test_a_blocks_seconds_stray_by_the_operators_learned_spread_and_widen_the_p90():
    """An operator whose runs strayed far from its time model (a learned spread of 0.5) is drawn with that
    spread, one without a learned spread, or with one below it, with the stated ``time_sigma`` (a spread measured
    in sample over few runs reads low); a plan of one block per slot then ends with its slowest block, and its p90
    lies further above its p50 than the shared run factor alone puts it (:func:`run_factor`, at the stated
    ``RUN_SPREAD`` where nothing is learned)."""
    from memchunk_prefect.sim.inputs import Draws

    @dataclass
    class Strays(Known):
        spread: float | None = 0.5

        def time_spread(self):
            return self.spread

    assert Draws(Strays(), KEY, 0.1, time_sigma=0.1).time_sigma == 0.5
    assert Draws(Strays(spread=None), KEY, 0.1, time_sigma=0.1).time_sigma == 0.1
    assert Draws(Strays(spread=0.02), KEY, 0.1, time_sigma=0.1).time_sigma == 0.1
    assert Draws(Known(), KEY, 0.1, time_sigma=0.1).time_sigma == 0.1
    wide, narrow = (simulate(["static-2"], [STEP], SHAPE, CLUSTER, lambda key, k=k: k, runs=40, time_sigma=0.02)[0]
                    for k in (Strays(spe=1e-5), Strays(spe=1e-5, spread=0.02)))
    shared = math.exp(RUN_SPREAD * statistics.NormalDist().inv_cdf(0.9))  # the run factor's p90 over its p50
    assert wide.makespan_p90 / wide.makespan_p50 > 1.1 * shared
    assert narrow.makespan_p90 / narrow.makespan_p50 < 1.03 * shared


def test_a_simulated_runs_blocks_share_one_time_factor_and_the_runs_spread_over_its_quantiles():
    """Every block of one simulated run is slowed alike by the run's factor (:func:`run_factor`, at the learned run
    spread, never below the stated ``RUN_SPREAD``): over 40 runs at evenly spread quantiles, the p50 is the
    median run's makespan and the p90 that of the run at the factor's 90th percentile; a learned spread of 0.3
    puts the p90 further above the p50 than one of 0.02, which counts as ``RUN_SPREAD``. A quantile outside (0, 1)
    is a typed error."""
    from memchunk_prefect.sim.inputs import run_factor, run_spread

    @dataclass
    class Runs(Known):
        runs: float | None = 0.3

        def run_spread(self):
            return self.runs

    wide, narrow = Runs(spe=1e-5), Runs(spe=1e-5, runs=0.02)
    assert run_spread([wide]) == 0.3 and run_spread([narrow]) == run_spread([Known()]) == RUN_SPREAD
    assert run_factor([wide], None) == 1.0
    assert run_factor([wide], 0.9) == pytest.approx(math.exp(0.3 * statistics.NormalDist().inv_cdf(0.9)))
    for q in (0.0, 1.0):
        with pytest.raises(SimulationInputError, match="quantile"):
            run_factor([wide], q)
    (s,) = simulate(["static-2"], [STEP], SHAPE, CLUSTER, lambda key: wide, runs=40, time_sigma=0.01)
    median = run_strategy("static-2", [STEP], SHAPE, CLUSTER, lambda key: wide, np.random.default_rng(0),
                          time_sigma=0.01).makespan_seconds
    slow = run_strategy("static-2", [STEP], SHAPE, CLUSTER, lambda key: wide, np.random.default_rng(0),
                        time_sigma=0.01, run_quantile=0.9).makespan_seconds
    assert s.makespan_p50 == pytest.approx(median, rel=0.02)
    assert s.makespan_p90 == pytest.approx(slow, rel=0.03)
    (n,) = simulate(["static-2"], [STEP], SHAPE, CLUSTER, lambda key: narrow, runs=40, time_sigma=0.01)
    assert s.makespan_p90 / s.makespan_p50 > 1.2 > n.makespan_p90 / n.makespan_p50 > 1.05


def test_a_simulated_cold_run_records_its_chunks_as_the_runner_records_real_ones():
    """The planner of a simulated cold run learns from the run's own chunks, as the runner does from real ones: each
    chunk's observation times its block function (not the per-task overhead), marks its worker's first call of the
    operator, and gives what it grew its worker and the kernel seconds that cost. The learner then reads the
    truth's rate, first call and growth cost back, none of them counted into another."""
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.sim.inputs import LearningKnowledge

    truth = Known(spe=1e-6, first_call=0.3, touch=1e-9)
    learner = LearningKnowledge(ModelBank(None), KEY, DEFAULT_SETTINGS)
    seen = []
    original = learner.learn

    def learn(obs):
        seen.append(obs)
        original(obs)

    learner.learn = learn  # type: ignore[method-assign]
    r = run_strategy("memchunk", [STEP], (80, 80, 100), CLUSTER, lambda key: learner, np.random.default_rng(0),
                     time_sigma=0.0, truth_for=lambda key: truth)
    assert r.completed and len(seen) >= 4
    firsts = [o for o in seen if o.first_call]
    assert {o.worker for o in firsts} == {"sim-0", "sim-1"} and len(firsts) == 2, "one first call per worker"
    for o in seen:
        touch = o.grew_bytes * 1e-9
        assert o.sys_seconds == pytest.approx(touch)
        assert o.seconds == pytest.approx(o.elements * 1e-6 + (0.3 if o.first_call else 0.0) + touch)
    assert any(o.grew_bytes > 0 for o in seen), "probes of rising size grow their workers"
    # Growth below the first-touch line stays in a run's seconds, as on a real worker: the rate reads a little high,
    # never the 0.1 s overhead a chunk of 16,000-208,000 elements (0.016-0.21 s) would add, nor a first call.
    assert 1e-6 <= learner.seconds_per_element() < 1.1e-6
    assert learner.first_call_seconds() == pytest.approx(0.3, rel=0.1)
