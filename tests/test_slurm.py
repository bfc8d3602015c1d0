"""MemoryAwareRunner on a real Slurm: real ``sbatch`` jobs started by dask-jobqueue's ``SLURMCluster``.

A one-node Slurm (munged, slurmctld, slurmd) is started for this module by ``scripts/slurm/start.sh`` in a
temporary directory and stopped by ``scripts/slurm/stop.sh`` when the module ends (a fixture, so ``.ci/run``
needs no step of its own and a run of any other test file never starts it). Where Slurm cannot start (not root,
no apt-get) the tests skip, saying why; with ``CI=true`` that is a failure. Memory enforcement is a cgroup
limit where this machine allows one (``start.sh`` says which; the cgroup-only assertion skips with its reason
elsewhere).

Each scenario prints one ``slurm-figures`` line (wall seconds, chunks resubmitted, deaths by kind, jobs' queue
waits): ``pytest -s -p no:cacheprovider tests/test_slurm.py`` shows them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from prefect import flow

from memchunk_prefect import MemoryAwareRunner, chunked, open_segy, operators, synthetic_survey
from memchunk_prefect.learn.store import Store
from memchunk_prefect.operators import operator_key
from memchunk_prefect.run.observe import MapObserver
from memchunk_prefect.testing import memory_hog, seed_store

pytestmark = [pytest.mark.slurm, pytest.mark.cluster, pytest.mark.usefixtures("prefect_server")]

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts" / "slurm"
MiB = 2**20


# ----------------------------------------------------------------------------- the Slurm, and what jobs say


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node Slurm for this module: yields its directory (``SLURM_CONF`` is set while it runs)."""
    d = tmp_path_factory.mktemp("slurm")
    proc = subprocess.run(["bash", str(SCRIPTS / "start.sh"), str(d)], capture_output=True, text=True, timeout=600)
    said = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(d)], capture_output=True, timeout=120)
        if proc.returncode == 3 and not running_in_ci():
            pytest.skip(said.splitlines()[-1] if said else "Slurm cannot start here")
        pytest.fail(f"{'CI=true and ' if running_in_ci() else ''}Slurm did not start "
                    f"(scripts/slurm/start.sh exit {proc.returncode}):\n{said[-3000:]}", pytrace=False)
    print(f"\n{said}")  # the node, and whether job memory is a cgroup limit here
    previous = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    try:
        yield d
    finally:
        stopped = subprocess.run(["bash", str(SCRIPTS / "stop.sh"), str(d)], capture_output=True, text=True,
                                 timeout=180)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        print(stopped.stdout.strip())


