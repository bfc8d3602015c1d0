"""Workers, schedulers and flow runs that stop mid-map (issue 8): nothing lost, nothing half-done reported as done.

Everything here is real: worker processes killed with SIGKILL, a ``dask scheduler``
process killed, a flow process interrupted with SIGINT (Ctrl-C), a served
deployment's run cancelled through the Prefect API. The operator is the
``memory_hog`` test helper holding each chunk for a while (``seconds``), so a
kill lands mid-map; it returns a copy of its input, so the clean result is the
input itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest
from prefect import flow

from memchunk_prefect import MemoryAwareRunner, chunked, synthetic_survey
from memchunk_prefect.core.chunks import Chunk, covers_exactly
from memchunk_prefect.core.errors import ClusterLostError, OutputWriteError
from memchunk_prefect.io.segy_xarray import open_segy
from memchunk_prefect.io.zarr_store import ZarrOutput, open_result
from memchunk_prefect.learn.store import Store
from memchunk_prefect.operators import operator_key
from memchunk_prefect.testing import dask_cli, limit_file_size, memory_hog, seed_store, start_local_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parents[1]
HELPER = REPO / "tests" / "reprocess_hog.py"
SHAPE = (48, 50, 500)  # 1.2 M samples; at 168 B/element and a 48 MiB budget: about 6 chunks of 8 ilines
HOG = {"multiple": 40, "seconds": 1.0}
KEY = operator_key(memory_hog, {"multiple": 40})
# The second map of a chain: another memory multiple, so another key and its own observations.
HOG2 = {"multiple": 30, "seconds": 1.0}
KEY2 = operator_key(memory_hog, {"multiple": 30})


@pytest.fixture(scope="module")
def survey(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("interruptions") / "survey.sgy"
    synthetic_survey(path, SHAPE, seed=3)
    return str(path)


def seeded_store(path: Path) -> str:
    """A store whose model already knows memory_hog at 40x (168 B/element), so the first plan is final."""
    store = Store(path)
    seed_store(store, KEY, 168)
    seed_store(store, KEY2, 128)
    store.close()
    return str(path)


def hog_flow(runner: MemoryAwareRunner, survey: str, out: Path):
    @flow(task_runner=runner)
    def hog():
        from prefect.runtime import flow_run

        res = memory_hog.map(chunked(survey, output=out), **HOG)
        return str(flow_run.id), res.summary(), res.events

    return hog


class KillAfterMarkers(threading.Thread):
    """Send ``sig`` to ``pid`` once ``n`` chunks of the output at ``out`` are marked written."""

    def __init__(self, out: Path, n: int, pid: int, sig: int = signal.SIGKILL, timeout: float = 180):
        super().__init__(daemon=True)
        self.out, self.n, self.pid, self.sig, self.timeout = out, n, pid, sig, timeout
        self.killed_at: float | None = None
        self.markers_then = 0
        self.start()

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self.markers_then = len(markers(self.out))
            if self.markers_then >= self.n:
                os.kill(self.pid, self.sig)
                self.killed_at = time.time()
                return
            time.sleep(0.05)


def markers(out: Path) -> list[str]:
    d = Path(out) / ".memchunk" / "done"
    return [e.name for e in os.scandir(d) if (Path(e.path) / "zarr.json").exists()] if d.is_dir() else []


def chain_flow(runner: MemoryAwareRunner, survey: str, up: Path, down: Path):
    """Two memory_hog maps chained, the second submitted while the first runs (each returns a copy: the
    clean result of both is the survey)."""
    @flow(task_runner=runner)
    def chain():
        from prefect.runtime import flow_run

        first = memory_hog.map(chunked(survey, output=up), **HOG)
        second = memory_hog.map(chunked(first, output=down), **HOG2)
        overlapped = not first.done  # the second was submitted while the first ran
        return str(flow_run.id), first.summary(), second.summary(), first.events + second.events, overlapped

    return chain


def ok_observations(store: str, key: str = KEY) -> list:
    return [o for o in Store(store).observations(key) if o.outcome == "ok" and o.method != "seeded"]


def unfinished_task_runs(flow_run_ids) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids))))
    return [(r.name, r.state.name) for r in runs if r.state and r.state.type.value in ("RUNNING", "PENDING",
                                                                                        "SCHEDULED")]


def flow_runs_since(started: float) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterStartTime

    since = FlowRunFilter(start_time=FlowRunFilterStartTime(after_=datetime.fromtimestamp(started, timezone.utc)))
    with get_client(sync_client=True) as client:
        return [r.id for r in client.read_flow_runs(flow_run_filter=since)]


def assert_equal_to_a_clean_run_and_each_chunk_written_once(out: Path, survey: str, store: str,
                                                            key: str = KEY) -> None:
    """The result equals the input element for element; completed chunks tile the volume with no overlap,
    and each was measured by exactly one successful task run (none computed twice, none missing)."""
    np.testing.assert_array_equal(open_result(out).values, open_segy(survey).values)
    done = ZarrOutput.open(out).completed_chunks()
    assert covers_exactly(done, SHAPE), f"completed chunks overlap or leave gaps: {done}"
    counts = Counter(o.chunk for o in ok_observations(store, key))
    assert set(counts) == {c.key() for c in done}, (sorted(counts), done)
    assert max(counts.values()) == 1, f"a chunk was computed twice: {counts}"


# =========================================================================== a worker killed


def test_a_worker_sigkilled_mid_map_on_a_local_cluster_loses_nothing(survey, tmp_path):
    from distributed import Client

    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        with Client(cluster.scheduler_address) as c:
            pid = sorted(c.run(os.getpid).values())[0]
        store, out = seeded_store(tmp_path / "obs.sqlite"), tmp_path / "out.zarr"
        killer = KillAfterMarkers(out, 1, pid)
        runner = MemoryAwareRunner(address=cluster.scheduler_address, memory_budget="48MiB", store=store)
        run_id, summary, events = hog_flow(runner, survey, out)()
    finally:
        cluster.close()
    assert killer.killed_at is not None and killer.markers_then < summary["chunks"], "the kill was not mid-map"
    lost = [e for e in events if e["event"] == "lost"]
    assert lost, events
    assert summary["oom_events"] == 0, "a SIGKILL far below the memory limit is not an out-of-memory event"
    assert_equal_to_a_clean_run_and_each_chunk_written_once(out, survey, store)
    assert not [o for o in Store(store).observations(KEY) if o.outcome == "killed"], "nothing learned from it"
    assert not unfinished_task_runs([run_id])


def test_a_worker_sigkilled_while_two_chained_maps_run_loses_nothing_in_either(survey, tmp_path):
    """Both maps have chunks in flight when the worker dies: each retries what it lost, the second never
    reads what the first has not written, and both outputs are exact with every chunk written once."""
    from distributed import Client

    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        with Client(cluster.scheduler_address) as c:
            pid = sorted(c.run(os.getpid).values())[0]
        store, up, down = seeded_store(tmp_path / "obs.sqlite"), tmp_path / "up.zarr", tmp_path / "down.zarr"
        killer = KillAfterMarkers(down, 1, pid)  # the second map has written: both are under way
        runner = MemoryAwareRunner(address=cluster.scheduler_address, memory_budget="48MiB", store=store)
        run_id, first, second, events, overlapped = chain_flow(runner, survey, up, down)()
    finally:
        cluster.close()
    assert overlapped, "the chained map was submitted after the first ended: nothing overlapped"
    assert killer.killed_at is not None and killer.markers_then < second["chunks"], "the kill was not mid-map"
    assert [e for e in events if e["event"] == "lost"], events
    assert first["oom_events"] == second["oom_events"] == 0, "a SIGKILL is not an out-of-memory event"
    assert_equal_to_a_clean_run_and_each_chunk_written_once(up, survey, store, KEY)
    assert_equal_to_a_clean_run_and_each_chunk_written_once(down, survey, store, KEY2)
    assert not unfinished_task_runs([run_id])


# =========================================================================== a full disk


def test_an_output_write_that_fails_is_a_typed_error_nothing_is_marked_done_and_a_rerun_completes(
        survey, tmp_path):
    from distributed import Client

    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        store, out = seeded_store(tmp_path / "obs.sqlite"), tmp_path / "out.zarr"
        runner = MemoryAwareRunner(address=cluster.scheduler_address, memory_budget="48MiB", store=store)
        with Client(cluster.scheduler_address) as c:
            c.run(limit_file_size, 64 * 1024)  # storage chunks are ~2 MB: every data write fails, as on a full disk
            with pytest.raises(OutputWriteError, match=r"memory_hog\[iline .*\]: could not write its chunk to "
                                                       r".*out\.zarr \(EFBIG: .*file size limit.* resumes the output"):
                hog_flow(runner, survey, out)()
            assert ZarrOutput.open(out).completed_chunks() == [], "a chunk whose write failed was marked written"
            with pytest.raises(Exception, match="not marked complete"):
                open_result(out)
            c.restart()  # the cause fixed: fresh worker processes without the limit
        run_id, summary, _ = hog_flow(runner, survey, out)()
    finally:
        cluster.close()
    assert_equal_to_a_clean_run_and_each_chunk_written_once(out, survey, store)
    assert not unfinished_task_runs([run_id])


# =========================================================================== a worker slow rather than dead


def test_a_worker_ten_times_slower_is_named_in_the_summary_and_the_map_completes_with_nothing_lost(tmp_path):
    """One of two workers stopped 90% of the time (SIGSTOP / SIGCONT, a real straggler); 0.2 s of CPU a chunk.

    Nothing in Dask notices a slow worker; the runner names it once two of its chunks agree (its median
    seconds per element 4x the other's or more), and the map still completes, exact, every chunk once.
    The workers import what a chunk runs before the throttle starts (a node that slows down mid-run): a
    throttled first import takes tens of seconds on a loaded machine, which would leave the slow worker
    fewer than two chunks to be judged by.
    """
    import importlib

    from distributed import Client

    from memchunk_prefect.testing import Throttle

    shape = (240, 50, 500)
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        with Client(cluster.scheduler_address) as c:
            pids = c.run(os.getpid)
            c.run(lambda: [importlib.import_module(m) for m in (
                "prefect.task_engine", "memchunk_prefect.run.cluster", "memchunk_prefect.run.worker",
                "memchunk_prefect.io.segy_xarray", "memchunk_prefect.io.zarr_store", "memchunk_prefect.testing")])
        slow_address, slow_pid = sorted(pids.items())[0]
        survey = str(synthetic_survey(tmp_path / "wide.sgy", shape, seed=5))
        store, out = seeded_store(tmp_path / "obs.sqlite"), tmp_path / "out.zarr"
        runner = MemoryAwareRunner(address=cluster.scheduler_address, memory_budget="24MiB", store=store)

        @flow(task_runner=runner)
        def busy():
            from prefect.runtime import flow_run

            res = memory_hog.map(chunked(survey, output=out), multiple=40, busy_seconds=0.2)
            return str(flow_run.id), res.summary()

        with Throttle(slow_pid, duty=0.1):
            run_id, summary = busy()
    finally:
        cluster.close()
    np.testing.assert_array_equal(open_result(out).values, open_segy(survey).values)
    done = ZarrOutput.open(out).completed_chunks()
    assert covers_exactly(done, shape), done
    runs = ok_observations(store)
    counts = Counter(o.chunk for o in runs)
    assert set(counts) == {c.key() for c in done} and max(counts.values()) == 1, counts
    assert not unfinished_task_runs([run_id])
    (slow,) = summary["slow_workers"]
    assert slow["worker"] == slow_address and slow["ratio"] >= 4 and slow["runs"] >= 2, slow
    assert f"{slow_address} ran " in slow["message"] and "slower per element" in slow["message"]
    on_slow = [o for o in runs if o.worker == slow_address]
    assert len(on_slow) < len(runs) / 4, "the throttle did not slow the worker down"


# =========================================================================== an external cluster


class ExternalCluster:
    """``dask scheduler`` and ``dask worker`` processes, as a user would start them by hand.

    The scheduler runs with ``allowed-failures`` 0, as the README asks of external schedulers.
    """

    def __init__(self, logdir: Path, n_workers: int = 2):
        from deployments.local_server import free_port

        logdir.mkdir(parents=True, exist_ok=True)
        self.address = f"tcp://127.0.0.1:{free_port()}"
        env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
        port = self.address.rsplit(":", 1)[1]
        self.scheduler = subprocess.Popen(
            [*dask_cli("scheduler"), "--host", "127.0.0.1", "--port", port, "--dashboard-address", "127.0.0.1:0"],
            env=env, stdout=open(logdir / "scheduler.log", "wb"), stderr=subprocess.STDOUT)
        self.workers = [subprocess.Popen(
            [*dask_cli("worker"), self.address, "--nthreads", "1", "--memory-limit", "1GiB", "--no-dashboard"],
            env=env, stdout=open(logdir / f"worker-{i}.log", "wb"), stderr=subprocess.STDOUT)
            for i in range(n_workers)]
        from distributed import Client

        with Client(self.address, timeout=60) as c:
            c.wait_for_workers(n_workers, timeout=60)
            self.worker_pids = sorted(c.run(os.getpid).values())

    def close(self) -> None:
        for p in [*self.workers, self.scheduler]:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait(timeout=30)


@contextlib.contextmanager
def external_cluster(logdir: Path):
    ext = ExternalCluster(logdir)
    try:
        yield ext
    finally:
        ext.close()


def test_external_cluster_a_killed_worker_then_a_killed_scheduler_then_a_rerun(survey, tmp_path):
    def runner(address: str, store: str) -> MemoryAwareRunner:
        return MemoryAwareRunner(address=address, memory_budget="48MiB", store=store,
                                 client_kwargs={"timeout": "10s"})

    # A worker process SIGKILLed (its nanny starts a new one): the flow completes, nothing lost or doubled.
    store, out = seeded_store(tmp_path / "a.sqlite"), tmp_path / "a.zarr"
    with external_cluster(tmp_path / "c1") as ext:
        killer = KillAfterMarkers(out, 1, ext.worker_pids[0])
        run_id, summary, events = hog_flow(runner(ext.address, store), survey, out)()
    assert killer.killed_at is not None and killer.markers_then < summary["chunks"]
    assert [e for e in events if e["event"] == "lost"], events
    assert_equal_to_a_clean_run_and_each_chunk_written_once(out, survey, store)
    assert not unfinished_task_runs([run_id])

    # The scheduler SIGKILLed mid-map: the flow fails with a clear error, and keeps what was written.
    store, out = seeded_store(tmp_path / "b.sqlite"), tmp_path / "b.zarr"
    started = time.time()
    with external_cluster(tmp_path / "c2") as ext:
        killer = KillAfterMarkers(out, 2, ext.scheduler.pid)
        with pytest.raises(ClusterLostError, match="lost the Dask scheduler at .* rerun the flow"):
            hog_flow(runner(ext.address, store), survey, out)()
        # Workers outlive their scheduler and finish the tasks they already hold (the flow marked the ones it
        # knew of Crashed); once they have, no task run is left RUNNING.
        wait_for(lambda: not unfinished_task_runs(flow_runs_since(started)), 60)
    assert killer.killed_at is not None
    written = ZarrOutput.open(out).completed_chunks()
    assert written and not ZarrOutput.open(out).is_complete()
    with pytest.raises(Exception, match="not marked complete"):
        open_result(out)
    obs = Store(store).observations(KEY)  # the store opens and reads: intact
    assert not [o for o in obs if o.outcome != "ok"], "a lost scheduler is not a memory event: nothing censored"

    # A rerun on a new scheduler resumes: only what no completed chunk covers is computed.
    rerun_started = time.time()
    with external_cluster(tmp_path / "c3") as ext:
        run_id, summary, events = hog_flow(runner(ext.address, store), survey, out)()
    assert summary["decisions"][0] == "resume", summary["decisions"]
    new = [Chunk.from_key(o.chunk) for o in ok_observations(store) if o.created_at >= rerun_started]
    assert new and not any(n.intersect(w) for n in new for w in written), "a completed chunk was recomputed"
    assert_equal_to_a_clean_run_and_each_chunk_written_once(out, survey, store)
    assert not unfinished_task_runs([run_id])


def test_external_cluster_a_killed_scheduler_under_two_chained_maps_then_a_rerun_resumes_both(survey, tmp_path):
    def runner(address: str, store: str) -> MemoryAwareRunner:
        return MemoryAwareRunner(address=address, memory_budget="48MiB", store=store,
                                 client_kwargs={"timeout": "10s"})

    store, up, down = seeded_store(tmp_path / "obs.sqlite"), tmp_path / "up.zarr", tmp_path / "down.zarr"
    started = time.time()
    with external_cluster(tmp_path / "c1") as ext:
        killer = KillAfterMarkers(down, 1, ext.scheduler.pid)
        # The first map's error is the flow's (its summary is read first); the second stops with it.
        with pytest.raises(ClusterLostError, match="lost the Dask scheduler at .* rerun the flow"):
            chain_flow(runner(ext.address, store), survey, up, down)()
        wait_for(lambda: not unfinished_task_runs(flow_runs_since(started)), 60)
    assert killer.killed_at is not None
    written = {out: ZarrOutput.open(out).completed_chunks() for out in (up, down)}
    assert written[down], "the second map had written nothing: the kill was not under both maps"
    with pytest.raises(Exception, match="not marked complete"):
        open_result(down)
    for key in (KEY, KEY2):
        assert not [o for o in Store(store).observations(key) if o.outcome != "ok"], "nothing censored"

    rerun_started = time.time()
    with external_cluster(tmp_path / "c2") as ext:
        run_id, first, second, _, _ = chain_flow(runner(ext.address, store), survey, up, down)()
    assert second["decisions"][0] == "resume", second["decisions"]
    for out, key in ((up, KEY), (down, KEY2)):
        new = [Chunk.from_key(o.chunk) for o in ok_observations(store, key) if o.created_at >= rerun_started]
        assert not any(n.intersect(w) for n in new for w in written[out]), f"{out.name}: a written chunk was redone"
        assert_equal_to_a_clean_run_and_each_chunk_written_once(out, survey, store, key)
    assert not unfinished_task_runs([run_id])


# =========================================================================== the flow run interrupted


def helper_env() -> dict[str, str]:
    from prefect.settings import get_current_settings

    env = dict(os.environ)
    env["PREFECT_API_URL"] = str(get_current_settings().api.url)  # the session's server, not one per process
    env["PYTHONPATH"] = str(REPO)
    return env


def survey_dir(survey: str, tmp_path: Path) -> Path:
    d = tmp_path / "surveys"
    d.mkdir()
    os.link(survey, d / "line.sgy") if os.stat(survey).st_dev == os.stat(d).st_dev else \
        (d / "line.sgy").write_bytes(Path(survey).read_bytes())
    return d


def check_interrupted(out: Path, store: str) -> list[Chunk]:
    """After an interruption: nothing reported done that is not, and the measurements of written chunks kept."""
    assert not (out / "line" / "memchunk-manifest.json").exists(), "an interrupted survey was marked done"
    hog = out / "line" / "memory_hog.zarr"
    written = ZarrOutput.open(hog).completed_chunks()
    assert written, "the interruption came before any chunk was written: no mid-map test"
    assert not ZarrOutput.open(hog).is_complete(), "the interruption came after the map ended: no mid-map test"
    with pytest.raises(Exception, match="not marked complete"):
        open_result(hog)
    # No measurement is lost: what the flow collected before it stopped is in the store, and every written
    # chunk's marker carries its own (chunks still running when the flow stopped finish and write theirs);
    # the rerun stores those from the markers (checked in check_resumed).
    stored = {o.chunk for o in ok_observations(store)}
    in_markers = {r["chunk"] for r in ZarrOutput.open(hog).done_records(written)}
    assert in_markers == {w.key() for w in written}, "a written chunk's marker lacks its measurement"
    assert stored <= in_markers, "the store holds a measurement of a chunk that is not written"
    return written


def envelope_written(out: Path) -> list[Chunk]:
    """The envelope chunks written so far (none when its store was not created yet)."""
    env = out / "line" / "envelope.zarr"
    return ZarrOutput.open(env).completed_chunks() if (env / "zarr.json").exists() else []


def check_resumed(out: Path, store: str, survey: str, written: list[Chunk], env_written: list[Chunk],
                  rerun_started: float) -> None:
    hog = out / "line" / "memory_hog.zarr"
    manifest = json.loads((out / "line" / "memchunk-manifest.json").read_text())
    assert manifest["outputs"]["memory_hog"]["zarr"] == "memory_hog.zarr"
    new = [Chunk.from_key(o.chunk) for o in ok_observations(store) if o.created_at >= rerun_started]
    assert new and not any(n.intersect(w) for n in new for w in written), "a completed chunk was recomputed"
    # The flow submits both attributes' maps before waiting for either (they share the cluster), so the
    # envelope may have been interrupted too, anywhere from none of its chunks written to all: what it wrote
    # before (read from its store when the run stopped) is reused, never recomputed.
    env_key = next(o.operator_key for o in Store(store).observations() if o.operator_key.startswith("envelope"))
    again = [Chunk.from_key(o.chunk) for o in Store(store).observations(env_key)
             if o.outcome == "ok" and o.created_at >= rerun_started]
    assert not any(a.intersect(b) for a in again for b in env_written), \
        "an envelope chunk written before the interruption was recomputed"
    np.testing.assert_array_equal(open_result(hog).values, open_segy(survey).values)
    done = ZarrOutput.open(hog).completed_chunks()
    counts = Counter(o.chunk for o in ok_observations(store))
    assert set(counts) == {c.key() for c in done} and max(counts.values()) == 1, counts


def test_ctrl_c_during_reprocess_survey_keeps_what_finished_and_a_rerun_resumes(survey, tmp_path):
    directory, out = survey_dir(survey, tmp_path), tmp_path / "attributes"
    store = seeded_store(tmp_path / "obs.sqlite")
    # 5 chunks held 2 s each on 2 workers: after the first 2 are written the map has 4 s left for the Ctrl-C to
    # land (held 0.5 s, it once finished first on a loaded CI machine and the run rightly exited 0).
    cmd = [sys.executable, str(HELPER), "run", str(directory), str(out), store, "2.0"]
    log = open(tmp_path / "interrupted.log", "wb")
    proc = subprocess.Popen(cmd, env=helper_env(), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    killer = KillAfterMarkers(out / "line" / "memory_hog.zarr", 2, proc.pid, signal.SIGINT, timeout=240)
    rc = proc.wait(timeout=300)
    log.close()
    text = (tmp_path / "interrupted.log").read_text(errors="replace")
    assert killer.killed_at is not None, text[-3000:]
    assert rc != 0, (f"an interrupted run must not exit as a success ({killer.markers_then} chunks written "
                     f"when Ctrl-C was sent):\n" + text[-3000:])
    # Usually "(KeyboardInterrupt)"; an interrupt landing inside a library may arrive wrapped in its error type.
    assert "memory_hog: stopped early (" in text, text[-3000:]
    written, env_written = check_interrupted(out, store), envelope_written(out)

    rerun_started = time.time()
    done = subprocess.run(cmd, env=helper_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (row,) = json.loads(done.stdout.strip().splitlines()[-1])
    assert row["status"] == "processed", row
    check_resumed(out, store, survey, written, env_written, rerun_started)


def test_a_sigterm_to_the_whole_job_is_not_learned_as_its_chunks_running_out_of_memory(survey, tmp_path):
    """`timeout`, a batch system's time limit or its cancellation send SIGTERM to every process of the job: the
    flow and its local workers stop together, and a worker's death can reach its map before the flow's own stop
    does. On a cold store such a death is taken as a memory kill (no bound says otherwise), and learned, it
    claims the chunk needed more than the worker's whole headroom (an H100 demo stopped by `timeout` planned its
    next run at 28x the peaks). The store keeps none: every worker death of the stop is either not learned or
    taken back, and said."""
    # Whether a worker's death reaches its map, under a chunk that began and was not written, before the flow's own
    # stop does is a race the signal decides. A death that reached only chunks queued on the worker, or one already
    # written, is rightly neither learned nor said. Every stop must leave no kill in the store; the job is run again
    # (at most four times) until a stop took a running chunk's death as the stop's, and said so.
    texts = []
    for attempt in range(4):
        run_dir = tmp_path / f"attempt-{attempt}"
        run_dir.mkdir()
        text, store = _run_and_terminate(survey, run_dir)
        texts.append(text)
        kept = [o for o in Store(store).observations() if o.outcome == "killed"]
        assert kept == [], [(o.operator_key, o.chunk, o.method) for o in kept]
        if text.count("died as the flow run stopped: not learned") + text.count("are not kept as out of memory"):
            break
    else:
        died = sum(t.count("workers died while trying to run it") for t in texts)
        pytest.fail(f"in four stops ({died} task(s) failed with a dying worker) no running chunk's death was said "
                    "to be the stop's: nothing tested\n" + texts[-1][-3000:])


def _run_and_terminate(survey: str, tmp_path: Path) -> tuple[str, str]:
    """Run the helper's flow on a cold store in a process group of its own and SIGTERM the group once the memory
    hog's first chunk is written; returns the flow's log and the store's path."""
    directory, out = survey_dir(survey, tmp_path), tmp_path / "attributes"
    store = str(tmp_path / "obs.sqlite")  # cold: no bound, so a death would be taken as a memory kill
    cmd = [sys.executable, str(HELPER), "run", str(directory), str(out), store, "2.0"]
    log = open(tmp_path / "terminated.log", "wb")
    proc = subprocess.Popen(cmd, env=helper_env(), cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group, as a batch job's
    killer = KillAfterMarkers(out / "line" / "memory_hog.zarr", 1, -proc.pid, signal.SIGTERM, timeout=240)
    rc = proc.wait(timeout=300)
    log.close()
    text = (tmp_path / "terminated.log").read_text(errors="replace")
    assert killer.killed_at is not None and rc != 0, text[-3000:]
    return text, store


def test_a_run_cancelled_from_prefect_keeps_what_finished_and_the_next_run_resumes(survey, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelling

    started = time.time()
    directory, out = survey_dir(survey, tmp_path), tmp_path / "attributes"
    store = seeded_store(tmp_path / "obs.sqlite")
    env = {**helper_env(), "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen([sys.executable, str(HELPER), "serve"], env=env, cwd=tmp_path, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    # 6 chunks held 6 s each on 2 workers: after the first 2 are written, 12 s are left for the cancellation to
    # arrive (usually under 1 s; once, on a loaded machine, over 10 s).
    params = {"directory": str(directory), "output": str(out), "store": store, "seconds": 6.0, "budget": "48MiB"}
    try:
        with get_client(sync_client=True) as client:
            deployment = wait_for(lambda: client.read_deployment_by_name("reprocess-hog/hog"), 90)
            run = client.create_flow_run_from_deployment(deployment.id, parameters=params)
            hog = out / "line" / "memory_hog.zarr"
            wait_for(lambda: len(markers(hog)) >= 2 or None, 240, poll=0.05)
            client.set_flow_run_state(run.id, Cancelling(), force=True)
            final = wait_for(lambda: (s := client.read_flow_run(run.id).state) and s.is_final() and s, 120)
            assert final.type.value == "CANCELLED", final
            written, env_written = check_interrupted(out, store), envelope_written(out)
            runs = flow_runs_since(started)  # the run and its subflows
            assert not unfinished_task_runs(runs), "a cancelled run left task runs RUNNING or PENDING"

            rerun_started = time.time()
            again = client.create_flow_run_from_deployment(deployment.id, parameters=params)
            final = wait_for(lambda: (s := client.read_flow_run(again.id).state) and s.is_final() and s, 300)
            assert final.type.value == "COMPLETED", final
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
    check_resumed(out, store, survey, written, env_written, rerun_started)


def wait_for(fn, timeout: float, poll: float = 0.5):
    """Call ``fn`` until it returns something truthy (errors count as not yet); TimeoutError after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = fn()
            if value:
                return value
        except Exception as exc:  # not there yet (e.g. the deployment is still registering)
            last = exc
        time.sleep(poll)
    raise TimeoutError(f"gave up after {timeout:.0f} s; last error: {last!r}")
