"""What the simulator assumed of a batch queue and a walltime, beside what a real Slurm did in the same scenario.

    python -m benchmarks.slurm_vs_sim [--json PATH] [--workdir DIR] [--runs 20]

As root, on a machine where ``scripts/slurm/start.sh`` can start a one-node Slurm (it is started in WORKDIR and
stopped at the end; with ``SLURM_CONF`` set, that Slurm is used instead). One map: ``memory_hog`` (40x its
input, holding it ``--seconds-per-element`` x its block's elements: a chunk's time grows with its size, as an
operator's does, so the time the store learns holds for any chunking) over a 48 x 50 x 500 survey, with a fixed
``memory_budget`` so the real runs and the simulated ones plan from the same budget. Three runs, one store:

1. ``warm-up``: on a LocalCluster of 2 single-thread workers, to learn the operator (the simulator reads the
   store; it cannot simulate an operator nothing was learned about);
2. ``queue``: 2 SLURMCluster jobs (1 core, 1 GiB, adaptive 2 to 2) held 10 s in the queue (``--begin=now+10``);
3. ``walltime``: the same with ``walltime="00:01:00"``, on a map longer than that: the jobs are killed mid-map.

For each Slurm run, beside it the simulator's ``--runs`` runs of the same map (the store as the warm-up left it,
``ClusterShape`` with 2 workers, the same budget, ``QueueWait`` fixed at the median wait Slurm gave the jobs
(Submit to Start, from ``scontrol``), ``walltime_seconds`` 60 for the third): makespan, chunks lost with a job,
chunks submitted again, deaths by kind, and whether the run completed. The simulated makespan counts from the
jobs' submission; the real one from the flow's first line (the cluster is started at its first map), to the
map's result. Lost worker-seconds, real: each Crashed task run's time from its start to the state the runner set.

About 7 minutes on 2 cores (the map's 96 s on 2 workers outlast the jobs' minute). A run interrupted
before its end may leave its Slurm running: ``bash scripts/slurm/stop.sh WORKDIR/slurm`` stops it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MiB = 2**20
SHAPE = (48, 50, 500)
MULTIPLE = 40
WALLTIME_SECONDS = 60.0


def slurm_up(workdir: Path) -> Path | None:
    """Start the one-node Slurm under ``workdir`` (None: one is given by SLURM_CONF); exits where it cannot."""
    if os.environ.get("SLURM_CONF"):
        print(f"using the Slurm of SLURM_CONF={os.environ['SLURM_CONF']}", flush=True)
        return None
    d = workdir / "slurm"
    proc = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "start.sh"), str(d)], capture_output=True,
                          text=True, timeout=600)
    print((proc.stdout + proc.stderr).strip(), flush=True)
    if proc.returncode != 0:
        sys.exit(f"Slurm did not start (scripts/slurm/start.sh exit {proc.returncode})")
    os.environ["SLURM_CONF"] = str(d / "slurm.conf")
    return d


def job_times(name: str) -> list[dict[str, float | str]]:
    """Each job of this name as scontrol gives it: state, and submit / start / end times (epoch seconds)."""
    from datetime import datetime

    out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, timeout=30).stdout
    rows = []
    for line in out.splitlines():
        j = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if j.get("JobName") != name:
            continue
        t = {k: datetime.fromisoformat(j[k]).timestamp() for k in ("SubmitTime", "StartTime", "EndTime")
             if j.get(k, "Unknown") not in ("Unknown", "None")}
        rows.append({"state": j.get("JobState", ""), **t})
    return rows


def real_run(label: str, survey: str, store: str, workdir: Path, budget: str, per_element: float,
             cluster: dict | None) -> dict:
    """One map of memory_hog on ``cluster`` (SLURMCluster arguments; None: a LocalCluster), measured."""
    from prefect import flow

    from memchunk_prefect import MemoryAwareRunner, chunked
    from memchunk_prefect.run.observe import MapObserver
    from memchunk_prefect.testing import memory_hog, start_local_cluster

    class Submissions(MapObserver):
        def __init__(self) -> None:
            self.chunks: Counter = Counter()

        def on_submit(self, event) -> None:
            self.chunks[event.chunk.key()] += 1

    seen = Submissions()
    local = None
    common = {"memory_budget": budget, "store": store, "output_dir": str(workdir / "out" / label),
              "observers": [seen], "progress": False}
    if cluster is None:
        local = start_local_cluster(n_workers=2, memory_limit="1GiB")
        runner = MemoryAwareRunner(address=local.scheduler_address, **common)
    else:
        runner = MemoryAwareRunner(cluster_class="dask_jobqueue.SLURMCluster", cluster_kwargs=cluster,
                                   adapt_kwargs={"minimum_jobs": 2, "maximum_jobs": 2}, **common)

    @flow(task_runner=runner, name=f"slurm-vs-sim-{label}")
    def hog(path: str):
        from prefect.runtime import flow_run

        t0 = time.time()
        res = memory_hog.map(chunked(path), multiple=MULTIPLE, seconds_per_element=per_element)
        res.result()
        return str(flow_run.id), t0, time.time(), res.summary(), res.events

    try:
        run_id, t0, t1, summary, events = hog(survey)
    finally:
        if local is not None:
            local.close()
    deaths = Counter(e["event"] for e in events if e["event"] != "ok")
    crashed = crashed_runs(run_id)
    return {"run": label, "makespan_s": round(t1 - t0, 1), "chunks": summary["chunks"], "tasks": summary["tasks"],
            "lost_chunks": deaths.get("lost", 0), "resubmitted_chunks": sum(1 for n in seen.chunks.values() if n > 1),
            "lost_worker_seconds": round(sum(s for _, s in crashed), 1), "crashed_because": [m for m, _ in crashed],
            "deaths": dict(deaths), "completed": True}


def crashed_runs(flow_run_id: str) -> list[tuple[str, float]]:
    """The flow run's Crashed task runs: the reason the runner gave, and the seconds each ran before its worker
    died (from its start to the state the runner set, a moment after the death)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return [(r.state.message or "", (r.state.timestamp - r.start_time).total_seconds()) for r in runs
            if r.state is not None and r.state.name == "Crashed" and r.start_time is not None]


