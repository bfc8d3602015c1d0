"""Faults (issue 8): a corrupt store, poisoned history, an impossible budget, and the table of errors.

Dead workers and schedulers, interrupted and cancelled runs and failed writes are in
tests/test_interruptions.py. Two whole flows on one store are here; two bare writers racing at the
SQLite level, and a store of a newer schema left byte-identical, are in tests/test_store.py
(test_two_processes_writing_at_once_lose_nothing,
test_a_newer_store_is_refused_and_left_untouched).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from prefect import flow, task

from memchunk_prefect import MemoryAwareRunner, chunked, operators, synthetic_survey
from memchunk_prefect.core.errors import BudgetTooSmallError
from memchunk_prefect.core.policy import plan
from memchunk_prefect.core.records import Observation
from memchunk_prefect.learn.bank import ModelBank
from memchunk_prefect.learn.store import Store, StoreMovedAsideWarning
from memchunk_prefect.operators import operator_key
from memchunk_prefect.testing import seed_store, start_local_cluster

MiB = 2**20


@pytest.fixture(scope="module")
def survey(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("faults") / "survey.sgy"
    synthetic_survey(path, (12, 10, 80), seed=11)
    return str(path)


@pytest.fixture(scope="module")
def cluster():
    c = start_local_cluster(n_workers=2, memory_limit="1GiB")
    yield c
    c.close()


def task_runs_of(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        return client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


# =========================================================================== a corrupt store


@pytest.mark.cluster
@pytest.mark.usefixtures("prefect_server")
def test_a_corrupt_store_is_moved_aside_with_a_warning_and_the_flow_still_runs(cluster, survey, tmp_path):
    store_path = tmp_path / "obs.sqlite"
    store_path.write_bytes(b"SQLite format 3\x00" + os.urandom(4000))
    original = store_path.read_bytes()
    runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(store_path),
                               output_dir=str(tmp_path / "out"))

    @flow(task_runner=runner)
    def envelope_of(path: str):
        return operators.envelope.map(chunked(path)).result().values

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = envelope_of(survey)
    assert any(issubclass(w.category, StoreMovedAsideWarning) for w in caught), [str(w.message) for w in caught]
    from memchunk_prefect.io.segy_xarray import open_segy

    np.testing.assert_allclose(result, operators.envelope.fn(open_segy(survey).values), rtol=1e-5, atol=1e-6)
    aside = list(tmp_path.glob("obs.sqlite.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == original
    with Store(store_path) as s:  # the fresh store learned from this run
        assert s.count(operator_key(operators.envelope, {})) > 0


# =========================================================================== learning under poison


KEY = "gst3d_dip|float32|cpu"
SHAPE = (200, 200, 400)
BUDGET = 512 * MiB


def good_history(store: Store) -> None:
    seed_store(store, KEY, 60.0, fixed_bytes=20 * MiB,
               sizes=(20_000, 40_000, 80_000, 160_000, 320_000, 640_000, 1_000_000, 2_000_000))


def chunk_elements(store: Store) -> int:
    bank = ModelBank(store)
    p = plan(SHAPE, budget_bytes=BUDGET, estimates=bank.predictor(KEY), halo=(3, 3, 3), slots=2, whole_traces=False)
    assert not p.probe
    return int(np.prod(p.chunk_shape))


# One flow in its own process: waits for "go" on stdin, runs a chunked envelope on the shared
# cluster with a small budget (several chunks), prints how many chunks it measured.
FLOW_PROCESS = """
import json, sys
from prefect import flow
from memchunk_prefect import operators
from memchunk_prefect import MemoryAwareRunner, chunked

address, store, survey, out = sys.argv[1:5]

@flow(task_runner=MemoryAwareRunner(address=address, store=store, output_dir=out, memory_budget="24MiB"))
def envelope(path):
    res = operators.envelope.map(chunked(path))
    res.result()
    return sum(1 for e in res.events if e["event"] == "ok")

