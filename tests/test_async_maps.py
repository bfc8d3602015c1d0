"""Chunked maps that return at once (issue 19), on a real Dask cluster and a real Prefect server.

A chunked ``.map`` returns its result object at once and runs in the background of
the flow's process: independent maps share the cluster, a map over another map's
result starts each chunk as soon as the upstream chunks its block reads are written,
and errors surface on ``.result()`` or when the flow ends. Before this change every
test here but the one on a failed map nobody waited for fails (the first ``.map``
returned only when its last chunk was written, and raised a failed map's error
itself, which failed that flow too).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from prefect import flow, task

from memchunk_prefect import MemoryAwareRunner, chunked
from memchunk_prefect.core.chunks import Chunk, with_halo
from memchunk_prefect.core.errors import UpstreamMapError
from memchunk_prefect.testing import memory_hog, start_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.usefixtures("prefect_server")]


@pytest.fixture(scope="module")
def cluster():
    c = start_local_cluster(n_workers=2, memory_limit="1GiB")
    yield c
    c.close()


def runner_for(cluster, tmp_path, **kw) -> MemoryAwareRunner:
    return MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"),
                             output_dir=str(tmp_path / "out"), progress=False, **kw)


VOLUME = np.random.default_rng(7).normal(size=(24, 8, 64)).astype(np.float32)


def _span(observations) -> tuple[float, float]:
    """(first start, last end) of a map's chunk runs, seconds since the epoch (as the workers measured them)."""
    ok = [o for o in observations if o.outcome == "ok"]
    return min(o.started_at for o in ok), max(o.created_at for o in ok)


def test_map_returns_at_once_and_two_independent_maps_share_the_cluster(cluster, tmp_path):
    runner = runner_for(cluster, tmp_path)

    @flow(task_runner=runner)
    def two_attributes():
        t = time.perf_counter()
        a = memory_hog.map(chunked(VOLUME), multiple=2, busy_seconds=0.5)
        returned_after = time.perf_counter() - t
        running_at_return = not a.done
        b = memory_hog.map(chunked(VOLUME), multiple=3, busy_seconds=0.5)
        return (returned_after, running_at_return, a.result().values, b.result().values, a.observations,
                b.observations)

    returned_after, running, a_out, b_out, a_obs, b_obs = two_attributes()
    assert running, "the first map had not ended when .map returned"
    assert returned_after < min(o.seconds for o in a_obs if o.outcome == "ok") * 4, returned_after
    np.testing.assert_array_equal(a_out, VOLUME)
    np.testing.assert_array_equal(b_out, VOLUME)
    (_, a_end), (b_start, _) = _span(a_obs), _span(b_obs)
    assert b_start < a_end, ("the second map's first chunk started only after the first map's last one ended: "
                             f"{b_start - a_end:+.2f} s")


def _task_inputs(task_run_ids) -> dict:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {tid: client.read_task_run(tid).task_inputs for tid in task_run_ids}


def test_a_chained_map_starts_chunks_as_the_upstream_writes_them_with_exact_output_and_graph_edges(cluster, tmp_path):
    """The downstream map reads a 2-iline halo: each of its chunks may start only once the upstream has written
    every element its block reads; one that read early would see the store's fill value, not the input."""
    runner = runner_for(cluster, tmp_path)
    halo = (2, 0, 0)

    @flow(task_runner=runner)
    def chain():
        up = memory_hog.map(chunked(VOLUME), multiple=2, busy_seconds=0.6)
        down = memory_hog.map(chunked(up, halo=halo), multiple=3, busy_seconds=0.3)
        return down.result().values, up.observations, down.observations, up.decisions, down.decisions

    out, up_obs, down_obs, up_decisions, down_decisions = chain()
    np.testing.assert_array_equal(out, VOLUME)
    (_, up_end), (down_start, _) = _span(up_obs), _span(down_obs)
    assert down_start < up_end, f"the downstream map waited for the whole upstream map ({down_start - up_end:+.2f} s)"
    written = {Chunk.from_key(o.chunk): o for o in up_obs if o.outcome == "ok"}
    for o in down_obs:  # no chunk started before the upstream chunks its block reads were written
        block = with_halo(Chunk.from_key(o.chunk), halo, VOLUME.shape)[0]
        feeders = [u for c, u in written.items() if c.intersect(block) is not None]
        assert o.started_at >= max(u.created_at for u in feeders) - 0.5, (o.chunk, [u.chunk for u in feeders])
        # The runner records when it submitted each chunk (with its start: how long it waited to run): a gated
        # chunk is submitted once what it reads is written, and starts after its submission.
        assert o.submitted_at is not None and o.submitted_at <= o.started_at + 0.05, o
        assert o.submitted_at >= max(u.created_at for u in feeders) - 0.5, (o.chunk, o.submitted_at)
    assert all(o.submitted_at is not None for o in up_obs if o.outcome == "ok")
    # The UI's graph: each downstream task run names the upstream task runs that wrote what it read.
    inputs = _task_inputs([o.task_run_id for o in down_obs if o.outcome == "ok"])
    for o in down_obs:
        block = with_halo(Chunk.from_key(o.chunk), halo, VOLUME.shape)[0]
        want = {u.task_run_id for c, u in written.items() if c.intersect(block) is not None}
        got = {str(r.id) for r in inputs[o.task_run_id].get("block", [])}
        assert want and want <= got, (o.chunk, want, got)


