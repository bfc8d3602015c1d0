"""MemoryAwareRunner on real Dask clusters, a real Prefect server and real SEG-Y files.

Out-of-memory events here are real: a worker process crossing its nanny's
memory limit is killed, and a MemoryError is raised by a real failed allocation.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prefect import flow, task, unmapped
from prefect_dask import DaskTaskRunner
from rich.console import Console

from memchunk_prefect import MemoryAwareRunner, chunked, open_segy, operators, synthetic_survey
from memchunk_prefect.core.errors import EnvironmentProblemError, RunnerConfigError
from memchunk_prefect.learn.store import Store
from memchunk_prefect.operators import operator_key
from memchunk_prefect.run.progress import TerminalProgress
from memchunk_prefect.testing import (
    KILL_HOLD_S,
    dask_cli,
    limit_address_space,
    memory_hog,
    seed_store,
    start_local_cluster,
)

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("prefect_server")]

GiB = 2**30


@pytest.fixture(scope="module")
def cluster():
    c = start_local_cluster(n_workers=2, memory_limit="1GiB")
    yield c
    c.close()


@pytest.fixture(scope="module")
def survey(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("survey") / "survey.sgy"
    synthetic_survey(path, (24, 20, 150), seed=3)
    return str(path)


@pytest.fixture(scope="module")
def learnable_survey(tmp_path_factory) -> str:
    """A survey large enough for cold probes to measure two block sizes 1.5x apart with gst3d_dip's 12-trace halo
    (on the 24 x 20 survey every chunk reads nearly the whole of it: the model cannot tell a fixed part from a
    slope there, and says so by probing again)."""
    path = tmp_path_factory.mktemp("learnable") / "survey.sgy"
    synthetic_survey(path, (64, 48, 150), seed=3)
    return str(path)


@pytest.fixture(scope="module")
def big_survey(tmp_path_factory) -> str:
    """1.2 M samples (4.6 MiB): a memory_hog at 450x needs ~2 GiB in one piece."""
    path = tmp_path_factory.mktemp("big") / "big.sgy"
    synthetic_survey(path, (48, 50, 500), seed=5)
    return str(path)


def runner_for(cluster, tmp_path, **kw) -> MemoryAwareRunner:
    return MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"),
                             output_dir=str(tmp_path / "out"), **kw)


def crashed_task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        TaskRunFilter,
        TaskRunFilterState,
        TaskRunFilterStateName,
    )

    with get_client(sync_client=True) as client:
        return client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
            task_run_filter=TaskRunFilter(state=TaskRunFilterState(name=TaskRunFilterStateName(any_=["Crashed"]))),
        )


def unfinished_task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [r for r in runs if r.state and r.state.type.value in ("RUNNING", "PENDING", "SCHEDULED")]


# ----------------------------------------------------------------------------- construction


def test_runner_carries_every_setting_through_duplicate_and_eq(tmp_path):
    r = MemoryAwareRunner(address="tcp://127.0.0.1:1", memory_budget="512MiB", target_fraction=0.6,
                          store=tmp_path / "s.sqlite", output_dir=tmp_path, policy={"per_task_overhead_seconds": 1.0},
                          progress=False)
    d = r.duplicate()
    assert d == r and d is not r and d.progress is False
    assert (d.memory_budget, d.target_fraction, d.store, d.output_dir) == (512 * 2**20, 0.6, r.store, r.output_dir)
    assert d.policy.per_task_overhead_seconds == 1.0
    assert d != MemoryAwareRunner(address="tcp://127.0.0.1:1", memory_budget="1GiB")


def test_a_store_that_cannot_be_written_stops_the_flow_before_a_cluster_starts(tmp_path, survey):
    (tmp_path / "a-file").write_text("")
    runner = MemoryAwareRunner(cluster_kwargs={"n_workers": 1, "processes": True},
                               store=tmp_path / "a-file" / "store.sqlite", output_dir=tmp_path / "out")

    @flow(task_runner=runner)
    def light(path: str):
        return operators.envelope.map(chunked(path)).result()

    with pytest.raises(EnvironmentProblemError, match=r"(?s)cannot start, nothing was run.*store: .*a-file.*"
                                                      r"MEMCHUNK_STORE"):
        light(survey)
    assert not (tmp_path / "out").exists(), "nothing was written"


def test_zero_argument_runner_is_a_local_cluster_with_one_thread_per_worker():
    r = MemoryAwareRunner()
    assert r.cluster_kwargs["threads_per_worker"] == 1 and r.cluster_kwargs["processes"] is True
    assert r.cluster_kwargs["dashboard_address"].startswith("127.0.0.1")


def test_runner_pickles_small_for_task_submissions():
    import cloudpickle

    assert len(cloudpickle.dumps(MemoryAwareRunner())) < 4000


@pytest.mark.parametrize("kwargs, match", [
    ({"target_fraction": 1.2}, "target_fraction"),
    ({"memory_budget": "lots"}, "memory_budget"),
    ({"memory_budget": -1}, "memory_budget"),
    ({"policy": {"no_such_setting": 1}}, "unknown setting"),
    ({"cluster": object()}, "address="),
])
def test_bad_runner_arguments_are_typed_errors_naming_the_argument(kwargs, match):
    with pytest.raises(RunnerConfigError, match=match):
        MemoryAwareRunner(**kwargs)


# ----------------------------------------------------------------------------- plain maps


@task
def add(x, y):
    return x + y


def test_plain_maps_behave_exactly_as_with_dask_task_runner(cluster, tmp_path):
    def run_with(runner):
        @flow(task_runner=runner)
        def plain():
            futures = add.map([1, 2, 3], unmapped(10))
            return [f.result() for f in futures], [f.state.name for f in futures]

        return plain()

    expected = run_with(DaskTaskRunner(address=cluster.scheduler_address))
    assert run_with(runner_for(cluster, tmp_path)) == expected == ([11, 12, 13], ["Completed"] * 3)


# ----------------------------------------------------------------------------- chunked maps


def test_chunked_pipeline_equals_whole_volume_result_cold_then_warm(cluster, learnable_survey, tmp_path):
    survey = learnable_survey
    runner = runner_for(cluster, tmp_path)

    @flow(task_runner=runner)
    def pipeline(path: str):
        env = operators.envelope.map(chunked(path))
        dip = operators.gst3d_dip.map(chunked(env))
        return env.summary(), dip.summary(), dip.result().values

    volume = open_segy(survey).values
    reference = operators.gst3d_dip.fn(operators.envelope.fn(volume))

    cold_env, cold_dip, cold = pipeline(survey)
    np.testing.assert_allclose(cold, reference, atol=1e-5 * np.abs(reference).max())
    assert cold_env["decisions"][0] == "probe" and cold_dip["decisions"][0] == "probe"

    warm_env, warm_dip, warm = pipeline(survey)
    np.testing.assert_allclose(warm, reference, atol=1e-5 * np.abs(reference).max())
    store = os.path.realpath(tmp_path / "store.sqlite")
    held = [f for f in os.listdir("/proc/self/fd") if os.path.realpath(f"/proc/self/fd/{f}").startswith(store)]
    assert not held, "a finished flow run left its store open (2 descriptors a run in a long-lived process)"
    for cold_s, warm_s in ((cold_env, warm_env), (cold_dip, warm_dip)):
        assert "retry-smaller" not in warm_s["decisions"] and "probe" not in warm_s["decisions"]
        assert warm_s["tasks"] <= cold_s["tasks"]
        assert warm_s["oom_events"] == 0


def test_workers_validate_the_flows_settings_at_most_once_and_reuse_them_and_their_api_client_for_later_chunks(
        survey, tmp_path):
    """Each chunk's task run hydrates the flow's Prefect context on its worker; the first chunk there installs
    memchunk_prefect.run.hydration and keeps its own settings under the key of their serialization. Where that key is
    what the flow sends (the usual case), every later chunk reuses them; where it is not (seen once in the full
    suite, a worker's serialization differing from the flow's), the second chunk validates them once and the rest
    reuse them. Two flow runs of the same settings on a fresh cluster (the module-scoped one's workers may have it
    installed already)."""
    from distributed import Client

    from memchunk_prefect.run import hydration

    with start_local_cluster(n_workers=2, memory_limit="1GiB") as fresh, Client(fresh.scheduler_address) as client:
        assert all(s["seeded"] == s["reused"] == 0 for s in client.run(hydration.stats).values())

        @flow(task_runner=runner_for(fresh, tmp_path))
        def one_map(path: str):
            env = operators.envelope.map(chunked(path))
            return env.summary(), env.result().values

        runs = [one_map(survey), one_map(survey)]
        stats = client.run(hydration.stats)
        clients = client.run(hydration.client_stats)
    expected = operators.envelope.fn(open_segy(survey).values)
    for _, values in runs:
        np.testing.assert_allclose(values, expected, rtol=1e-5, atol=1e-5)
    chunks = sum(summary["tasks"] for summary, _ in runs)
    assert chunks >= 5, [summary for summary, _ in runs]  # more chunks than the two workers' first and second
    ran = [s for s in stats.values() if s["seeded"]]
    assert ran and all(s["seeded"] == 1 and s["validated"] <= 1 for s in ran), stats  # one settings: at most once
    # Every chunk after a worker's first found its settings kept, or (at most once per worker) validated them.
    assert sum(s["reused"] + s["validated"] for s in ran) == chunks - len(ran), stats
    assert sum(s["reused"] for s in ran) >= chunks - 2 * len(ran) >= 1, stats
    # And the API client: each single-thread worker opens one at its second chunk, and every later chunk is given
    # it (Prefect builds two per task run), across both flow runs, which share their settings.
    assert all(clients[w]["opened"] <= 1 and clients[w]["open"] == clients[w]["opened"] for w in clients), clients
    assert sum(clients[w]["opened"] + clients[w]["reused"] for w in clients) == chunks - len(ran), clients
    assert sum(clients[w]["reused"] for w in clients) >= chunks - 2 * len(ran), clients


def test_light_operator_continues_and_heavy_operator_rechunks(cluster, survey, tmp_path, monkeypatch):
    import dataclasses

    from memchunk_prefect.run import executor

    # Each map's end trims its key to the newest 3 rows.
    monkeypatch.setattr(executor, "RUNNER_SETTINGS", dataclasses.replace(executor.RUNNER_SETTINGS, store_keep_per_key=3))
    store = Store(tmp_path / "store.sqlite")
    light = operator_key(operators.envelope, {})
    heavy = operator_key(operators.gst3d_dip, {})
    seed_store(store, light, 12.0, fixed_bytes=2 * 2**20)
    seed_store(store, operator_key(operators.cosine_phase, {}), 12.0, fixed_bytes=2 * 2**20)
    seed_store(store, heavy, 4 * 60.0, fixed_bytes=2 * 2**20)
    store.close()
    # A 16 MiB budget: envelope/cosine_phase fit the whole survey twice over; gst3d_dip does not.
    runner = runner_for(cluster, tmp_path, memory_budget="16MiB")

    @flow(task_runner=runner)
    def pipeline(path: str):
        env = operators.envelope.map(chunked(path))
        cos = operators.cosine_phase.map(chunked(env))
        dip = operators.gst3d_dip.map(chunked(cos))
        return env.summary(), cos.summary(), dip.summary()

    env, cos, dip = pipeline(survey)
    assert env["decisions"] == ["rechunk"]  # a file has no chunking to keep
    assert cos["decisions"] == ["continue"]
    assert dip["decisions"][0] == "rechunk" and "over the budget" in dip["reasons"][0]
    assert dip["oom_events"] == 0
    with Store(tmp_path / "store.sqlite") as s:  # the seeded rows made way for this run's, but for other sizes'
        for key in (light, heavy):
            kept = s.observations(key)
            older = kept[:-3]  # besides the newest 3, only the newest row of each (size, outcome) stays
            assert kept[-1].method != "seeded" and len(kept) < 5 + env["tasks"] + dip["tasks"], [
                (o.method, o.elements) for o in kept]
            assert len({(o.elements, o.outcome) for o in older}) == len(older), [(o.method, o.elements) for o in kept]
            assert not {(o.elements, o.outcome) for o in older} & {(o.elements, o.outcome) for o in kept[-3:]}


def test_worker_killed_for_memory_is_split_recovered_crashed_and_not_repeated(cluster, big_survey, tmp_path):
    key = operator_key(memory_hog, {"multiple": 450})
    store = Store(tmp_path / "store.sqlite")
    seed_store(store, key, 4 * 100.0)  # the model believes 100x: a 4x under-prediction
    store.close()
    terminal = io.StringIO()
    progress = TerminalProgress(console=Console(file=terminal, width=400), live=False)
    runner = runner_for(cluster, tmp_path, observers=[progress], progress=False)

    @flow(task_runner=runner)
    def hog(path: str):
        from prefect.runtime import flow_run

        out = memory_hog.map(chunked(path), multiple=450, seconds=KILL_HOLD_S)
        return flow_run.id, out.summary(), out.events, out.result().values

    run_id, summary, events, values = hog(big_survey)
    assert any(e["event"] == "killed" for e in events), events
    assert "retry-smaller" in summary["decisions"]
    np.testing.assert_array_equal(values, open_segy(big_survey).values)
    killed = [o for o in Store(tmp_path / "store.sqlite").observations(key) if o.outcome == "killed"]
    assert killed and all(o.censored and o.chunk and o.peak_bytes > 0 for o in killed), \
        "the flow side records the killed run with its chunk, as a censored observation"
    crashed = crashed_task_runs(run_id)
    assert crashed and all(r.name.startswith("memory_hog[") for r in crashed)
    assert not unfinished_task_runs(run_id)
    # What the terminal showed: one line for the map, with the out-of-memory events it recovered.
    killed_events = sum(e["event"] == "killed" for e in events)
    line, = terminal.getvalue().splitlines()
    assert line.startswith(f"memory_hog  {summary['chunks']} chunks, 48 x 50 x 500 in ") and \
        f"avoided, {killed_events} recovered" in line, line

    _, again, events2, values2 = hog(big_survey)
    assert again["oom_events"] == 0 and "retry-smaller" not in again["decisions"], events2
    np.testing.assert_array_equal(values2, values)


def test_memory_error_inside_the_task_is_split_and_the_worker_survives(big_survey, survey, tmp_path):
    cluster = start_local_cluster(n_workers=2, memory_limit="8GiB")
    try:
        from distributed import Client

        # A small map first, so each worker's thread pools (zarr's I/O, Dask's) and their stacks and malloc
        # arenas exist before the limit is read from its address space: how many there are grows with the
        # core count (a 16-core machine's pools used the whole slack and every chunk failed).
        @flow(task_runner=MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "w.sqlite"),
                                            output_dir=str(tmp_path / "warm")))
        def warm(path: str):
            memory_hog.map(chunked(path), multiple=1).wait()

        warm(survey)
        with Client(cluster.scheduler_address) as client:
            workers_before = set(client.scheduler_info()["workers"])
            # Allocations past +1.5 GiB of address space raise MemoryError. The slack above the halves' ~1.2 GB
            # leaves room for what a worker still reserves as it runs.
            client.run(limit_address_space, 1536 * 2**20)
        # The hog needs 1000x its input (4000 B per element); the store claims 250x: a 4x under-prediction,
        # so the planned halves of the survey (~2.4 GB each) fail to allocate and their halves (~1.2 GB) fit.
        key = operator_key(memory_hog, {"multiple": 1000})
        store = Store(tmp_path / "store.sqlite")
        seed_store(store, key, 4 * 250.0)
        store.close()
        runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"),
                                   output_dir=str(tmp_path / "out"), memory_budget="4GiB")

        @flow(task_runner=runner)
        def hog(path: str):
            out = memory_hog.map(chunked(path), multiple=1000)
            return out.summary(), out.events, out.result().values

        summary, events, values = hog(big_survey)
        assert any(e["event"] == "memory_error" for e in events), events
        assert not any(e["event"] == "killed" for e in events)
        assert "retry-smaller" in summary["decisions"]
        np.testing.assert_array_equal(values, open_segy(big_survey).values)
        with Client(cluster.scheduler_address) as client:
            assert set(client.scheduler_info()["workers"]) == workers_before, "no worker died"
    finally:
        cluster.close()


def test_a_librarys_first_use_in_a_chunk_is_the_workers_and_chunks_are_planned_for_the_block(tmp_path):
    """The first chunk on each worker loads a library it then keeps (first_use_hog: 150 MiB kept, as a GPU task's
    host side keeps CUDA's libraries). Measured with it as the block's peak, the cold map planned 16 chunks (this
    test on the code before) where 2 fit: a 160 MiB peak read as a cost per element. Learned as the worker's, the
    survey is cut for the block, and a fresh cluster's workers, which pay it again, fit it."""
    from memchunk_prefect.testing import first_use_hog

    path = tmp_path / "survey.sgy"
    synthetic_survey(path, (96, 64, 400), seed=3)
    summaries = []
    for _ in range(2):  # a fresh cluster each run, as the runner's own: every worker pays the first use again
        c = start_local_cluster(n_workers=2, memory_limit="640MiB")
        try:
            @flow(task_runner=runner_for(c, tmp_path))
            def hog(p: str):
                return first_use_hog.map(chunked(p), first_use_mib=150.0).summary()

            summaries.append(hog(str(path)))
        finally:
            c.close()
    cold, warm = summaries
    assert cold["oom_events"] == 0 and warm["oom_events"] == 0
    assert cold["tasks"] <= 10, cold["reasons"]
    assert warm["tasks"] <= 4 and "probe" not in warm["decisions"], warm["reasons"]
    key = operator_key(first_use_hog, {"first_use_mib": 150.0})
    with Store(tmp_path / "store.sqlite") as s:
        rows = s.observations(key)
    left = sorted(o.retained_bytes for o in rows)
    assert len(left) == cold["tasks"] + warm["tasks"]
    assert all(x > 140 * 2**20 for x in left[-4:]), "each worker's first chunk, in each run, kept the library"
    assert all(x < 16 * 2**20 for x in left[:-4]), "the others kept nothing of their block"
    firsts = [o for o in rows if o.first_call]
    assert len(firsts) == 4 and all(o.retained_bytes > 140 * 2**20 for o in firsts), \
        "each worker process's first call of the operator, in each run, is the one that loaded the library"


def test_a_table_larger_than_a_threads_share_runs_one_task_per_worker_and_never_two_on_one(tmp_path):
    """2 workers x 2 threads x 900 MiB: a thread's share is about 370 MiB, and table_hog's 400 MiB table (learned
    from earlier runs) fits only a task alone on its worker. Without the worker's whole budget the map failed
    with BudgetTooSmallError before anything ran; two such tasks on one worker would cross its kill line."""
    from memchunk_prefect.testing import table_hog

    path = tmp_path / "survey.sgy"
    synthetic_survey(path, (32, 16, 200), seed=3)
    key = operator_key(table_hog, {"table_mib": 400.0})
    with Store(tmp_path / "store.sqlite") as s:
        seed_store(s, key, 16.0, fixed_bytes=400 * 2**20)
    c = start_local_cluster(n_workers=2, memory_limit="900MiB", threads_per_worker=2)
    try:
        @flow(task_runner=runner_for(c, tmp_path))
        def tables(p: str):
            return table_hog.map(chunked(p), table_mib=400.0).summary()

        summary = tables(str(path))
    finally:
        c.close()
    assert summary["oom_events"] == 0
    assert any(r.startswith("one task per worker (2 slots, not 2 x 2 threads)") for r in summary["reasons"]), \
        summary["reasons"]
    with Store(tmp_path / "store.sqlite") as s:
        rows = [o for o in s.observations(key) if o.method != "seeded"]
    assert len(rows) == summary["tasks"] >= 2
    assert len({o.worker for o in rows}) == 2, "both workers ran chunks"
    for worker in {o.worker for o in rows}:
        spans = sorted((o.created_at - o.seconds, o.created_at) for o in rows if o.worker == worker)
        assert all(b[0] >= a[1] - 0.05 for a, b in zip(spans, spans[1:])), f"two chunks at once on {worker}: {spans}"


def test_on_the_runners_own_two_thread_workers_no_chunk_of_any_map_runs_beside_one_that_runs_alone(tmp_path):
    """The runner's own local cluster of 2-thread workers offers the slot resource. table_hog's map runs alone
    (each chunk all of a worker's share: ~400 MiB of table and ~300 MiB of scratch, two of which would cross a
    worker's kill line); a light map chained after it (a thread's share each) starts on the chunks written while
    table_hog's later chunks run. Dask never puts a light chunk beside a table_hog chunk on its worker."""
    from memchunk_prefect.testing import table_hog

    path = tmp_path / "survey.sgy"
    synthetic_survey(path, (64, 32, 200), seed=3)
    key = operator_key(table_hog, {"table_mib": 400.0, "multiple": 750.0})
    with Store(tmp_path / "store.sqlite") as s:
        seed_store(s, key, 3010.0, fixed_bytes=400 * 2**20)
    runner = MemoryAwareRunner(cluster_kwargs={"n_workers": 2, "threads_per_worker": 2, "memory_limit": "900MiB",
                                               "dashboard_address": "127.0.0.1:0"},
                               store=str(tmp_path / "store.sqlite"), output_dir=str(tmp_path / "out"))
    assert runner.cluster_kwargs["resources"] == {"memchunk-slots": 2}

    @flow(task_runner=runner)
    def chain(p: str):
        tables = table_hog.map(chunked(p), table_mib=400.0, multiple=750.0, seconds=1.0)
        light = memory_hog.map(chunked(tables), multiple=2.0, seconds=0.5)
        return [r.summary() for r in (tables, light)]

    tables, light = chain(str(path))
    assert tables["oom_events"] == light["oom_events"] == 0
    assert any(r.startswith("one task per worker") for r in tables["reasons"]), tables["reasons"]
    with Store(tmp_path / "store.sqlite") as s:
        alone = [o for o in s.observations(key) if o.method != "seeded"]
        others = s.observations(operator_key(memory_hog, {"multiple": 2.0}))
    assert len(alone) >= 3 and others, (len(alone), len(others))
    for a in alone:
        beside = [o for o in alone + others if o is not a and o.worker == a.worker
                  and o.created_at - o.seconds < a.created_at - 0.05 and a.created_at - a.seconds < o.created_at - 0.05]
        assert not beside, f"{a.chunk} ran alone on {a.worker}, beside {[o.chunk for o in beside]}"


def test_workers_stuck_over_the_pause_line_stop_the_map_saying_what_memory_limit_would_do(tmp_path, monkeypatch):
    """A worker past Dask's pause line takes no task until its memory falls. One that keeps what pushed it there
    (first_use_hog keeps 450 MiB after its first chunk, as a GPU worker keeps CUDA's host libraries: on an NVIDIA
    H100 the demo's 1 GiB worker paused so after its first chunk, and the map waited until it was killed) never
    runs again. With every worker so, the map stops with WorkersPausedError naming the memory held and the
    memory_limit that would do, instead of waiting for ever; the chunk written is kept, and nothing is learned as
    out of memory. Pause line at 0.5 of a 1 GiB limit here (kill line 0.95), so a fresh worker's ~0.3 GiB is
    below it and one with the library above it."""
    import dataclasses

    import dask

    from memchunk_prefect.core.errors import WorkersPausedError
    from memchunk_prefect.run import executor
    from memchunk_prefect.testing import first_use_hog

    monkeypatch.setattr(executor, "RUNNER_SETTINGS", dataclasses.replace(
        executor.RUNNER_SETTINGS, paused_stall_seconds=4.0, pause_poll_seconds=0.5))
    path = tmp_path / "survey.sgy"
    synthetic_survey(path, (48, 32, 200), seed=4)
    with dask.config.set({"distributed.worker.memory.pause": 0.5, "distributed.worker.memory.terminate": 0.95}):
        c = start_local_cluster(n_workers=1, memory_limit="1GiB")
    try:
        @flow(task_runner=runner_for(c, tmp_path))
        def hog(p: str):
            return first_use_hog.map(chunked(p), first_use_mib=450.0, multiple=1.0).summary()

        started = time.monotonic()
        with pytest.raises(WorkersPausedError) as err:
            hog(str(path))
        waited = time.monotonic() - started
    finally:
        c.close()
    msg = str(err.value)
    assert "first_use_hog cannot go on" in msg and "every worker of the cluster (1)" in msg, msg
    assert "pause line" in msg and "0.5 of memory_limit" in msg and "memory_limit of at least" in msg, msg
    assert waited < 90, waited
    with Store(tmp_path / "store.sqlite") as s:
        rows = s.observations(operator_key(first_use_hog, {"first_use_mib": 450.0, "multiple": 1.0}))
    assert [o.outcome for o in rows].count("ok") >= 1 and all(o.outcome == "ok" for o in rows), rows


def test_unsplittable_chunk_fails_the_flow_naming_operator_chunk_and_budget(cluster, tmp_path):
    runner = runner_for(cluster, tmp_path, memory_budget="8MiB")
    volume = np.random.default_rng(0).normal(size=(2, 2, 64)).astype(np.float32)

    @flow(task_runner=runner)
    def doomed():
        # 10^9 x a 256-byte trace is 256 GB of scratch: the allocation fails (MemoryError) even for one trace
        return memory_hog.map(chunked(volume), multiple=10**9).result()

    with pytest.raises(MemoryError) as err:
        doomed()
    msg = str(err.value)
    assert "memory_hog" in msg and "cannot be split" in msg and "budget" in msg


# ----------------------------------------------------------------------------- an external scheduler


def _wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear in {timeout} s")
        time.sleep(0.2)


class _ExternalCluster:
    """A ``dask scheduler`` process and ``dask worker`` processes (1 thread, 1 GiB each), started as a user would."""

    def __init__(self, tmp_path: Path):
        self.sched_file = tmp_path / "scheduler.json"
        self.env = dict(os.environ, DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES="0")
        self.procs = [subprocess.Popen([*dask_cli("scheduler"), "--host", "127.0.0.1", "--port", "0",
                                        "--dashboard-address", "127.0.0.1:0", "--scheduler-file", str(self.sched_file)],
                                       env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        _wait_for_file(self.sched_file)
        import json

        self.address = json.loads(self.sched_file.read_text())["address"]

    def add_worker(self) -> None:
        self.procs.append(subprocess.Popen([*dask_cli("worker"), "--scheduler-file", str(self.sched_file),
                                            "--nthreads", "1", "--memory-limit", "1GiB", "--host", "127.0.0.1"],
                                           env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def wait_for_workers(self, n: int) -> None:
        from distributed import Client

        with Client(self.address) as client:
            client.wait_for_workers(n, timeout=90)

    def close(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def test_external_scheduler_with_two_worker_processes_runs_the_same_flow(survey, tmp_path):
    ext = _ExternalCluster(tmp_path)
    try:
        for _ in range(2):
            ext.add_worker()
        ext.wait_for_workers(2)
        runner = MemoryAwareRunner(address=ext.address, store=str(tmp_path / "s.sqlite"),
                                   output_dir=str(tmp_path / "o"))

        @flow(task_runner=runner)
        def smooth(path: str):
            out = operators.gaussian_smooth.map(chunked(path), sigma=(1.0, 1.0, 2.0))
            return out.events, out.result().values

        events, values = smooth(survey)
        volume = open_segy(survey).values
        reference = operators.gaussian_smooth.fn(volume, sigma=(1.0, 1.0, 2.0))
        np.testing.assert_allclose(values, reference, atol=1e-5 * np.abs(reference).max())
        assert len({e["worker"] for e in events if e["event"] == "ok"}) == 2, "both worker processes ran chunks"
    finally:
        ext.close()


def test_a_worker_joining_mid_map_raises_the_maps_slots(big_survey, tmp_path, caplog):
    """A batch job's worker that joins after the map started (dask-jobqueue's queue wait, an adaptive cluster):
    the running map reads the cluster's threads between chunks and keeps the newcomer busy, not only the slots
    there were at its start."""
    import logging
    import threading

    ext = _ExternalCluster(tmp_path)
    try:
        ext.add_worker()
        ext.wait_for_workers(1)
        runner = MemoryAwareRunner(address=ext.address, store=str(tmp_path / "s.sqlite"),
                                   output_dir=str(tmp_path / "o"), memory_budget="48MiB")

        @flow(task_runner=runner)
        def hog(path: str):
            out = memory_hog.map(chunked(path), multiple=40, seconds=1.0)
            return out.events, out.result().values

        # The second job leaves the queue while the map runs (the flow is pickled into every task run: the timer
        # stays out of it).
        joiner = threading.Timer(3.0, ext.add_worker)
        joiner.start()
        with caplog.at_level(logging.INFO, logger="memchunk_prefect"):
            events, values = hog(big_survey)
        joiner.join()
        np.testing.assert_array_equal(values, open_segy(big_survey).values)
        assert any("now has 2 worker threads (1 when the map started)" in r.getMessage() for r in caplog.records), \
            "the map never saw the second worker"
        late = [e for e in events if e["event"] == "ok"]
        assert len({e["worker"] for e in late}) == 2, "the worker that joined mid-map ran chunks"
    finally:
        ext.close()


def test_a_scheduler_that_retries_dead_workers_tasks_is_named_in_a_warning_once(cluster, tmp_path, caplog):
    """Dask's default allowed-failures (3) on a scheduler started elsewhere: the runner says so, and how to fix it."""
    from distributed import LocalCluster

    volume = np.random.default_rng(1).normal(size=(8, 6, 64)).astype(np.float32)

    def run(address: str) -> None:
        runner = MemoryAwareRunner(address=address, store=str(tmp_path / "s.sqlite"), output_dir=str(tmp_path / "o"))

        @flow(task_runner=runner)
        def two_maps(v):
            first = operators.envelope.map(chunked(v))
            return operators.envelope.map(chunked(first)).result().values

        two_maps(volume)

    warned = "allowed-failures=3"
    with LocalCluster(n_workers=1, threads_per_worker=1, memory_limit="1GiB", dashboard_address="127.0.0.1:0",
                      host="127.0.0.1") as default_cluster, caplog.at_level("WARNING", logger="memchunk_prefect"):
        run(default_cluster.scheduler_address)
    ours = [r.getMessage() for r in caplog.records if r.name == "memchunk_prefect.run.runner" and warned in r.getMessage()]
    assert len(ours) == 1, ours  # once per flow run, not once per map
    assert default_cluster.scheduler_address in ours[0] and "ALLOWED_FAILURES=0" in ours[0]

    caplog.clear()
    with caplog.at_level("WARNING", logger="memchunk_prefect"):
        run(cluster.scheduler_address)  # started with allowed-failures 0 (memchunk_prefect.testing)
    assert not [r for r in caplog.records if "allowed-failures" in r.getMessage()]


def test_cluster_class_given_as_a_string_runs_a_chunked_flow(survey, tmp_path):
    runner = MemoryAwareRunner(cluster_class="distributed.LocalCluster",
                               cluster_kwargs={"n_workers": 1, "threads_per_worker": 1, "processes": True,
                                               "memory_limit": "1GiB", "dashboard_address": "127.0.0.1:0"},
                               store=str(tmp_path / "s.sqlite"), output_dir=str(tmp_path / "o"))

    @flow(task_runner=runner)
    def env(path: str):
        return operators.envelope.map(chunked(path)).result().values

    volume = open_segy(survey).values
    np.testing.assert_allclose(env(survey), operators.envelope.fn(volume), rtol=0, atol=1e-5 * np.abs(volume).max())


# ----------------------------------------------------------------------------- explicit outputs: resume or restart


def test_an_explicit_output_is_reused_only_for_the_same_input_and_recomputed_when_the_input_changes(
        cluster, tmp_path):
    import zarr

    from memchunk_prefect.io.zarr_store import ZarrOutput

    path = tmp_path / "survey.sgy"
    synthetic_survey(path, (12, 10, 80), seed=21)
    out = tmp_path / "env.zarr"
    runner = runner_for(cluster, tmp_path)

    @flow(task_runner=runner)
    def env(source):
        res = operators.envelope.map(chunked(source, output=out))
        return res.summary(), res.result().values

    first, values = env(str(path))
    assert first["decisions"][0] != "resume" and first["tasks"] >= 1
    write_id = dict(zarr.open_group(str(out), mode="r").attrs)["write_id"]

    # Same file, operator and code: the complete output is kept as it is, nothing recomputed.
    again, values2 = env(str(path))
    assert again["decisions"] == ["resume"] and again["tasks"] == 0, again
    assert dict(zarr.open_group(str(out), mode="r").attrs)["write_id"] == write_id
    np.testing.assert_array_equal(values2, values)

    # The file rewritten with other content (same geometry): never mixed with the old result.
    synthetic_survey(path, (12, 10, 80), seed=22)
    changed, values3 = env(str(path))
    assert changed["decisions"][0] == "restart" and "another input" in changed["reasons"][0], changed
    np.testing.assert_allclose(values3, operators.envelope.fn(open_segy(str(path)).values), rtol=1e-5, atol=1e-5)
    assert ZarrOutput.open(out).is_complete()

    # An array in memory cannot be identified without reading it all: always recomputed.
    arr = open_segy(str(path)).values
    for _ in range(2):
        s, _ = env(arr)
        assert s["decisions"][0] == "restart" and "cannot be identified" in s["reasons"][0], s

    # A parameter that is not part of the memory key (memory_hog's hold time) still decides the output.
    @flow(task_runner=runner)
    def hog(seconds: float):
        return memory_hog.map(chunked(str(path), output=tmp_path / "hog.zarr"), multiple=1, seconds=seconds).summary()

    assert hog(0.0)["decisions"][0] != "resume"
    assert hog(0.0)["decisions"] == ["resume"]
    changed = hog(0.001)
    assert changed["decisions"][0] == "restart" and "other parameters" in changed["reasons"][0], changed


def test_workers_unpickling_the_runner_do_not_import_the_model_or_the_report():
    """Every task run unpickles the runner on its worker: what only the flow needs must not cost worker memory.

    The model (River) adds ~65 MiB and the report ~20 MiB of resident memory, all of it taken from every task's
    budget on every worker if the runner's module imported them.
    """
    code = ("import sys, cloudpickle; import memchunk_prefect.run.runner as r; cloudpickle.loads(cloudpickle.dumps("
            "r.MemoryAwareRunner())); print(sorted(m for m in ('river', 'memchunk_prefect.learn.bank', 'memchunk_prefect.learn.forms', "
            "'memchunk_prefect.run.report', 'memchunk_prefect.learn.store') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


# =========================================================================== what a submission costs the flow


def test_the_settings_context_is_serialized_once_per_context_while_maps_run_and_restored_after():
    """prefect-dask serializes the whole settings context for every task run it submits; while a map runs the
    answer for one context object is computed once. A new context (settings changed) gets its own answer."""
    import threading

    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_LOGGING_LEVEL, temporary_settings

    from memchunk_prefect.run.hydration import settings_serialized_once

    original = SettingsContext.__dict__["serialize"]
    ctx = SettingsContext.get()
    fresh = ctx.serialize()
    with settings_serialized_once():
        first = ctx.serialize()
        assert ctx.serialize() is first, "serialized again for the same context"
        assert first == fresh
        with temporary_settings({PREFECT_LOGGING_LEVEL: "ERROR"}):
            changed = SettingsContext.get().serialize()
        assert changed is not first and changed != first, "a changed context must not get the cached answer"
        # Overlapping maps in threads: the memo stays until the last one ends.
        entered, leave = threading.Event(), threading.Event()

        def other_map():
            with settings_serialized_once():
                entered.set()
                leave.wait(10)

        t = threading.Thread(target=other_map)
        t.start()
        entered.wait(10)
    assert SettingsContext.__dict__["serialize"] is not original, "removed while another map still runs"
    leave.set()
    t.join(10)
    assert SettingsContext.__dict__["serialize"] is original
    assert ctx.serialize() is not first and ctx.serialize() == fresh


def test_a_missing_input_is_reported_before_any_cluster_starts(tmp_path):
    """The input is opened in the flow's thread before the first map starts its cluster in the background: a typo
    in the path costs no worker start, and the error is the typed one."""
    from distributed import LocalCluster

    from memchunk_prefect.core.errors import SegyFileNotFoundError

    started: list[object] = []

    class Recorded(LocalCluster):
        def __init__(self, *args, **kwargs):
            started.append(self)
            super().__init__(*args, **kwargs)

    runner = MemoryAwareRunner(cluster_class=Recorded, cluster_kwargs={"n_workers": 1, "memory_limit": "1GiB"},
                               store=str(tmp_path / "s.sqlite"), output_dir=str(tmp_path / "out"))

    @flow(task_runner=runner)
    def attributes(path: str):
        return operators.envelope.map(chunked(path)).result()

    with pytest.raises(SegyFileNotFoundError, match="no-such-survey.sgy"):
        attributes(str(tmp_path / "no-such-survey.sgy"))
    assert started == []
    with runner.duplicate() as same:  # the control: this runner's cluster is the recorded class
        assert same.client is not None and len(started) == 1
