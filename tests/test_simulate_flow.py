"""A recorded flow run of a user's own operators, simulated on another survey and cluster: CLI and Python.

The operators are user-style ones (``benchmarks/family/archetypes.py``, none of them registered built-ins),
run by a real flow on a real Prefect server and LocalCluster; the store the run left is what the simulator
reads. Stores of older schemas and keys with too little history are built by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sqlite3

import pytest

from memchunk_prefect.cli import app as cli
from memchunk_prefect.core.errors import (
    FlowRunRecordError,
    SimulationInputError,
    StoreError,
    TooLittleHistoryError,
    UnknownStepError,
)
from memchunk_prefect.core.records import MapRun, Observation
from memchunk_prefect.learn.store import Store
from memchunk_prefect.sim import from_flow_run, recommend_flow_run, recorded_flow, step_for
from memchunk_prefect.testing import seed_store

GiB = 2**30
MiB = 2**20
BOX = "my_box[r=2]|float32|cpu"


# =========================================================================== a real flow run, recorded


@pytest.fixture(scope="module")
def recorded_store(tmp_path_factory, prefect_server):
    """The store of one real flow run of user operators: fam_linear -> fam_gram over its output, and fam_linear
    again over the survey (not chained), on 2 workers of 1 GiB."""
    from prefect import flow

    from benchmarks.family.archetypes import fam_gram, fam_linear
    from memchunk_prefect import MemoryAwareRunner, chunked, synthetic_survey
    from memchunk_prefect.testing import start_local_cluster

    tmp = tmp_path_factory.mktemp("recorded")
    survey = tmp / "survey.sgy"
    synthetic_survey(survey, (24, 20, 60), seed=3)
    store = tmp / "store.sqlite"
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(store), output_dir=str(tmp / "out"),
                                   progress=False)

        @flow(name="user-operators", task_runner=runner)
        def user_flow(path: str) -> list[dict]:
            boxed = fam_linear.map(chunked(path), k=4.0, h=1, passes=1)
            gram = fam_gram.map(chunked(boxed), h=0)
            plain = fam_linear.map(chunked(path), k=2.0, h=0, passes=1)
            return [r.summary() for r in (boxed, gram, plain)]

        user_flow(str(survey))
    finally:
        cluster.close()
    return store


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.slow
def test_a_recorded_flow_of_user_operators_is_simulated_on_another_survey_and_cluster(recorded_store, capsys):
    with Store(recorded_store) as s:
        maps = s.maps()
        rec = recorded_flow(s, "latest")
    # What the store kept of each map: its parameters, whole traces and the cluster it ran on.
    assert {(m.workers, m.threads_per_worker, m.memory_limit_bytes) for m in maps} == {(2, 1, GiB)}
    assert all(m.whole_traces is True and m.params and m.resting_bytes for m in maps)
    # The threads per core the budget counted: 2 one-thread workers on this machine's usable cores.
    cores = len(os.sched_getaffinity(0))
    assert {m.threads_per_core for m in maps} == {max(1.0, 2 / min(2, cores))}
    # In the order the maps started: fam_gram's map waits for its upstream's first decision, and the second
    # fam_linear (over the survey) is called after that wait, so either of the two may start first.
    assert [s.operator for s in rec.steps] in (["fam_linear", "fam_gram", "fam_linear"],
                                               ["fam_linear", "fam_linear", "fam_gram"])
    chained = [None, 0, None] if rec.steps[1].operator == "fam_gram" else [None, None, 0]
    assert [s.upstream_index(i) for i, s in enumerate(rec.steps)] == chained  # chaining as it ran
    assert rec.steps[0].key == "fam_linear[k=4]|float32|cpu" and rec.steps[0].halo == (1, 1, 0)
    assert rec.params[0] == {"h": 1, "k": 4.0, "passes": 1} and rec.shape == (24, 20, 60)

    # The CLI, on a survey 4x the traces and a cluster of 4 workers of 2 GiB.
    argv = ["simulate", "--store", str(recorded_store), "--flow-run", "latest", "--shape", "48", "40", "60",
            "--workers", "4", "--memory-limit", "2GiB", "--runs", "3", "--strategies", "memchunk", "static-2"]
    assert cli.main([*argv, "--json"]) == cli.EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert got["flow_run"] == rec.flow_run_id and got["shape"] == [48, 40, 60] and got["cluster"]["workers"] == 4
    assert [s["upstream"] for s in got["steps"]] == chained
    memchunk = got["strategies"][0]
    assert memchunk["completed"] == 3 and len(memchunk["chunks_per_map"]) == 3 and memchunk["makespan_p50"] > 0
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    described = ("fam_linear(h=1, k=4.0, passes=1) -> fam_gram(h=0); fam_linear" if chained == [None, 0, None] else
                 "fam_linear(h=1, k=4.0, passes=1); fam_linear(h=0, k=2.0, passes=1); fam_gram(h=0) (reads fam_linear)")
    assert f"flow run {rec.flow_run_id}: {described}" in out, out

    # The same question from Python, with a deadline: what a deployment asks before it starts.
    plan = from_flow_run(recorded_store, "latest", shape=(48, 40, 60), workers=4, memory_limit="2GiB", runs=3,
                         deadline=3600)
    assert plan.completes and plan.meets_deadline is True and len(plan.chunks_per_step) == 3
    assert plan.kills == 0 and plan.makespan_seconds is not None and plan.makespan_seconds < 3600
    assert from_flow_run(recorded_store, runs=3, deadline=1e-3).meets_deadline is False
    # Every figure not given is the recorded run's.
    same = from_flow_run(recorded_store, runs=1)
    assert (same.shape, same.cluster.workers, same.cluster.memory_limit_bytes) == ((24, 20, 60), 2, GiB)
    json.dumps(plan.to_dict())

    # The cluster to ask for, by CLI and by Python.
    assert cli.main(["recommend", "--store", str(recorded_store), "--flow-run", "latest", "--shape", "48", "40", "60",
                     "--deadline", "1h", "--memory", "1GiB", "2GiB", "--runs", "3", "--max-workers", "8",
                     "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["best"]["workers"] >= 1
    assert recommend_flow_run(recorded_store, deadline="1h", memory_options=["1GiB"], runs=3, max_workers=4).best

    # Steps by operator key work for any key in the store; a name with two keys must be given exactly.
    assert cli.main(["simulate", "--store", str(recorded_store), "--steps", "fam_linear[k=4]|float32|cpu", "fam_gram",
                     "--shape", "48", "40", "60", "--workers", "2", "--memory-limit", "1GiB", "--runs", "2",
                     "--strategies", "memchunk"]) == cli.EXIT_OK
    assert "fam_linear -> fam_gram on 48 x 40 x 60" in capsys.readouterr().out
    assert cli.main(["simulate", "--store", str(recorded_store), "--steps", "fam_linear", "--shape", "8", "8", "8",
                     "--workers", "2", "--memory-limit", "1GiB"]) == cli.EXIT_USAGE
    assert "'fam_linear' names 2 operator keys in the store" in capsys.readouterr().err


# =========================================================================== stores built by hand


def _observation(key: str, n: int, flow_run: str = "fr1", peak_per_element: float = 40.0) -> Observation:
    return Observation(key, n, (1, n // 100, 100), 4 * n, int(peak_per_element * n), seconds=1e-6 * n,
                       flow_run_id=flow_run, method="seeded")


def _map(flow_run: str, key: str, **kw) -> MapRun:
    d = dict(flow_run_id=flow_run, operator=key.split("[")[0].split("|")[0], operator_key=key, source="/s.sgy",
             output_path=f"/out/{key.split('[')[0]}.zarr", shape=(64, 64, 100), halo=(2, 2, 2), itemsize=4, slots=2,
             budget_bytes=700 * MiB, started_at=100.0, ended_at=110.0, map_id=f"{flow_run}-{key}")
    d.update(kw)
    return MapRun(**d)


def test_a_key_with_too_little_history_is_a_typed_error_saying_how_many_runs_it_has(tmp_path, capsys):
    path = tmp_path / "s.sqlite"
    with Store(path) as s:
        s.add_many([_observation(BOX, 20_000), _observation(BOX, 20_000)])  # one flow run, one size
        s.add_map(_map("fr1", BOX, workers=2, threads_per_worker=1, memory_limit_bytes=GiB, whole_traces=False))
    with pytest.raises(TooLittleHistoryError) as err:
        from_flow_run(path, "latest", runs=1)
    assert (err.value.key, err.value.runs, err.value.observations) == (BOX, 1, 2)
    assert "1 flow run(s) and 2 finished chunk(s)" in str(err.value) and "--prior-multiple" in str(err.value)
    assert isinstance(err.value, SimulationInputError)
    argv = ["simulate", "--store", str(path), "--flow-run", "latest", "--runs", "1"]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert f"{BOX} has too little history to simulate: 1 flow run(s)" in capsys.readouterr().err
    # With a stated prior it is simulated cold, and says so.
    from memchunk_prefect.sim.inputs import PriorKnowledge

    plan = from_flow_run(path, "latest", runs=1, prior=PriorKnowledge(40.0, 1e-6))
    assert plan.completes and "stated prior" in plan.notes[0]


def test_an_unknown_key_or_flow_run_is_a_typed_error_listing_what_the_store_holds(tmp_path, capsys):
    path = tmp_path / "s.sqlite"
    with Store(path) as s:
        seed_store(s, BOX, 40.0)
        s.add_map(_map("3f2a9c1e-0000", BOX, workers=2, threads_per_worker=1, memory_limit_bytes=GiB))
        with pytest.raises(UnknownStepError, match=r"unknown operator 'my_bxo'.*it holds: my_box\[r=2\]") as err:
            step_for("my_bxo", s)
        assert isinstance(err.value, KeyError) and isinstance(err.value, SimulationInputError)
        step = step_for("my_box", s)  # the one key of that operator, its halo from its recorded map
        assert (step.key, step.halo, step.whole_traces) == (BOX, (2, 2, 2), True)
        assert step_for({"key": BOX, "halo": [0, 0, 3], "whole_traces": False}, s).halo == (0, 0, 3)
        assert recorded_flow(s, "3f2a").flow_run_id == "3f2a9c1e-0000"  # the start of an id is enough
        with pytest.raises(FlowRunRecordError, match="no flow run 'nope' is recorded.*the most recent: 3f2a9c1e"):
            recorded_flow(s, "nope")
    argv = ["simulate", "--store", str(path), "--steps", "my_bxo", "--shape", "8", "8", "8", "--workers", "2",
            "--memory-limit", "1GiB"]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "unknown operator 'my_bxo'" in capsys.readouterr().err
    assert cli.main([*argv[:3], "--flow-run", "latest", "--steps", "my_box"]) == cli.EXIT_USAGE
    assert "not both" in capsys.readouterr().err


def _v10_store(path, maps: list[MapRun]) -> None:
    """A schema-v10 store, as an older version left it: its maps without the v11 columns."""
    from memchunk_prefect.learn.store import _CREATE_V2, MIGRATIONS, _execute_script

    con = sqlite3.connect(path, isolation_level=None)
    _execute_script(con, _CREATE_V2)
    con.execute("INSERT INTO meta VALUES ('application', 'memchunk-prefect')")
    for version in range(2, 10):
        MIGRATIONS[version](con)
    con.execute("PRAGMA user_version = 10")
    columns = [r[1] for r in con.execute("PRAGMA table_info(maps)") if r[1] != "id"]
    for m in maps:
        row = {**m.to_dict(), "shape": ",".join(map(str, m.shape)), "halo": ",".join(map(str, m.halo))}
        con.execute(f"INSERT INTO maps ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                    [row[c] for c in columns])
    con.close()


def test_a_flow_run_in_an_old_store_says_what_it_lacks_and_runs_once_it_is_given(tmp_path):
    path = tmp_path / "old.sqlite"
    other = "my_gram|float32|cpu"
    _v10_store(path, [_map("fr1", BOX), _map("fr1", other, source="/out/my_box.zarr", started_at=101.0)])
    with Store(path) as s:  # opened by this version: migrated to v11, the old maps' new columns unknown
        seed_store(s, BOX, 40.0)
        seed_store(s, other, 12.0)
        assert s.maps()[0].workers is None
    with pytest.raises(FlowRunRecordError, match=r"recorded without the cluster.*give --workers \(workers=\) and "
                                                 r"--memory-limit \(memory_limit=\)"):
        from_flow_run(path, "fr1", runs=1)
    plan = from_flow_run(path, "fr1", workers=2, memory_limit="1GiB", runs=2, shape=(32, 32, 100))
    assert plan.completes and [s.upstream_index(i) for i, s in enumerate(plan.steps)] == [None, 0]
    # Not a built-in operator and not recorded: whether it keeps traces whole is assumed, and said.
    assert any("my_box: whether it keeps traces whole was not recorded" in n for n in plan.recorded.notes)


def test_a_deadline_is_seconds_a_duration_a_datetime_or_a_time_of_day():
    import datetime as dt

    from memchunk_prefect.sim.plan import deadline_seconds

    now = dt.datetime(2030, 1, 1, 22, 0).timestamp()
    assert deadline_seconds(dt.time(6, 0), now=now) == 8 * 3600  # 6 am tomorrow
    assert deadline_seconds("45min", now=now) == 2700 and deadline_seconds(None) is None
    with pytest.raises(SimulationInputError, match="give one in the future"):
        deadline_seconds(dt.datetime(2029, 1, 1), now=now)


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.slow
def test_the_how_to_runs_its_commands_and_its_python_as_written(recorded_store, monkeypatch, capsys):
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "how-to" / "simulate-a-flow.md").read_text()
    marked = re.findall(r"<!-- tests/test_simulate_flow.py runs [^\n]*\n```(\w+)\n(.*?)```", text, flags=re.S)
    assert [kind for kind, _ in marked] == ["bash", "python", "bash"]
    monkeypatch.setenv("MEMCHUNK_STORE", str(recorded_store))
    commands = [shlex.split(line) for line in marked[0][1].splitlines() if line.strip()]
    assert len(commands) == 3 and all(c[0] == "memchunk" for c in commands)
    for argv in commands:
        assert cli.main(argv[1:]) == cli.EXIT_OK, (argv, capsys.readouterr())
    (track,) = [shlex.split(line) for line in marked[2][1].splitlines() if line.strip()]
    assert cli.main(track[1:]) == cli.EXIT_OK
    assert "1 past flow run(s) of this flow predicted again" in capsys.readouterr().out
    scope: dict = {}
    exec(compile(marked[1][1], "simulate-a-flow.md", "exec"), scope)
    assert scope["plan"].completes and "meets the deadline: " in capsys.readouterr().out


# =========================================================================== the store's track record


def test_the_track_record_predicts_the_real_flow_run_again_beside_the_makespan_it_had(recorded_store, capsys):
    from memchunk_prefect.sim import track_record

    with Store(recorded_store) as s:
        maps = s.maps()
    record = track_record(recorded_store, runs=2)
    (row,) = record.rows
    # The store's only flow run: its keys had no earlier observation, so it is predicted as a cold run.
    assert row.cold and row.maps == 3 and not record.skipped
    assert row.real_seconds == pytest.approx(max(m.ended_at for m in maps) - min(m.started_at for m in maps))
    assert row.p50_seconds is not None and row.p90_seconds is not None and row.p50_seconds <= row.p90_seconds
    assert row.error == pytest.approx(row.p50_seconds / row.real_seconds - 1)
    assert record.deadline_factor is None
    assert "a booking factor needs 5 predicted runs, this store has 1" in record.summary_line()
    json.dumps(record.to_dict())
    argv = ["simulate", "--store", str(recorded_store), "--flow-run", "latest", "--runs", "2", "--strategies",
            "memchunk", "--track-record", "3"]
    assert cli.main(argv) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "track record (the store's latest completed flow runs" in out and row.flow_run_id[:8] in out
    assert "1 past flow run(s) of this flow predicted again: makespan error median" in out
    assert cli.main([*argv, "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["track_record"]["rows"][0]["flow_run_id"] == row.flow_run_id


def test_the_track_record_books_the_p90_times_what_held_for_nine_in_ten_past_runs(tmp_path, capsys):
    """Six flow runs of one key, each 10 s apart and each taking longer than the last: the first is cold (no
    earlier observation), the rest warm; a run that failed a map is left out, saying why."""
    from memchunk_prefect.sim.track import MIN_RUNS_FOR_FACTOR, TrackRecord, TrackRow, track_record

    path = tmp_path / "s.sqlite"
    cluster = dict(workers=2, threads_per_worker=1, memory_limit_bytes=GiB, kill_fraction=0.95,
                   resting_bytes=200 * MiB, whole_traces=False, params="{}")
    with Store(path) as s:
        for i in range(7):
            run, start = f"fr{i}", 1000.0 + 100 * i
            s.add_many([dataclasses.replace(_observation(BOX, n, run), created_at=start + 1)
                        for n in (20_000, 50_000, 100_000, 200_000)])
            s.add_map(_map(run, BOX, started_at=start, ended_at=start + 2.0 + i, **cluster,
                           outcome="failed" if i == 3 else "ok"))
        # Another flow of the same store, earlier: an operator it never learned.
        s.add_map(_map("other", "my_other|float32|cpu", started_at=900.0, ended_at=901.0, **cluster))
    pooled = track_record(path, runs=2)
    assert "other: " in pooled.skipped[-1] and not pooled.same_flow  # every flow of the store, this one unplannable
    record = track_record(path, runs=2, flow_run="fr6")  # the runs of fr6's flow only
    assert record.same_flow and "of this flow" in record.summary_line()
    assert [r.flow_run_id for r in record.rows] == ["fr0", "fr1", "fr2", "fr4", "fr5", "fr6"]
    assert [r.cold for r in record.rows] == [True, False, False, False, False, False]
    assert record.skipped == ["fr3: did not finish every map"]
    assert [r.real_seconds for r in record.rows] == [2.0, 3.0, 4.0, 6.0, 7.0, 8.0]
    ratios = sorted(r.real_seconds / r.p90_seconds for r in record.rows)
    # The 90th percentile of six ratios is the largest; never below 1 (a p90 that always held needs none).
    assert record.deadline_factor == pytest.approx(max(1.0, ratios[-1]))
    assert f"book at {record.deadline_factor:.2f}x the p90" in record.summary_line()
    assert len(track_record(path, runs=2, last=2).rows) == 2  # the latest two
    # recommend books with it: the simulated runs held to the deadline over the factor, the jobs' walltime the
    # deadline itself.
    argv = ["recommend", "--store", str(path), "--flow-run", "latest", "--deadline", "2h", "--memory", "1GiB",
            "--runs", "2", "--max-workers", "4", "--track-record", "10"]
    assert cli.main([*argv, "--json"]) == cli.EXIT_OK
    got = json.loads(capsys.readouterr().out)
    assert got["planned_deadline_seconds"] == pytest.approx(7200 / record.deadline_factor)
    assert got["deadline_seconds"] == 7200 and got["jobqueue"]["walltime"] == "02:00:00"
    assert got["track_record"]["deadline_factor"] == pytest.approx(record.deadline_factor)
    assert cli.main(argv) == cli.EXIT_OK
    assert f"held to {7200 / record.deadline_factor:.0f} s of the 7200 s deadline" in capsys.readouterr().out
    with pytest.raises(SimulationInputError, match=r"--track-record N, last=\) and 1 .*got 0 and 10"):
        track_record(path, last=0)
    with pytest.raises(StoreError, match="no store at .*typo.sqlite: .*--store"):  # never created by a typo
        track_record(tmp_path / "typo.sqlite")
    assert not (tmp_path / "typo.sqlite").exists()
    # Fewer runs than a 90th percentile needs: no factor; ten that all ended early: a factor of 1.
    row = TrackRow("r", 0.0, False, 1.0, 2.0, 2.5, 1)
    assert TrackRecord([row] * (MIN_RUNS_FOR_FACTOR - 1)).deadline_factor is None
    assert TrackRecord([row] * 10).deadline_factor == 1.0 and TrackRecord([row] * 10).held_by_p90 == 10
    late = [TrackRow(f"r{i}", 0.0, False, 1.0 + 0.1 * i, 1.0, 1.05, 1) for i in range(10)]
    assert TrackRecord(late).deadline_factor == pytest.approx(1.8 / 1.05) and TrackRecord(late).held_by_p90 == 1


def test_simulate_and_recommend_say_how_far_whole_runs_strayed_and_whether_the_store_taught_it(tmp_path, capsys):
    """Four flow runs of one key, every block of a run off by that run's own factor: the store teaches the spread
    every block of a simulated run shares (six pairs of runs), and `simulate` and `recommend` say so, in words
    and in their JSON; with one flow run it is the stated least, saying why."""
    from memchunk_prefect.learn.bank import MIN_RUN_PAIRS
    from memchunk_prefect.sim.inputs import RUN_SPREAD

    cluster = dict(workers=2, threads_per_worker=1, memory_limit_bytes=GiB, kill_fraction=0.95,
                   resting_bytes=200 * MiB, whole_traces=False, params="{}")
    stores = {}
    for name, factors in (("four", (1.0, 1.6, 0.7, 1.25)), ("one", (1.0,))):
        path = stores[name] = tmp_path / f"{name}.sqlite"
        with Store(path) as s:
            for i, factor in enumerate(factors):
                run, start = f"fr{i}", 1000.0 + 100 * i
                s.add_many([dataclasses.replace(_observation(BOX, n, run), seconds=1e-6 * n * factor,
                                                created_at=start + 1) for n in (20_000, 50_000, 100_000, 200_000)])
                s.add_map(_map(run, BOX, started_at=start, ended_at=start + 2.0, **cluster))
    argv = ["simulate", "--store", str(stores["four"]), "--flow-run", "latest", "--runs", "4", "--strategies",
            "static-2"]
    assert cli.main([*argv, "--json"]) == cli.EXIT_OK
    spread = json.loads(capsys.readouterr().out)["run_spread"]
    assert spread["learned_from_pairs"] == 6 and spread["sigma"] == spread["learned"] > RUN_SPREAD
    assert cli.main(argv) == cli.EXIT_OK
    assert (f"sigma {spread['sigma']:.2f} (how far 6 pairs of flow runs of one operator in the store strayed from "
            "the models)") in capsys.readouterr().out
    assert cli.main(["simulate", "--store", str(stores["one"]), "--flow-run", "latest", "--runs", "2"]) == cli.EXIT_OK
    assert (f"sigma {RUN_SPREAD:.2f} (the stated least: the store has 0 pair(s) of flow runs of one operator with "
            f"timed blocks, fewer than {MIN_RUN_PAIRS}") in capsys.readouterr().out
    recommend = ["recommend", "--store", str(stores["four"]), "--flow-run", "latest", "--deadline", "1h", "--memory",
                 "1GiB", "--runs", "2", "--max-workers", "2"]
    assert cli.main([*recommend, "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["run_spread"] == spread
    assert cli.main(recommend) == cli.EXIT_OK
    assert f"sigma {spread['sigma']:.2f} (how far 6 pairs" in capsys.readouterr().out


def test_a_maps_record_keeps_the_threads_per_core_only_where_its_budget_read_the_workers_cores():
    """Counted from the cores the workers may run on, the figure is kept; where those were not read, the budget's
    1.0 is an assumption, and the record says nothing (a simulation then counts the machines' cores)."""
    from memchunk_prefect.core.budget import Budget
    from memchunk_prefect.run.map_records import cluster_shape

    read = Budget(slots=4, budget_bytes=MiB, resting_bytes={"a": MiB}, reason="", threads_per_worker=2,
                  threads_per_core=2.0, cores_read=True)
    assert cluster_shape(read, 4)["threads_per_core"] == 2.0
    assert cluster_shape(dataclasses.replace(read, threads_per_core=1.0, cores_read=False), 4)["threads_per_core"] \
        is None


def test_a_recorded_run_of_more_threads_than_cores_is_simulated_sharing_them_on_its_own_cluster_only(tmp_path):
    """2 workers of 2 threads on a 2-core machine: each slot had half a core, so the simulated tasks there run
    longer as the runner's plans counted; on another cluster shape the recorded machine says nothing."""
    path = tmp_path / "s.sqlite"
    with Store(path) as s:
        s.put_machines({"node-a": {"cpu": {"coreCount": 2}}})
        # Three addresses: one worker restarted by its nanny under a new port; the run had 2 workers.
        s.add_many([dataclasses.replace(_observation(BOX, n), host="node-a", worker=f"tcp://a:{1 + i % 3}")
                    for i, n in enumerate((20_000, 50_000, 100_000, 200_000))])
        s.add_map(_map("fr1", BOX, workers=2, threads_per_worker=2, memory_limit_bytes=GiB, whole_traces=False))
        rec = recorded_flow(s, "latest")
    assert rec.cluster is not None and rec.cluster.threads_per_core == 2.0
    assert rec.cluster_shape().threads_per_core == 2.0
    assert rec.cluster_shape(workers=8).threads_per_core == 1.0  # another cluster: its cores are not known
    assert from_flow_run(path, runs=1).cluster.threads_per_core == 2.0
    with Store(path) as s:  # 8 cores: a core for each of the 4 threads
        s.put_machines({"node-a": {"cpu": {"coreCount": 8}}})
        assert recorded_flow(s, "latest").cluster.threads_per_core == 1.0
    with Store(path) as s:  # a machine whose cores were not recorded: nothing is assumed
        s.put_machines({"node-a": {"cpu": {}}})
        assert recorded_flow(s, "latest").cluster.threads_per_core is None
    with Store(path) as s:  # a map that kept the count its budget made (store v14) is taken at its word: the
        # workers' affinity (a batch job's cpuset of 2 cores on this 8-core machine), not the machine's cores
        s.put_machines({"node-a": {"cpu": {"coreCount": 8}}})
        s.add_map(_map("fr2", BOX, workers=2, threads_per_worker=2, memory_limit_bytes=GiB, whole_traces=False,
                       threads_per_core=2.0, started_at=5.0, ended_at=6.0))
        assert recorded_flow(s, "fr2").cluster.threads_per_core == 2.0
        assert recorded_flow(s, "fr1").cluster.threads_per_core == 1.0