@task
def boom(block):
    raise ValueError(f"boom on a block of shape {block.shape}")


def test_a_failed_map_raises_on_result_not_at_map_and_wait_never_raises(cluster, tmp_path):
    runner = runner_for(cluster, tmp_path)
    seen = []

    @flow(task_runner=runner)
    def failing():
        r = boom.map(chunked(VOLUME))  # returns: the error is the map's, raised where Prefect raises it
        seen.append("map returned")
        r.wait()
        seen.append(("waited", r.done, type(r.error).__name__, type(r.result(raise_on_failure=False)).__name__))
        r.result()

    with pytest.raises(ValueError, match="boom on a block"):
        failing()
    assert seen == ["map returned", ("waited", True, "ValueError", "ValueError")]


def test_a_failed_map_nobody_waited_for_fails_the_flow_run_at_its_end(cluster, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    runner = runner_for(cluster, tmp_path)
    ids = []

    @flow(task_runner=runner)
    def careless():
        ids.append(str(flow_run.id))
        boom.map(chunked(VOLUME))
        return "returned before the map ended"

    with pytest.raises(ValueError, match="boom on a block"):
        careless()
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(ids[0]).state
    assert state.is_failed() and "boom on a block" in state.message, state


def test_a_map_over_a_failed_map_stops_with_an_upstream_error_naming_it(cluster, tmp_path):
    runner = runner_for(cluster, tmp_path)

    @flow(task_runner=runner)
    def chained_on_failure():
        up = boom.map(chunked(VOLUME))
        down = memory_hog.map(chunked(up, halo=1), multiple=2)
        return down.result()

    with pytest.raises(UpstreamMapError, match=r"the map it reads, boom, did not finish \(ValueError: boom"):
        chained_on_failure()


def test_an_error_in_the_flow_s_own_code_stops_its_running_maps_and_stays_the_flow_s_error(cluster, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.runtime import flow_run

    runner = runner_for(cluster, tmp_path)
    ids = []

    def a_chunk_runs(flow_run_id: str, timeout: float = 60.0) -> bool:
        """Whether one of the flow run's task runs is RUNNING within ``timeout`` seconds. A fixed 1 s sleep over
        1 s chunks once let both finish before the flow's error stopped the map, on a host loaded by other work
        (nothing was left to crash). Raising while a chunk runs is not enough either: stopping, the runner marks
        the runs in flight Crashed and looks again for up to ``settle_missing_seconds`` (2 s) for those the server
        has not listed yet, and a chunk that then ends is recorded Completed, as it did. With 3 s chunks and task
        runs starting 0.04 s after their submit, both chunks of one CI run ended 0.1 s after the runner stopped,
        Completed before this test read them; an 8 s chunk is still running when the states are read."""
        deadline = time.monotonic() + timeout
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                if any(r.state is not None and r.state.type.value == "RUNNING" for r in runs):
                    return True
                time.sleep(0.05)
        return False

    @flow(task_runner=runner)
    def clumsy():
        ids.append(str(flow_run.id))
        memory_hog.map(chunked(VOLUME), multiple=2, busy_seconds=8.0)
        assert a_chunk_runs(ids[0]), "no chunk started within 60 s"
        raise RuntimeError("the flow's own bug")

    with pytest.raises(RuntimeError, match="the flow's own bug"):
        clumsy()
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(ids[0]).state
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[ids[0]])))
    assert state.is_failed() and "own bug" in state.message, state
    assert runs and not [r.name for r in runs if r.state.type.value in ("RUNNING", "PENDING", "SCHEDULED")]
    assert any(r.state.name == "Crashed" for r in runs), [(r.name, r.state.name) for r in runs]