def running_in_ci() -> bool:
    """As tests/conftest.py reads it: CI sets ``CI=true``."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def cgroup_state(slurm: Path) -> str:
    return (slurm / "cgroup.state").read_text().strip()


def jobs_named(name: str) -> list[dict[str, str]]:
    """Every job Slurm still knows (``MinJobAge`` 600 s in start.sh) of this name: its fields as scontrol gives."""
    out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, timeout=30).stdout
    jobs = [dict(w.split("=", 1) for w in line.split() if "=" in w) for line in out.splitlines() if line.strip()]
    return [j for j in jobs if j.get("JobName") == name]


def queue_waits(name: str) -> list[float]:
    """Seconds each job of this name waited between its submission and its start (jobs that started)."""
    from datetime import datetime

    def t(s: str) -> float:
        return datetime.fromisoformat(s).timestamp()

    return sorted(t(j["StartTime"]) - t(j["SubmitTime"]) for j in jobs_named(name)
                  if j.get("StartTime", "Unknown") not in ("Unknown", "None") and j.get("JobState") != "PENDING")


def most_at_once(jobs: list[dict[str, str]]) -> int:
    """The most of these jobs that ran at the same time (from their StartTime and EndTime, seconds)."""
    from datetime import datetime

    spans = []
    for j in jobs:
        if j.get("StartTime", "Unknown") in ("Unknown", "None"):
            continue
        end = j.get("EndTime", "Unknown")
        spans.append((datetime.fromisoformat(j["StartTime"]).timestamp(),
                      datetime.fromisoformat(end).timestamp() if end not in ("Unknown", "None") else float("inf")))
    return max((sum(s <= t < e for s, e in spans) for t, _ in spans), default=0)


def slurm_kwargs(tmp_path: Path, name: str, **kw) -> dict:
    """SLURMCluster arguments for this node: one single-thread worker per job, the scheduler on loopback."""
    base = {"cores": 1, "processes": 1, "memory": "1GiB", "walltime": "00:10:00", "job_name": name,
            "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
            "worker_extra_args": ["--host", "127.0.0.1"], "log_directory": str(tmp_path / "jobs")}
    base.update(kw)
    return base


def report(scenario: str, **figures) -> None:
    print(f"\nslurm-figures {scenario}: {json.dumps(figures, sort_keys=True)}")


def unfinished_task_runs(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [(r.name, r.state.name) for r in runs if r.state and r.state.type.value in ("RUNNING", "PENDING",
                                                                                        "SCHEDULED")]


def crashed_messages(flow_run_id) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [r.state.message or "" for r in runs if r.state and r.state.name == "Crashed"]


def deaths_by_kind(events: list[dict]) -> dict[str, int]:
    return dict(Counter(e["event"] for e in events if e["event"] != "ok"))


class Submissions(MapObserver):
    """Counts each chunk's submissions (in the flow's process)."""

    def __init__(self):
        self.chunks: Counter = Counter()

    def on_submit(self, event) -> None:
        self.chunks[event.chunk.key()] += 1


@pytest.fixture(scope="module")
def survey(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("slurm-survey") / "survey.sgy"
    synthetic_survey(path, (64, 48, 150), seed=3)
    return str(path)


@pytest.fixture(scope="module")
def hog_survey(tmp_path_factory) -> str:
    """1.2 M samples (4.6 MiB): memory_hog at 40x is ~200 MiB in one piece, at 450x ~2 GiB."""
    path = tmp_path_factory.mktemp("slurm-hog") / "survey.sgy"
    synthetic_survey(path, (48, 50, 500), seed=5)
    return str(path)


# ----------------------------------------------------------------------------- the node itself


def test_a_job_gets_a_memory_cgroup_of_its_mem_where_this_machine_allows_one(slurm, tmp_path):
    """A job of ``--mem=300M`` reads its own limit (what the runner's budget reads on a worker)."""
    state = cgroup_state(slurm)
    if not state.startswith("on"):
        pytest.skip(f"no cgroup memory enforcement on this machine: {state}")
    out = tmp_path / "job.out"
    code = "import json; from memchunk_prefect.run.job_memory import job_memory; print(json.dumps(job_memory()))"
    subprocess.run(["sbatch", "--wait", "--mem=300M", "-o", str(out), "--wrap", f"{sys.executable} -c '{code}'"],
                   check=True, capture_output=True, timeout=120, cwd=tmp_path)
    read = json.loads(out.read_text().strip().splitlines()[-1])
    assert read["limit_bytes"] == 300 * MiB and read["source"].startswith("cgroup"), read
    assert read["batch"] == "slurm" and read["job_id"] and read["oom_kills"] == 0, read


# ----------------------------------------------------------------------------- a chained pipeline, jobs late


def test_a_chained_pipeline_on_jobs_arriving_late_equals_the_whole_volume_result(slurm, survey, tmp_path):
    """envelope -> gaussian_smooth -> gst3d_dip on SLURMCluster jobs that start 10 s after submission
    (``--begin=now+10``), 3 jobs (adaptive, 3 to 3) on a node that runs 2 at a time: the third waits for cores
    the whole run, and the runner plans for the 3 it asked for."""
    name = "mc-chain"
    runner = MemoryAwareRunner(cluster_class="dask_jobqueue.SLURMCluster",
                               cluster_kwargs=slurm_kwargs(tmp_path, name, job_extra_directives=["--begin=now+10"]),
                               adapt_kwargs={"minimum_jobs": 3, "maximum_jobs": 3},
                               store=str(tmp_path / "store.sqlite"), output_dir=str(tmp_path / "out"), progress=False)

    @flow(task_runner=runner)
    def pipeline(path: str):
        from prefect.runtime import flow_run

        env = operators.envelope.map(chunked(path))
        smooth = operators.gaussian_smooth.map(chunked(env))
        dip = operators.gst3d_dip.map(chunked(smooth))
        return str(flow_run.id), [m.summary() for m in (env, smooth, dip)], env.events + smooth.events + dip.events, \
            dip.result().values

    t0 = time.monotonic()
    run_id, summaries, events, values = pipeline(survey)
    wall = time.monotonic() - t0
    volume = open_segy(survey).values
    reference = operators.gst3d_dip.fn(operators.gaussian_smooth.fn(operators.envelope.fn(volume)))
    np.testing.assert_allclose(values, reference, atol=1e-5 * np.abs(reference).max())
    waits, jobs = queue_waits(name), jobs_named(name)
    assert len(jobs) == 3 and waits and min(waits) >= 9, f"the jobs ran without waiting 10 s: waits {waits}"
    assert most_at_once(jobs) == 2, "the node has 2 cores: a third job of one core each waits for one"
    assert not deaths_by_kind(events) and not unfinished_task_runs(run_id)
    report("chain", wall_seconds=round(wall, 1), chunks=[s["chunks"] for s in summaries],
           tasks=[s["tasks"] for s in summaries], deaths=deaths_by_kind(events),
           queue_waits=[round(w) for w in waits], jobs_submitted=len(jobs),
           workers_that_ran_chunks=len({e.get("worker") for e in events if e["event"] == "ok"}))


# ----------------------------------------------------------------------------- a job cancelled mid-map


def marker_times(out: Path) -> dict[str, float]:
    """When each chunk's completion marker was written (a chunk computed again rewrites its marker)."""
    done = out / ".memchunk" / "done"
    times = {}
    for e in os.scandir(done) if done.is_dir() else ():
        try:
            times[e.name] = json.loads((Path(e.path) / "zarr.json").read_text())["attributes"]["written_at"]
        except (OSError, ValueError, KeyError):
            continue
    return times


def test_a_job_cancelled_mid_map_loses_only_its_chunk_and_nothing_is_learned_as_memory(slurm, hog_survey, tmp_path):
    """``scancel`` of one of two jobs while both run chunks (what a walltime or a preemption does to a job): the
    chunk it ran is resubmitted, no written chunk is computed again, and the store holds no out-of-memory
    observation. The map starts cold (nothing learned: Dask's KilledWorker alone would read as a memory kill)."""
    name = "mc-cancel"
    out = tmp_path / "hog.zarr"
    store = str(tmp_path / "store.sqlite")
    submissions = Submissions()
    runner = MemoryAwareRunner(cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=slurm_kwargs(tmp_path, name),
                               adapt_kwargs={"minimum_jobs": 2, "maximum_jobs": 2}, memory_budget="48MiB",
                               store=store, observers=[submissions], progress=False)
    cancelled: dict = {}

    def cancel_one_running_job_mid_chunk() -> None:
        """Once the cold start's four probes are written, 0.8 s into the next chunks (2 s each)."""
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if len(marker_times(out)) >= 4:
                time.sleep(0.8)
                running = [j for j in jobs_named(name) if j.get("JobState") == "RUNNING"]
                if running:
                    cancelled.update(job=running[0]["JobId"], markers=marker_times(out), at=time.time())
                    subprocess.run(["scancel", running[0]["JobId"]], check=True, timeout=30)
                    return
            time.sleep(0.05)

    @flow(task_runner=runner)
    def hog(path: str):
        from prefect.runtime import flow_run

        res = memory_hog.map(chunked(path, output=out), multiple=40, seconds=2.0)
        return str(flow_run.id), res.summary(), res.events, res.result().values

    killer = threading.Thread(target=cancel_one_running_job_mid_chunk, daemon=True)
    killer.start()
    t0 = time.monotonic()
    run_id, summary, events, values = hog(hog_survey)
    wall = time.monotonic() - t0
    killer.join(5)
    assert cancelled, "no job was cancelled mid-map"
    np.testing.assert_array_equal(values, open_segy(hog_survey).values)
    after = marker_times(out)
    assert {c: after.get(c) for c in cancelled["markers"]} == cancelled["markers"], \
        "a chunk written before the job was cancelled was computed again (its marker was rewritten)"
    lost = [e for e in events if e["event"] == "lost"]
    assert summary["oom_events"] == 0 and "retry-smaller" not in summary["decisions"], events
    if lost:  # its chunk was running (Dask: KilledWorker): the flow resubmitted it, saying why
        assert any(f"batch job {cancelled['job']} ended CANCELLED" in m for m in crashed_messages(run_id)), \
            crashed_messages(run_id)
    ok = Counter(e["chunk"] for e in events if e["event"] == "ok")
    assert max(ok.values()) == 1, f"a chunk was collected twice: {ok}"
    again = {c: n for c, n in submissions.chunks.items() if n > 1}
    assert set(again) == {e["chunk"] for e in lost}, f"only the lost chunks ran again: {again}, lost {lost}"
    key = operator_key(memory_hog, {"multiple": 40})
    learned = Store(store).observations(key)
    assert not [o for o in learned if o.censored or o.outcome == "killed"], "a lost job is not out of memory"
    assert not unfinished_task_runs(run_id)
    report("scancel", wall_seconds=round(wall, 1), chunks=summary["chunks"], tasks=summary["tasks"],
           resubmitted_chunks=len(again), deaths=deaths_by_kind(events),
           written_before_cancel=len(cancelled["markers"]), rewritten=0)


# ----------------------------------------------------------------------------- the job's memory, not Dask's


def test_a_job_killed_for_its_memory_is_out_of_memory_and_its_budget_came_from_the_job(slurm, hog_survey, tmp_path):
    """Jobs of ``--mem=1200M`` whose workers are given a 3 GiB ``memory_limit``: the budget is derived from the
    job's limit (read on the worker: its cgroup, or Slurm's ``--mem``) less what the job's other processes hold,
    and a chunk the model under-predicts 4x dies of memory: killed by the kernel in the job's cgroup, by the
    nanny (distributed lowers a worker's ``memory_limit`` to the RLIMIT_RSS Slurm sets from ``--mem``) or by Slurm
    (over ``--mem``, where there is no cgroup). Each is read as out of memory from what it left (retry-smaller, a
    censored observation), not guessed."""
    name = "mc-oom"
    key = operator_key(memory_hog, {"multiple": 450})
    store = str(tmp_path / "store.sqlite")
    with Store(store) as s:
        seed_store(s, key, 4 * 100.0)  # the model believes 100x: a 4x under-prediction
    runner = MemoryAwareRunner(cluster_class="dask_jobqueue.SLURMCluster",
                               cluster_kwargs=slurm_kwargs(tmp_path, name, memory="3GiB", job_mem="1200M"),
                               adapt_kwargs={"minimum_jobs": 2, "maximum_jobs": 2}, store=store, progress=False)

    @flow(task_runner=runner)
    def hog(path: str):
        from prefect.runtime import flow_run

        res = memory_hog.map(chunked(path), multiple=450, seconds=2.0)
        return str(flow_run.id), res.summary(), res.events, res.result().values

    t0 = time.monotonic()
    run_id, summary, events, values = hog(hog_survey)
    wall = time.monotonic() - t0
    np.testing.assert_array_equal(values, open_segy(hog_survey).values)
    assert "the job's memory limit 1.2 GiB" in summary["budget_reason"] or \
        "the job's memory limit 1.1 GiB" in summary["budget_reason"], summary["budget_reason"]
    assert summary["budget_bytes"] < 1200 * 10**6, summary
    killed = [e for e in events if e["event"] == "killed"]
    assert killed and "retry-smaller" in summary["decisions"], events
    reasons = [r for d, r in zip(summary["decisions"], summary["reasons"]) if d == "retry-smaller"]
    by_cgroup = cgroup_state(slurm).startswith("on")
    read = ("OOM killer ran", "its nanny killed it", "ended OUT_OF_MEMORY")
    assert all(any(w in r for w in read) and "treated as" not in r for r in reasons), reasons
    censored = [o for o in Store(store).observations(key) if o.censored]
    assert censored and all(o.outcome == "killed" and o.peak_bytes > 0 for o in censored), censored
    assert not unfinished_task_runs(run_id)
    report("oom", wall_seconds=round(wall, 1), chunks=summary["chunks"], tasks=summary["tasks"], cgroup=by_cgroup,
           deaths=deaths_by_kind(events), budget_mib=round(summary["budget_bytes"] / MiB),
           killed_by={"kernel (cgroup)": sum("OOM killer" in r for r in reasons),
                      "nanny": sum("nanny" in r for r in reasons),
                      "Slurm OUT_OF_MEMORY": sum("OUT_OF_MEMORY" in r for r in reasons)},
           reasons=reasons)


def test_a_job_without_a_nanny_killed_for_its_memory_is_read_as_out_of_memory_from_slurm(slurm, hog_survey,
                                                                                          tmp_path):
    """Workers started without a nanny (``nanny=False``): nothing restarts a worker the kernel (or Slurm) kills,
    the job ends, and only Slurm can say why: its state (OUT_OF_MEMORY after a cgroup OOM; FAILED by SIGKILL
    where Slurm's accounting poll killed it) is read (``scontrol``) and the chunk is split; adaptive scaling
    replaces the job."""
    name = "mc-oom-nonanny"
    key = operator_key(memory_hog, {"multiple": 450})
    store = str(tmp_path / "store.sqlite")
    with Store(store) as s:
        seed_store(s, key, 4 * 100.0)
    runner = MemoryAwareRunner(cluster_class="dask_jobqueue.SLURMCluster",
                               cluster_kwargs=slurm_kwargs(tmp_path, name, memory="1200MB", nanny=False),
                               adapt_kwargs={"minimum_jobs": 1, "maximum_jobs": 1}, store=store, progress=False)

    @flow(task_runner=runner)
    def hog(path: str):
        from prefect.runtime import flow_run

        res = memory_hog.map(chunked(path), multiple=450, seconds=2.0)
        return str(flow_run.id), res.summary(), res.events, res.result().values

    t0 = time.monotonic()
    run_id, summary, events, values = hog(hog_survey)
    wall = time.monotonic() - t0
    np.testing.assert_array_equal(values, open_segy(hog_survey).values)
    reasons = [r for d, r in zip(summary["decisions"], summary["reasons"]) if d == "retry-smaller"]
    # A cgroup's OOM ends the job OUT_OF_MEMORY; Slurm's poll (no cgroups) ends it FAILED, by SIGKILL.
    read, state = (("ended OUT_OF_MEMORY (scontrol)", "OUT_OF_MEMORY") if cgroup_state(slurm).startswith("on")
                   else ("ended FAILED, killed by signal 9 (scontrol)", "FAILED"))
    assert reasons and all(read in r for r in reasons), reasons
    states = Counter(j["JobState"] for j in jobs_named(name))
    assert states[state] == len(reasons), states
    assert [o for o in Store(store).observations(key) if o.censored]
    assert not unfinished_task_runs(run_id)
    report("oom-no-nanny", wall_seconds=round(wall, 1), chunks=summary["chunks"], tasks=summary["tasks"],
           deaths=deaths_by_kind(events), job_states=dict(states), reasons=reasons,
           budget_reason=summary["budget_reason"])


# ----------------------------------------------------------------------------- what `memchunk recommend` prints


def test_the_arguments_memchunk_recommend_prints_start_a_cluster_that_runs(slurm, survey, tmp_path, capsys):
    from memchunk_prefect.cli import app as cli

    store = tmp_path / "store.sqlite"
    Store(store).close()
    assert cli.main(["recommend", "--store", str(store), "--steps", "envelope", "--shape", "64", "48", "150",
                     "--deadline", "10min", "--memory", "768MiB", "1GiB", "--prior-multiple", "12",
                     "--queue-wait", "5s", "--walltime", "10min", "--runs", "3", "--json"]) == cli.EXIT_OK
    jobqueue = json.loads(capsys.readouterr().out)["jobqueue"]
    jobs = jobqueue.pop("jobs")
    assert set(jobqueue) == {"cores", "processes", "memory", "walltime"} and jobs >= 1, jobqueue
    name = "mc-recommend"
    kwargs = slurm_kwargs(tmp_path, name, **jobqueue, n_workers=jobs)
    runner = MemoryAwareRunner(cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=kwargs, store=str(store),
                               output_dir=str(tmp_path / "out"), progress=False)

    @flow(task_runner=runner)
    def env(path: str):
        from prefect.runtime import flow_run

        return str(flow_run.id), operators.envelope.map(chunked(path)).result().values

    run_id, values = env(survey)
    volume = open_segy(survey).values
    np.testing.assert_allclose(values, operators.envelope.fn(volume), atol=1e-5 * np.abs(volume).max())
    started = jobs_named(name)
    assert len(started) == jobs and all(j["TimeLimit"] == jobqueue["walltime"] for j in started), started
    assert not unfinished_task_runs(run_id)
    report("recommend", jobqueue=jobqueue, jobs=jobs, time_limits=[j["TimeLimit"] for j in started],
           mem=[j.get("MinMemoryNode") for j in started])