print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(envelope(survey)), flush=True)
"""


@pytest.mark.cluster
@pytest.mark.usefixtures("prefect_server")
def test_two_flows_on_one_store_at_once_keep_every_observation(cluster, tmp_path):
    """Two flow processes, one store, one operator, started together: the store ends with N1 + N2 records."""
    from prefect.settings import get_current_settings

    survey = str(tmp_path / "survey.sgy")
    synthetic_survey(survey, (24, 40, 500), seed=12)  # 1.8 MiB: several chunks under a 24 MiB budget

    store = str(tmp_path / "shared.sqlite")
    key = operator_key(operators.envelope, {})
    env = dict(os.environ, PREFECT_API_URL=str(get_current_settings().api.url),
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, "-c", FLOW_PROCESS, cluster.scheduler_address, store, survey,
                               str(tmp_path / f"out{i}")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env=env) for i in (1, 2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        measured = []
        for p in procs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out
            measured.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(n >= 2 for n in measured), measured  # several chunks each, so their writes interleave
    with Store(store) as s:
        assert s.count(key) == sum(measured), (s.count(key), measured)
        assert len({(o.chunk, o.created_at) for o in s.observations(key)}) == sum(measured)


@pytest.mark.parametrize("factor", [100.0, 0.01], ids=["100x", "1/100x"])
def test_one_absurd_observation_does_not_make_the_next_plan_absurd(tmp_path, factor):
    with Store(tmp_path / "clean.sqlite") as clean:
        good_history(clean)
        reference = chunk_elements(clean)
    with Store(tmp_path / "poisoned.sqlite") as poisoned:
        good_history(poisoned)
        n = 500_000
        poisoned.add(Observation(KEY, n, (1, 1250, 400), 4 * n, int(factor * (20 * MiB + 60.0 * n)),
                                 seconds=0.5, outcome="ok", method="injected"))
        got = chunk_elements(poisoned)
    assert abs(got - reference) <= 0.25 * reference, (got, reference)


# =========================================================================== an impossible budget


@pytest.mark.cluster
@pytest.mark.usefixtures("prefect_server")
def test_an_impossible_budget_fails_before_any_task_is_submitted(cluster, survey, tmp_path):
    from prefect.context import get_run_context

    runner = MemoryAwareRunner(address=cluster.scheduler_address, memory_budget="1KiB",
                               store=str(tmp_path / "obs.sqlite"), output_dir=str(tmp_path / "out"))
    seen = {}

    @flow(task_runner=runner)
    def dip_of(path: str):
        seen["id"] = get_run_context().flow_run.id
        return operators.gst3d_dip.map(chunked(path)).result()

    with pytest.raises(BudgetTooSmallError, match=r"1\.0 KiB"):
        dip_of(survey)
    assert task_runs_of(seen["id"]) == []


# =========================================================================== the table of errors


def test_every_error_class_is_in_the_table_of_errors_a_user_can_meet():
    import inspect
    from pathlib import Path

    from memchunk_prefect.core import errors
    from memchunk_prefect.run import runner

    table = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "errors.md").read_text()
    classes = {name for mod in (errors, runner) for name, obj in inspect.getmembers(mod, inspect.isclass)
               if issubclass(obj, errors.MemchunkError) and obj is not errors.MemchunkError
               and obj.__module__ == mod.__name__}
    assert "ClusterLostError" in classes and "OutputWriteError" in classes
    missing = sorted(c for c in classes if f"`{c}`" not in table)
    assert not missing, f"docs/reference/errors.md does not list {missing}"


# =========================================================================== which chunks had begun on a dead worker


@task
def _begins_and_the_first_kills_its_worker(i: int) -> int:
    from memchunk_prefect.run.worker import tell_started

    tell_started()
    if i == 0:
        time.sleep(0.5)  # the start event is on its way (a worker sends its messages every few milliseconds)
        os.kill(os.getpid(), signal.SIGKILL)
    return i


@pytest.mark.cluster
@pytest.mark.usefixtures("prefect_server")
def test_the_scheduler_log_tells_a_run_that_began_on_a_dead_worker_from_one_only_queued_there():
    """Dask fails both tasks assigned to a worker that dies (allowed-failures 0); only the one that began there
    logged its start, so only its death can say anything about its memory."""
    from distributed import Client
    from prefect_dask import DaskTaskRunner

    from memchunk_prefect.run.cluster import read_started

    cluster = start_local_cluster(n_workers=1, memory_limit="1GiB")
    try:
        since = time.time()

        @flow(task_runner=DaskTaskRunner(address=cluster.scheduler_address))
        def two_on_one_worker() -> tuple[str, str, list[str]]:
            import dask
            from prefect.context import get_run_context

            worker = next(iter(get_run_context().task_runner.client.scheduler_info()["workers"]))
            with dask.annotate(workers=[worker]):  # both sent to the worker at once: the second waits there
                first = _begins_and_the_first_kills_its_worker.submit(0)
                second = _begins_and_the_first_kills_its_worker.submit(1)
            for f in (first, second):
                f.wait()
            return str(first.task_run_id), str(second.task_run_id), [f.wrapped_future.status for f in (first, second)]

        began, queued, states = two_on_one_worker()
        assert states == ["error", "error"], "both failed with the worker"
        with Client(cluster.scheduler_address) as client:
            started = read_started(client, since)
        assert started is not None and began in started and queued not in started
    finally:
        cluster.close()


# =========================================================================== no room where a chunk begins

_HELD: list = []


def _hold_then_check(hold_mib: int, upper_mib: int) -> str:
    """On a worker: hold ``hold_mib`` MiB (as another map's library would), then check a chunk bounded at
    ``upper_mib`` MiB; what the check said."""
    import numpy as np

    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.core.errors import ChunkDeferredError
    from memchunk_prefect.run.worker import BlockJob, check_room, kill_line_bytes

    _HELD.append(np.ones(hold_mib * 2**20 // 8))
    job = BlockJob(source=None, chunk=Chunk((0, 0, 0), (1, 1, 1)), halo=(0, 0, 0), volume_shape=(1, 1, 1),
                   output_path="", operator="gram", operator_key="gram", budget_bytes=0, label="il 0:1",
                   upper_bytes=upper_mib * 2**20)
    try:
        check_room(job)
    except ChunkDeferredError as exc:
        assert exc.kill_bytes == kill_line_bytes() and exc.upper_bytes == upper_mib * 2**20
        return f"deferred: {exc}"
    finally:
        _HELD.clear()
    return "starts"


@pytest.mark.cluster
def test_a_chunk_whose_bound_would_pass_its_workers_kill_line_from_where_the_worker_stands_does_not_start():
    """A real worker of 600 MiB (kill line 570 MiB): a chunk bounded at 300 MiB starts on it at rest, and does not
    where the worker already holds 250 MiB more."""
    from distributed import Client

    cluster = start_local_cluster(n_workers=1, memory_limit="600MiB")
    try:
        with Client(cluster.scheduler_address) as client:
            at_rest = client.submit(_hold_then_check, 0, 300, pure=False).result()
            holding = client.submit(_hold_then_check, 250, 300, pure=False).result()
        assert at_rest == "starts"
        assert holding.startswith("deferred: gram[il 0:1] did not start on tcp://") and \
            "would pass its kill line (570.0 MiB)" in holding, holding
    finally:
        cluster.close()