def simulated(store: str, budget_bytes: int, queue_wait_s: float, walltime_s: float | None, runs: int) -> dict:
    """The simulator's runs of the same map: 2 single-thread workers, the same budget, a fixed queue wait."""
    import numpy as np

    from memchunk_prefect.operators import operator_key
    from memchunk_prefect.sim.allocation import QueueWait
    from memchunk_prefect.sim.inputs import ClusterShape, Step, store_models
    from memchunk_prefect.sim.runs import run_strategy
    from memchunk_prefect.testing import memory_hog

    models = store_models(store)
    work = models.map_work()
    resting = 256 * MiB
    shape = ClusterShape(workers=2, memory_limit_bytes=int((budget_bytes + resting) / 0.95) + 1, resting_bytes=resting,
                         queue_wait=QueueWait("fixed", queue_wait_s), walltime_seconds=walltime_s,
                         map_start_seconds=work.start_seconds if work else 0.0,
                         map_end_seconds=work.end_seconds if work else 0.0)
    step = Step("memory_hog", operator_key(memory_hog, {"multiple": MULTIPLE}), (0, 0, 0), True)
    results = [run_strategy("memchunk", [step], SHAPE, shape, models.knowledge, np.random.default_rng(i),
                            truth_for=models.truth) for i in range(runs)]
    done = [r for r in results if r.completed]
    spans = [r.makespan_seconds for r in done]
    return {"runs": runs, "completed": len(done), "budget_bytes": shape.budget_bytes,
            "makespan_p50_s": round(statistics.median(spans), 1) if spans else None,
            "chunks": statistics.median(r.maps[0].chunks for r in results),
            "walltime_losses_mean": round(statistics.mean(r.walltime_losses for r in results), 2),
            "lost_worker_seconds_mean": round(statistics.mean(r.lost_worker_seconds for r in results), 1),
            "failure": next((r.failure for r in results if r.failure), "")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.slurm_vs_sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="also write every figure here")
    p.add_argument("--workdir", help="where Slurm, the survey, the store and the outputs go (default: a temp dir)")
    p.add_argument("--runs", type=int, default=20, help="simulated runs per scenario (default 20)")
    p.add_argument("--budget", default="48MiB", help="the map's memory_budget, real and simulated (default 48MiB: 6 "
                   "chunks)")
    p.add_argument("--seconds-per-element", type=float, default=1.6e-4,
                   help="seconds a chunk holds its memory per element of its block (default 1.6e-4: 192 s of "
                        "work in all, 96 s on 2 workers, longer than a job's 1 min walltime)")
    args = p.parse_args(argv)

    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect import synthetic_survey
    from memchunk_prefect.core.units import parse_bytes

    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="memchunk-slurm-vs-sim-")
    workdir = Path(args.workdir or tmp.name)  # type: ignore[union-attr]
    workdir.mkdir(parents=True, exist_ok=True)
    survey = str(synthetic_survey(workdir / "survey.sgy", SHAPE, seed=5))
    store = str(workdir / "store.sqlite")
    slurm_dir = slurm_up(workdir)
    started = time.monotonic()
    rows: list[dict] = []
    try:
        with _prefect_api():
            rows.append(real_run("warm-up", survey, store, workdir, args.budget, args.seconds_per_element, None))
            warm = str(workdir / "store-after-warm-up.sqlite")
            shutil.copy(store, warm)
            for label, walltime in (("queue", "00:10:00"), ("walltime", "00:01:00")):
                name = f"vs-sim-{label}"
                cluster = {"cores": 1, "processes": 1, "memory": "1GiB", "walltime": walltime, "job_name": name,
                           "job_extra_directives": ["--begin=now+10"],
                           "scheduler_options": {"host": "127.0.0.1", "dashboard_address": "127.0.0.1:0"},
                           "worker_extra_args": ["--host", "127.0.0.1"], "log_directory": str(workdir / "jobs")}
                row = real_run(label, survey, store, workdir, args.budget, args.seconds_per_element, cluster)
                jobs = job_times(name)
                waits = [j["StartTime"] - j["SubmitTime"] for j in jobs if "StartTime" in j]  # type: ignore[operator]
                lived = [j["EndTime"] - j["StartTime"] for j in jobs  # type: ignore[operator]
                         if j["state"] == "TIMEOUT" and "EndTime" in j]
                row.update(jobs=len(jobs), job_states=dict(Counter(str(j["state"]) for j in jobs)),
                           queue_wait_s=[round(w) for w in waits], timeout_after_s=[round(x) for x in lived])
                wait = statistics.median(waits) if waits else 0.0
                row["simulated"] = simulated(warm, parse_bytes(args.budget), wait,
                                             WALLTIME_SECONDS if label == "walltime" else None, args.runs)
                rows.append(row)
    finally:
        if slurm_dir is not None:
            subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "stop.sh"), str(slurm_dir)], timeout=180)
    print(f"\n{'run':<9} {'makespan s':>10} {'sim p50 s':>9} {'lost':>4} {'sim lost':>8} {'lost w-s':>8} "
          f"{'sim w-s':>7} {'resubmitted':>11} {'jobs':>4} {'queue waits s':>14} {'killed at s':>11}  sim completed")
    for r in rows:
        s = r.get("simulated") or {}
        print(f"{r['run']:<9} {r['makespan_s']:>10} {str(s.get('makespan_p50_s', '')):>9} {r['lost_chunks']:>4} "
              f"{str(s.get('walltime_losses_mean', '')):>8} {r['lost_worker_seconds']:>8} "
              f"{str(s.get('lost_worker_seconds_mean', '')):>7} {r['resubmitted_chunks']:>11} "
              f"{str(r.get('jobs', '')):>4} {str(r.get('queue_wait_s', '')):>14} "
              f"{str(r.get('timeout_after_s', '')):>11}"
              + (f"  {s['completed']}/{s['runs']} {s['failure'][:80]}" if s else ""))
    for r in rows:
        for why in r["crashed_because"][:2]:
            print(f"{r['run']}: a task run marked Crashed: {why}")
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "argv": sys.argv[1:]}, indent=1, default=str))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
