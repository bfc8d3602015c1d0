"""``python -m benchmarks.sim_validation``: the simulator's predictions beside real runs of workloads it never saw.

Over the seeded workload family (:mod:`benchmarks.family.workloads`: user operators of different memory and
compute growth, surveys and clusters drawn from a seed), each strategy runs for real in a fresh process on a
fresh cluster (:mod:`benchmarks.family.child`, against one Prefect server), and beside each real run the
simulator predicts the same flow run, on the same cluster, from the store as it stood before that run
(:func:`memchunk_prefect.sim.from_flow_run`, ``--runs`` simulated runs each):

1. ``memchunk cold`` on an empty store; predicted afterwards with ``cold=True`` (the runner probing and
   learning from its own chunks, as on an empty store) and the chunks drawn from the models that run taught:
   nothing else can say what a first run's chunks need;
2. ``static-N`` for each N of ``--static`` and ``split`` (split-on-failure), plain Prefect flows with
   ``allowed-failures`` 0 as the simulator assumes; predicted from the store the cold run left, with the steps
   of its flow run;
3. ``--warm`` runs of ``memchunk`` on that store, each predicted from a copy of the store taken just before it.

Per real run: its makespan (memchunk: from its first map's start to its last map's end, as the store recorded
them; static and split: from the first step's start to the last step's end), whether it completed, its kills
(workers killed or ``MemoryError`` s) and chunks per step, beside the prediction's median makespan, the share
of simulated runs that failed, mean kills and median chunks per step.

Also measured: what a plain Prefect task costs on each workload's cluster beyond its work
(:func:`measure_plain_tasks`: the static flow's tasks, returning at once; the static and split predictions use it
in place of the simulator's stated ``per_task_overhead_seconds``), the seconds a worker killed by its nanny is
away before its new process runs a task like the runner's (:func:`measure_restart`, beside the simulator's default
:data:`memchunk_prefect.sim.inputs.RESTART_SECONDS`; the predictions use the figure measured here), and the
seconds a 1,000-worker simulation of a recorded flow run takes, in this process and end to end as
``memchunk simulate --flow-run`` (a new process: imports and the store included).

Targets (reported, never adjusted): median absolute makespan error <= 10% and worst <= 25% over the runs that
completed; a strategy that failed in reality predicted to fail in >= 90% of its simulated runs, one that
completed predicted to complete in >= 90%; a 1,000-worker simulation under 30 s. Written as JSON (``--json``)
and as a table. ``--quick``: the family's smallest member, static-2, split, cold and one warm run, 5 simulated
runs per prediction (for CI: no timing is asserted).

    python -m benchmarks.sim_validation --json sim-validation.json     # 6 workloads of seed 0
    python -m benchmarks.sim_validation --quick --json quick.json
    python -m benchmarks.sim_validation --scale 16 --json sim-16.json   # 16x the traces: minutes, not seconds
    python -m benchmarks.sim_validation --repeats 2 --json sim-validation.json  # each plain flow run twice

``--repeats N`` runs each static and split flow N times, each run a row beside the one prediction, and reports how
far the runs of one flow fall apart (the error a simulator that predicted one of them exactly would show on another)
and each prediction against its flow's median run: a single run's error carries that spread, which no simulator
can predict.

The errors are also split by how far each run's blocks lay beyond the largest the store its prediction read had
timed after first calls (:func:`error_by_extent`): a plan of blocks much larger than any the store timed rests on
the models' extrapolation.

Each workload's store at the end (its memchunk cold and warm flow runs) is also read as a user's store is by
``memchunk simulate --track-record``: each warm flow run predicted from the store as it stood when the run
started, the cold one from the store at its end (:func:`memchunk_prefect.sim.track_record`), pooled over the
workloads. The summary says how many a deadline at the p90 would have held, and how many one at the p90 times the
booking factor learned from the other runs would have (leave one out: the factor never saw the run it books).

``--replay RESULT.json --work DIR`` predicts a finished run's real runs again with this checkout's simulator,
from the copies of the stores that run kept in ``DIR`` (its ``--work``), with its measured restart: the real
runs stand, only the predictions are new (seconds, not the run's minutes, for a change to the simulator).
``--without-rise`` predicts them as if no run had timed when its memory peaked, every task's memory rising
evenly to its peak half way through: what following each operator's learned rise changes.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.family.workloads import Workload, family, quick

REPO = Path(__file__).resolve().parents[1]
TARGETS = {"median_abs_error": 0.10, "worst_abs_error": 0.25, "failed_predicted_failed": 0.90,
           "completed_predicted_completed": 0.90, "thousand_workers_seconds": 30.0}
MiB = 2**20


# --------------------------------------------------------------------------- the restart of a killed worker


def _imports() -> float:
    """On a worker: what a Prefect task run of the runner imports there; returns when it is done (epoch s)."""
    import prefect  # noqa: F401

    import memchunk_prefect.run.worker  # noqa: F401

    return time.time()


def _hog() -> None:
    """On a worker: touch memory 32 MiB at a time until the nanny kills the process."""
    held = []
    while True:
        block = bytearray(32 * MiB)
        block[::4096] = b"x" * len(block[::4096])
        held.append(block)
        time.sleep(0.005)


def _addresses(client: Any) -> set[str]:
    return set(client.scheduler_info(n_workers=-1)["workers"])


def _wait(predicate: Any, timeout: float, step: float = 0.02) -> float:
    """Poll ``predicate`` until it holds; the time it first held (epoch s). TimeoutError after ``timeout`` s."""
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return time.time()
        time.sleep(step)
    raise TimeoutError(f"not within {timeout:g} s")


def measure_restart(memory_limit_mib: int = 600, repeats: int = 3) -> dict[str, Any]:
    """Kill a worker for memory ``repeats`` times (a nanny-managed LocalCluster of one worker); each time, the
    seconds from the scheduler seeing it go to its new process joining (``rejoin``) and to a task that imports
    what a Prefect task run of the runner imports finishing there (``first_task``: when the slot takes work as
    before). The medians, and every sample."""
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        cluster = LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                               memory_limit=f"{memory_limit_mib}MiB", dashboard_address="127.0.0.1:0")
    client = Client(cluster)
    samples = []
    try:
        for _ in range(repeats):
            client.submit(_imports, pure=False).result(timeout=120)  # the worker as a run leaves it: imports done
            old = _addresses(client)
            fut = client.submit(_hog, pure=False)
            gone = _wait(lambda old=old: not (old & _addresses(client)), 120)
            back = _wait(lambda old=old: bool(_addresses(client) - old), 120)
            ready = client.submit(_imports, pure=False).result(timeout=120)
            fut.cancel()
            samples.append({"rejoin_seconds": back - gone, "first_task_seconds": ready - gone})
    finally:
        client.close()
        cluster.close()
    return {"memory_limit_mib": memory_limit_mib, "samples": samples,
            "rejoin_seconds": statistics.median(s["rejoin_seconds"] for s in samples),
            "first_task_seconds": statistics.median(s["first_task_seconds"] for s in samples)}


# --------------------------------------------------------------------------- real runs and their predictions


def snapshot(store: str, to: Path) -> str:
    """A copy of the store as it stands (SQLite's backup: consistent while WAL files exist)."""
    to.unlink(missing_ok=True)
    src, dst = sqlite3.connect(store), sqlite3.connect(to)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()
    return str(to)


def real_makespan(store: str, flow_run_id: str) -> float | None:
    """A memchunk run's makespan as its store recorded it: its first map's start to its last map's end."""
    from memchunk_prefect.learn.store import Store

    with Store(store) as s:
        maps = s.maps(flow_run_id)
    return max(m.ended_at for m in maps) - min(m.started_at for m in maps) if maps else None


def measure_plain_tasks(w: Workload, source: str, work: Path, env: dict[str, str], timeout: float,
                        tasks: int = 32) -> dict[str, Any]:
    """What a plain Prefect task costs on the workload's cluster beyond its work: ``static-N``'s flow with
    ``tasks`` slabs per step, on a fresh cluster in a fresh process (:mod:`benchmarks.family.child`'s
    ``empty-N``), every task returning at once. ``task_seconds``: the median over the steps of a step's seconds
    times its busy slots over its tasks, over the threads per core (slot seconds per task, as the simulator's
    ``per_task_overhead_seconds`` counts them: it stretches a task's seconds, overhead included, where the threads
    outnumber the cores); None where the run failed."""
    from benchmarks.family.__main__ import run_child

    out_dir = str(work / "out" / f"{w.name}-empty")
    r = run_child({"workload": w.to_dict(), "strategy": f"empty-{tasks}", "source": source,
                   "store": str(work / "unused.sqlite"), "out_dir": out_dir}, env, timeout)
    shutil.rmtree(out_dir, ignore_errors=True)
    steps = r.get("steps_seconds") or []
    slots, per_core = min(w.workers * w.threads, tasks), _threads_per_core(w)
    return {"tasks": tasks, "slots": slots, "threads_per_core": per_core, "steps_seconds": steps,
            "failed": r.get("failed"),
            "task_seconds": statistics.median(t * slots / tasks / per_core for t in steps) if steps else None}


def _threads_per_core(w: Workload) -> float:
    """The workload's worker threads per CPU core of this machine (1.0: a core each), as the runner counts them
    (:attr:`memchunk_prefect.sim.inputs.ClusterShape.threads_per_core`)."""
    threads = w.workers * w.threads
    return max(1.0, threads / min(threads, len(os.sched_getaffinity(0))))


def predict(store: str, flow_run: str, w: Workload, strategy: str, *, runs: int, restart: float | None,
            cold: bool = False, seed: int = 0, task_seconds: float | None = None) -> dict[str, Any]:
    """The simulator's prediction of one strategy's run of ``flow_run``'s steps on the workload's survey and
    cluster, from ``store``; ``task_seconds``: a plain task's cost measured on that cluster
    (:func:`measure_plain_tasks`; None: the simulator's stated figure), for the plain flows (static, split)."""
    from memchunk_prefect.sim import from_flow_run

    kw: dict[str, Any] = {"restart_seconds": restart} if restart is not None else {}
    if task_seconds is not None and strategy != "memchunk":
        kw["per_task_overhead_seconds"] = task_seconds
    # The real runs' workers share this machine's cores: the runner's plans count that (Budget.threads_per_core).
    kw["threads_per_core"] = _threads_per_core(w)
    t = time.perf_counter()
    plan = from_flow_run(store, flow_run, shape=w.survey_shape, workers=w.workers,
                         memory_limit=w.memory_limit_mib * MiB, threads_per_worker=w.threads, strategies=[strategy],
                         runs=runs, seed=seed, cold=cold, **kw)
    s = plan.summary()
    return {"makespan_p50": s.makespan_p50, "makespan_p90": s.makespan_p90,
            "per_task_overhead_seconds": plan.cluster.per_task_overhead_seconds,
            "failed_fraction": 1.0 - s.completed / s.runs, "kills_mean": s.out_of_memory_mean,
            "chunks": s.chunks_per_map, "failure": s.failure, "runs": s.runs,
            "simulation_seconds": time.perf_counter() - t}


def compare(real: dict[str, Any], pred: dict[str, Any]) -> dict[str, Any]:
    """One real run beside its prediction: the makespan error (relative to the real one; where both completed)
    and whether the outcome was predicted (a failure in >= 90% of simulated runs, a completion in >= 90%)."""
    completed = bool(real.get("completed"))
    span = real.get("makespan_seconds")
    error = None
    if completed and span and pred["makespan_p50"] is not None:
        error = (pred["makespan_p50"] - span) / span
    outcome_ok = (pred["failed_fraction"] <= 1 - TARGETS["completed_predicted_completed"] if completed
                  else pred["failed_fraction"] >= TARGETS["failed_predicted_failed"])
    return {"error": error, "outcome_predicted": outcome_ok}


def run_workload(w: Workload, work: Path, env: dict[str, str], statics: list[int], warm: int, runs: int,
                 restart: float | None, timeout: float,
                 repeats: int = 1) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every real run of one workload beside its prediction (see the module docstring), and what a plain task
    cost on its cluster (:func:`measure_plain_tasks`). ``repeats``: real runs of each plain flow (static, split),
    each a row beside the one prediction (``repeat``: 0, 1, ...): how far runs of the same flow on the same
    cluster fall apart (:func:`real_spread`)."""
    from benchmarks.family.__main__ import make_source, run_child

    source = make_source(w, work)
    store = str(work / f"{w.name}.sqlite")
    for p in Path(store).parent.glob(Path(store).name + "*"):
        p.unlink()
    out_dir = str(work / "out" / w.name)
    rows: list[dict[str, Any]] = []

    def child(strategy: str) -> dict[str, Any]:
        shutil.rmtree(out_dir, ignore_errors=True)
        r = run_child({"workload": w.to_dict(), "strategy": strategy, "source": source, "store": store,
                       "out_dir": out_dir, "allowed_failures": 0}, env, timeout)
        if strategy == "memchunk" and r.get("flow_run_id"):
            r["makespan_seconds"] = real_makespan(store, r["flow_run_id"])
        else:
            r["makespan_seconds"] = r.get("maps_seconds")
        return r

    def row(kind: str, strategy: str, real: dict[str, Any], pred: dict[str, Any],
            repeat: int | None = None) -> None:
        r = {"workload": w.name, "kind": kind, "strategy": strategy, "real": real, "predicted": pred,
             "repeat": repeat, **compare(real, pred)}
        rows.append(r)
        err = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        print(f"  {kind:<12} real {_s(real.get('makespan_seconds'))} {'ok' if real.get('completed') else 'FAILED'} "
              f"kills {real.get('kills', 0)}  predicted {_s(pred['makespan_p50'])} failed "
              f"{100 * pred['failed_fraction']:.0f}% kills {pred['kills_mean']:.2f}  error {err}", flush=True)

    print(f"{w.name}: {w.survey_shape} {w.source}, {w.workers} workers x {w.memory_limit_mib} MiB x {w.threads} "
          "thread(s)", flush=True)
    cold = child("memchunk")
    if not cold.get("flow_run_id"):
        print(f"  memchunk cold did not finish ({cold.get('failed')}): nothing recorded to predict from", flush=True)
        rows.append({"workload": w.name, "kind": "memchunk cold", "strategy": "memchunk", "real": cold,
                     "predicted": None, "error": None, "outcome_predicted": None})
        return rows, {}
    flow_run = cold["flow_run_id"]
    row("memchunk cold", "memchunk", cold, predict(store, flow_run, w, "memchunk", runs=runs, restart=restart,
                                                   cold=True))
    after_cold = snapshot(store, _after_cold(work, w))
    plain = measure_plain_tasks(w, source, work, env, timeout)
    print(f"  a plain task: {plain['task_seconds'] or 0:.3f} s of a slot ({plain['tasks']} empty tasks a step on "
          f"{plain['slots']} slots: {', '.join(f'{t:.2f}' for t in plain['steps_seconds'])} s)", flush=True)
    for strategy in [f"static-{n}" for n in statics] + ["split"]:
        pred = predict(after_cold, flow_run, w, strategy, runs=runs, restart=restart,
                       task_seconds=plain["task_seconds"])
        for k in range(repeats):
            row(strategy, strategy, child(strategy), pred, repeat=k)
    for k in range(warm):
        before = snapshot(store, _before_warm(work, w, k))
        pred = predict(before, "latest", w, "memchunk", runs=runs, restart=restart)
        row("memchunk warm", "memchunk", child("memchunk"), pred)
    return rows, plain


def _after_cold(work: Path, w: Workload) -> Path:
    return work / f"{w.name}-after-cold.sqlite"


def _before_warm(work: Path, w: Workload, k: int) -> Path:
    return work / f"{w.name}-before-warm-{k}.sqlite"


def replay(doc: dict[str, Any], work: Path, runs: int) -> list[dict[str, Any]]:
    """A finished run's rows with new predictions from its stores' copies in ``work`` (see the module docstring):
    ``memchunk cold`` and the baselines from the copy taken after the cold run, the k-th warm run from the copy
    taken before it."""
    workloads = {d["name"]: Workload.from_dict(d) for d in doc["workloads"]}
    restart = (doc.get("restart") or {}).get("first_task_seconds")
    plain = doc.get("plain_tasks") or {}
    out: list[dict[str, Any]] = []
    warm: dict[str, int] = {}
    cold_run: dict[str, str] = {}
    baselines: dict[tuple[str, str], dict[str, Any]] = {}
    for r in doc["rows"]:
        w = workloads[r["workload"]]
        if r["predicted"] is None:
            out.append(r)
            continue
        if r["kind"] == "memchunk cold":
            cold_run[w.name] = r["real"]["flow_run_id"]
            pred = predict(str(_after_cold(work, w)), cold_run[w.name], w, "memchunk", runs=runs, restart=restart,
                           cold=True)
        elif r["kind"] == "memchunk warm":
            k = warm[w.name] = warm.get(w.name, -1) + 1
            pred = predict(str(_before_warm(work, w, k)), "latest", w, "memchunk", runs=runs, restart=restart)
        elif (w.name, r["strategy"]) in baselines:  # a repeat of a plain flow: the one prediction stands
            pred = baselines[w.name, r["strategy"]]
        else:
            pred = baselines[w.name, r["strategy"]] = predict(
                str(_after_cold(work, w)), cold_run[w.name], w, r["strategy"], runs=runs, restart=restart,
                task_seconds=(plain.get(w.name) or {}).get("task_seconds"))
        out.append({**r, "predicted": pred, **compare(r["real"], pred)})
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:6.1f} s"


# --------------------------------------------------------------------------- 1,000 workers


def thousand_workers(store: str, flow_run: str, samples: int, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """A 1,000-worker simulation (8 GiB each) of a recorded flow run on a 2,000 x 2,000 survey of its samples:
    seconds in this process (one run) and end to end as ``memchunk simulate --flow-run`` in a new process."""
    from memchunk_prefect.sim import from_flow_run

    shape = (2000, 2000, int(samples))
    t = time.perf_counter()
    plan = from_flow_run(store, flow_run, shape=shape, workers=1000, memory_limit="8GiB", runs=1)
    in_process = time.perf_counter() - t
    argv = [sys.executable, "-m", "memchunk_prefect", "simulate", "--store", store, "--flow-run", flow_run,
            "--shape", *map(str, shape), "--workers", "1000", "--memory-limit", "8GiB", "--runs", "1",
            "--strategies", "memchunk", "--json"]
    t = time.perf_counter()
    proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    end_to_end = time.perf_counter() - t
    s = plan.summary()
    return {"shape": list(shape), "workers": 1000, "memory_limit": "8GiB", "seconds": in_process,
            "end_to_end_seconds": end_to_end if proc.returncode == 0 else None,
            "end_to_end_error": None if proc.returncode == 0 else proc.stderr.strip()[-500:],
            "command": " ".join(argv[1:]), "makespan_seconds": s.makespan_p50, "completed": s.completed == s.runs,
            "chunks": s.chunks_per_map}


# --------------------------------------------------------------------------- the report


def real_spread(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How far real runs of one flow fall apart: over each plain flow run more than once (``--repeats``) on one
    workload, every completed run against every other (``|a - b| / b``, each way), the error a simulator that
    predicted one of them exactly would show on the other; and each prediction's error against the median of
    its flow's real runs (``error_to_median``: the simulator judged against the runs' centre, not one draw).
    None when no flow ran twice."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("repeat") is not None and r["real"].get("completed") and r["real"].get("makespan_seconds"):
            groups.setdefault((r["workload"], r["strategy"]), []).append(r)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return None
    apart: list[float] = []
    to_median: list[float] = []
    for runs in groups.values():
        spans = [float(r["real"]["makespan_seconds"]) for r in runs]
        apart += [abs(a - b) / b for i, a in enumerate(spans) for j, b in enumerate(spans) if i != j]
        predicted = runs[0]["predicted"]["makespan_p50"] if runs[0]["predicted"] else None
        if predicted is not None:
            centre = statistics.median(spans)
            to_median.append(abs(predicted - centre) / centre)
    return {"flows": len(groups), "runs": sum(len(v) for v in groups.values()),
            "median_apart": statistics.median(apart), "worst_apart": max(apart),
            "median_error_to_median": statistics.median(to_median) if to_median else None,
            "worst_error_to_median": max(to_median) if to_median else None}


def p90_coverage(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a deadline booked at a prediction's p90 would have held: over the completed real runs with a
    prediction, how many ended by their predicted p90 (``under_p90``; a calibrated p90 holds for 90%), how far each
    p90 sat above its p50 (``p90_above_p50_median``, the median of ``p90 / p50 - 1``), and the median signed error
    of the p50 (``signed_median_error``: below 0, the simulator predicts runs shorter than they run). None
    without such a run."""
    done = [r for r in rows if r["error"] is not None and r["predicted"]
            and r["predicted"].get("makespan_p90") is not None]
    if not done:
        return None
    return {"runs": len(done),
            "under_p90": sum(float(r["real"]["makespan_seconds"]) <= float(r["predicted"]["makespan_p90"])
                             for r in done),
            "p90_above_p50_median": statistics.median(float(r["predicted"]["makespan_p90"])
                                                      / float(r["predicted"]["makespan_p50"]) - 1.0 for r in done),
            "signed_median_error": statistics.median(float(r["error"]) for r in done)}


def track_records(stores: list[Path], runs: int) -> dict[str, Any] | None:
    """The stores' flow runs predicted again as ``memchunk simulate --track-record`` does
    (:func:`memchunk_prefect.sim.track_record`: a warm run from the store as it stood at its start, a first run
    cold from the store at its end), pooled: how many ended by their p90 (``under_p90``), how many by their p90
    times the booking factor of the other runs (``under_factor_left_out``), the factor of all of them
    (``factor``, :func:`memchunk_prefect.sim.track.booking_factor`), and the median error of warm and cold runs
    apart. None without a predicted run."""
    from memchunk_prefect.sim.track import booking_factor, track_record

    records = [track_record(path, runs=min(runs, 10)) for path in stores if path.exists()]
    rows = [r for record in records for r in record.predicted if r.p90_seconds]
    if not rows:
        return None
    ratios = [x for record in records for x in record.ratios]
    left_out = [booking_factor(ratios[:i] + ratios[i + 1:]) for i in range(len(ratios))]

    def median_error(cold: bool) -> float | None:
        errors = [abs(r.error or 0.0) for r in rows if r.cold == cold]
        return statistics.median(errors) if errors else None

    return {"runs": len(rows), "stores": sum(p.exists() for p in stores), "cold": sum(r.cold for r in rows),
            "under_p90": sum(r.held_by_p90 for r in rows),
            "under_factor_left_out": sum(f is not None and x <= f for x, f in zip(ratios, left_out)),
            "factor": booking_factor(ratios), "median_abs_error_warm": median_error(False),
            "median_abs_error_cold": median_error(True)}


def warm_first_calls(stores: list[Path]) -> dict[str, Any] | None:
    """What the warm runs (every flow run of a store after its first, each on a fresh cluster) timed: their
    finished chunks (``chunks``), how many were their worker process's first call of the operator
    (``first_calls``: they teach the time model's rates nothing,
    :meth:`memchunk_prefect.learn.time.TimeModel.first_call_seconds`), and how many read a block over
    ``MIN_SIZE_RATIO`` times the largest the store's first flow run timed of that operator after its first calls
    (``beyond_cold``; an earlier warm run's later calls may have timed some of them). None without a warm run."""
    from memchunk_prefect.learn.forms import MIN_SIZE_RATIO
    from memchunk_prefect.learn.store import Store

    chunks = first = beyond = 0
    for path in stores:
        if not path.exists():
            continue
        with Store(path) as s:
            starts: dict[str, float] = {}
            for m in s.maps():
                starts[m.flow_run_id] = min(starts.get(m.flow_run_id, m.started_at), m.started_at)
            runs = sorted(starts, key=starts.__getitem__)
            largest: dict[str, int] = {}
            for i, run in enumerate(runs):
                done = [o for o in s.run_observations(run) if o.outcome == "ok"]
                if i == 0:
                    for o in done:
                        if not o.first_call:
                            largest[o.operator_key] = max(largest.get(o.operator_key, 0), o.elements)
                    continue
                chunks += len(done)
                first += sum(bool(o.first_call) for o in done)
                beyond += sum(o.elements > MIN_SIZE_RATIO * largest.get(o.operator_key, 0) for o in done)
    return {"chunks": chunks, "first_calls": first, "beyond_cold": beyond, "ratio": MIN_SIZE_RATIO} if chunks else None


def error_by_extent(rows: list[dict[str, Any]], workloads: list[Workload], work: Path) -> dict[str, Any] | None:
    """The predictions' errors split by how far their blocks lay beyond what the store had timed.

    For each row with an error but the cold runs' (their own probes were the timing), its extent is the largest,
    over its steps, of the step's block (the survey's elements over the chunks the real run cut that step in;
    halos left out) over the largest block of that step's operator key a later call had timed in the store the
    prediction read (the copy after the cold run; for the k-th warm run, the copy before it). Rows are split at
    ``MIN_SIZE_RATIO``, where the time model compares sizes, and each part gets its count, median, 90th
    percentile and worst absolute error; of the 20 largest errors (``largest_errors``, fewer where there are
    fewer rows), ``largest_errors_beyond`` lay beyond. An operator the store never timed after a first call
    counts as beyond. None without such a row."""
    from benchmarks.family.archetypes import ARCHETYPES
    from memchunk_prefect.learn.forms import MIN_SIZE_RATIO
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.operators.spec import operator_key

    by_name = {w.name: w for w in workloads}
    largest: dict[Path, dict[str, int]] = {}
    warm: dict[str, int] = {}
    extents: list[tuple[float, float]] = []
    for r in rows:
        w = by_name.get(r["workload"])
        if w is None:
            continue
        if r["kind"] == "memchunk warm":  # the k-th warm run, failed or not, read the k-th copy
            k = warm[w.name] = warm.get(w.name, -1) + 1
        if r.get("error") is None or r["kind"] == "memchunk cold":
            continue
        path = _before_warm(work, w, k) if r["kind"] == "memchunk warm" else _after_cold(work, w)
        if not path.exists():
            continue
        if path not in largest:
            with Store(path) as store:
                largest[path] = {key: max((o.elements for o in store.observations(key)
                                           if o.outcome == "ok" and not o.first_call), default=0)
                                 for key in store.keys()}
        elements = w.survey_shape[0] * w.survey_shape[1] * w.survey_shape[2]
        ratios = []
        for step, chunks in zip(w.steps, r["real"].get("chunks") or []):
            key = operator_key(ARCHETYPES[step["op"]], {k: v for k, v in step.items() if k != "op"})
            timed = largest[path].get(key, 0)
            ratios.append(elements / max(1, chunks) / timed if timed else float("inf"))
        if ratios:
            extents.append((max(ratios), abs(float(r["error"]))))
    if not extents:
        return None

    def part(errors: list[float]) -> dict[str, Any]:
        errors = sorted(errors)
        return {"rows": len(errors), "median": statistics.median(errors) if errors else None,
                "p90": errors[int(0.9 * (len(errors) - 1))] if errors else None,
                "worst": errors[-1] if errors else None}

    largest_errors = sorted(extents, key=lambda x: -x[1])[:20]
    return {"ratio": MIN_SIZE_RATIO, "within": part([e for x, e in extents if x <= MIN_SIZE_RATIO]),
            "beyond": part([e for x, e in extents if x > MIN_SIZE_RATIO]),
            "largest_errors": len(largest_errors),
            "largest_errors_beyond": sum(x > MIN_SIZE_RATIO for x, _ in largest_errors)}


def summarize(rows: list[dict[str, Any]], restart: dict[str, Any] | None,
              scale: dict[str, Any] | None, plain: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The error distribution over every row, per strategy kind, and each target's verdict."""
    from memchunk_prefect.core.settings import DEFAULT_SETTINGS
    from memchunk_prefect.sim.inputs import RESTART_SECONDS

    errors = [abs(r["error"]) for r in rows if r["error"] is not None]
    failed = [r for r in rows if r["predicted"] is not None and not r["real"].get("completed")]
    done = [r for r in rows if r["predicted"] is not None and r["real"].get("completed")]
    errors_by_kind: dict[str, list[float]] = {}
    for r in rows:
        if r["error"] is not None:
            kind = "static-N" if r["kind"].startswith("static") else r["kind"]
            errors_by_kind.setdefault(kind, []).append(abs(r["error"]))
    by_kind = {k: {"runs": len(v), "median_abs_error": statistics.median(v), "worst_abs_error": max(v)}
               for k, v in errors_by_kind.items()}
    s: dict[str, Any] = {
        "rows": len(rows), "with_error": len(errors),
        "median_abs_error": statistics.median(errors) if errors else None,
        "worst_abs_error": max(errors) if errors else None,
        "by_kind": by_kind,
        "failed_in_reality": len(failed), "failed_predicted_failed": sum(bool(r["outcome_predicted"]) for r in failed),
        "completed_in_reality": len(done),
        "completed_predicted_completed": sum(bool(r["outcome_predicted"]) for r in done),
        "kills_real": sum(int(r["real"].get("kills") or 0) for r in rows if r["predicted"] is not None),
        "kills_predicted": sum(r["predicted"]["kills_mean"] for r in rows if r["predicted"] is not None),
        "restart_default_seconds": RESTART_SECONDS,
        "restart_measured_seconds": restart["first_task_seconds"] if restart else None,
        "plain_task_default_seconds": DEFAULT_SETTINGS.per_task_overhead_seconds,
        "plain_task_measured_seconds": {name: m.get("task_seconds") for name, m in (plain or {}).items()},
        "thousand_workers_seconds": scale["seconds"] if scale else None,
        "thousand_workers_end_to_end_seconds": scale["end_to_end_seconds"] if scale else None,
        "real_spread": real_spread(rows),
        "p90": p90_coverage(rows),
    }
    s["targets"] = {
        "median_abs_error": _verdict(s["median_abs_error"], TARGETS["median_abs_error"]),
        "worst_abs_error": _verdict(s["worst_abs_error"], TARGETS["worst_abs_error"]),
        "failed_predicted_failed": "not measured" if not failed else (
            "met" if s["failed_predicted_failed"] == len(failed) else "missed"),
        "completed_predicted_completed": "not measured" if not done else (
            "met" if s["completed_predicted_completed"] == len(done) else "missed"),
        "thousand_workers": _verdict(max(filter(None, [s["thousand_workers_seconds"],
                                                       s["thousand_workers_end_to_end_seconds"]]), default=None),
                                     TARGETS["thousand_workers_seconds"]),
    }
    return s


def _verdict(value: float | None, limit: float) -> str:
    return "not measured" if value is None else ("met" if value <= limit else "missed")


def table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:+.0f}%"

    size = _percent

    def chunks(c: Any) -> str:
        return "-" if not c else " ".join(f"{x:g}" for x in c)

    out = ["| workload | run | real makespan | predicted (p50) | error | real outcome | predicted failed | "
           "kills real / predicted | chunks real / predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        real, pred = r["real"], r["predicted"] or {}
        outcome = "completed" if real.get("completed") else f"failed ({str(real.get('failed', ''))[:40]})"
        failed = "-" if not pred else f"{100 * pred['failed_fraction']:.0f}%"
        kills = "-" if not pred else f"{pred['kills_mean']:.2f}"
        out.append(f"| {r['workload']} | {r['kind']} | {_s(real.get('makespan_seconds')).strip()} | "
                   f"{_s(pred.get('makespan_p50')).strip()} | {pct(r['error'])} | {outcome} | {failed} | "
                   f"{real.get('kills', 0)} / {kills} | {chunks(real.get('chunks'))} / {chunks(pred.get('chunks'))} |")
    s, t = summary, summary["targets"]
    kinds = "; ".join(f"{k}: median {size(v['median_abs_error'])}, worst {size(v['worst_abs_error'])} ({v['runs']})"
                      for k, v in s["by_kind"].items())
    out += ["", f"absolute makespan error over {s['with_error']} completed runs: median {size(s['median_abs_error'])} "
                f"({t['median_abs_error']}, target <= 10%), worst {size(s['worst_abs_error'])} "
                f"({t['worst_abs_error']}, target <= 25%); by run: {kinds}",
            f"failures predicted: {s['failed_predicted_failed']} of {s['failed_in_reality']} that failed "
            f"({t['failed_predicted_failed']}, target: each in >= 90% of its simulated runs); completions: "
            f"{s['completed_predicted_completed']} of {s['completed_in_reality']} "
            f"({t['completed_predicted_completed']}, target: each in >= 90%); kills: {s['kills_real']} happened, "
            f"{s['kills_predicted']:.2f} predicted (sum of means)",
            *_missed_failure_lines(rows),
            f"restart of a killed worker: the simulator's default {s['restart_default_seconds']:g} s, measured here "
            f"{_s(s['restart_measured_seconds']).strip()} to a task like the runner's (used in the predictions)",
            f"a plain Prefect task (static, split): the simulator's default {s['plain_task_default_seconds']:g} s of a "
            "slot, measured on each workload's cluster (used in the predictions): "
            + (", ".join(f"{name.split('-')[0]} " + ("-" if v is None else f"{v:.3f} s") for name, v in
                         s.get("plain_task_measured_seconds", {}).items()) or "not measured"),
            *_spread_line(s.get("real_spread")),
            *_p90_line(s.get("p90")),
            *_track_line(s.get("track_record")),
            *_first_call_line(s.get("warm_first_calls")),
            *_extent_line(s.get("error_by_extent")),
            f"1,000 workers: {_s(s['thousand_workers_seconds']).strip()} in process, "
            f"{_s(s['thousand_workers_end_to_end_seconds']).strip()} end to end ({t['thousand_workers']}, "
            "target < 30 s)"]
    return "\n".join(out)


def _percent(x: float | None) -> str:
    """A share as a whole percent, unsigned ("-" for None)."""
    return "-" if x is None else f"{100 * x:.0f}%"


def _missed_failure_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per simulated real run that failed where fewer than 90% of its simulated runs did, saying why its
    cluster failed it: the first line of its kept log (``cluster_log``, :func:`benchmarks.family.__main__.cluster_log`)
    that tells of a death, else the first it kept. A worker that died far below its memory limit is no kill a
    memory model could predict."""
    from benchmarks.family.__main__ import DEATH_LINE

    out = []
    for r in rows:
        if r["predicted"] is None or r["real"].get("completed") or r["outcome_predicted"]:
            continue
        log = r["real"].get("cluster_log")
        death = [ln for ln in log or [] if DEATH_LINE.search(ln)]
        why = ("its log was not kept" if log is None else "its cluster logged no warning or error" if not log
               else "its cluster said: " + (death or log)[0].split("| ", 2)[-1])
        out.append(f"  a failure not predicted: {r['workload']} {r['kind']} failed ({r['real'].get('failed', '')}), "
                   f"{_percent(r['predicted']['failed_fraction'])} of its simulated runs did; {why[:220]}")
    return out


def _spread_line(spread: dict[str, Any] | None) -> list[str]:
    if not spread:
        return []
    return [f"real runs of one plain flow, {spread['runs']} runs of {spread['flows']} flows (--repeats): one from "
            f"another median {_percent(spread['median_apart'])}, worst {_percent(spread['worst_apart'])}; each of "
            f"those flows' prediction against its median run: median {_percent(spread['median_error_to_median'])}, "
            f"worst {_percent(spread['worst_error_to_median'])}"]


def _p90_line(p90: dict[str, Any] | None) -> list[str]:
    if not p90:
        return []
    return [f"a deadline booked at the predicted p90 (median {_percent(p90['p90_above_p50_median'])} above the p50): "
            f"{p90['under_p90']} of {p90['runs']} completed runs ended by it "
            f"({_percent(p90['under_p90'] / p90['runs'])}; a calibrated p90 holds for 90%); the p50's median signed "
            f"error {100 * p90['signed_median_error']:+.0f}%"]


def _track_line(track: dict[str, Any] | None) -> list[str]:
    if not track:
        return []
    warm, cold = _percent(track["median_abs_error_warm"]), _percent(track["median_abs_error_cold"])
    return [f"each workload's store predicting its own flow runs (`memchunk simulate --track-record`: a warm run "
            f"from the store as it stood at its start, a first run cold from the store at its end): "
            f"{track['runs']} runs of {track['stores']} stores, median error {warm} warm and {cold} cold "
            f"({track['cold']} runs); a deadline at the p90 held for {track['under_p90']}, one at the p90 times the "
            f"other runs' booking factor for {track['under_factor_left_out']}; the factor of all of them: "
            f"{track['factor']:.2f}x"]


def _extent_line(extent: dict[str, Any] | None) -> list[str]:
    if not extent:
        return []

    def part(p: dict[str, Any]) -> str:
        if not p["rows"]:
            return "no row"
        return f"median {p['median']:.0%}, p90 {p['p90']:.0%}, worst {p['worst']:.0%} ({p['rows']} rows)"

    return [f"error by the blocks' size against the largest the store had timed after first calls (all runs but the "
            f"cold ones): within {extent['ratio']:g}x {part(extent['within'])}; beyond it {part(extent['beyond'])}; "
            f"{extent['largest_errors_beyond']} of the {extent['largest_errors']} largest errors lay beyond"]


def _first_call_line(calls: dict[str, Any] | None) -> list[str]:
    if not calls:
        return []
    return [f"the warm runs' chunks (each run on a fresh cluster): {calls['first_calls']} of {calls['chunks']} were "
            "their worker's first call of the operator, which teaches the time model's rates nothing; "
            f"{calls['beyond_cold']} read blocks over {calls['ratio']:g}x the largest the cold run timed after its "
            "first calls"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_validation", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", type=int, default=6)
    p.add_argument("--static", type=int, nargs="+", default=[2, 8, 32], help="slab counts of the static runs")
    p.add_argument("--warm", type=int, default=2, help="warm memchunk runs per workload")
    p.add_argument("--repeats", type=int, default=1,
                   help="real runs of each static and split flow (2 or more: how far runs of one flow fall apart)")
    p.add_argument("--runs", type=int, default=20, help="simulated runs per prediction")
    p.add_argument("--quick", action="store_true", help="the smallest workload, static-2, split, cold, one warm (CI)")
    p.add_argument("--only", nargs="*", default=None, help="run only workloads whose name starts with these")
    p.add_argument("--scale", type=int, default=1,
                   help="every survey with this many times its traces (a square: 4 doubles both line axes)")
    p.add_argument("--restart-repeats", type=int, default=3, help="worker kills timed for the restart figure")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one strategy may run")
    p.add_argument("--work", default=None, help="where inputs, stores and outputs go (default: a temporary dir)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--replay", default=None, metavar="RESULT_JSON",
                   help="predict this finished run's real runs again from the stores in --work (no real runs)")
    p.add_argument("--without-rise", action="store_true",
                   help="with --replay: predict as if no run had timed its memory's rise (each task's memory rising "
                        "evenly to its peak half way through), from copies of the stores")
    args = p.parse_args(argv)
    if args.replay:
        return main_replay(args, p)
    workloads = [quick()] if args.quick else family(args.seed, args.workloads)
    if args.only:
        workloads = [w for w in workloads if any(w.name.startswith(o) for o in args.only)]
    if args.scale != 1:
        try:
            workloads = [w.scaled(args.scale) for w in workloads]
        except ValueError as exc:
            p.error(str(exc))
    statics, warm, runs = ([2], 1, 5) if args.quick else (args.static, args.warm, args.runs)
    work = Path(args.work or tempfile.mkdtemp(prefix="memchunk-sim-validation-"))
    work.mkdir(parents=True, exist_ok=True)
    from benchmarks.__main__ import machine_info
    from benchmarks.family.__main__ import _server

    started, machine = time.time(), machine_info()
    restart = measure_restart(repeats=1 if args.quick else args.restart_repeats)
    print(f"restart of a killed worker: rejoined in {restart['rejoin_seconds']:.2f} s, ran a task like the "
          f"runner's in {restart['first_task_seconds']:.2f} s (median of {len(restart['samples'])})", flush=True)
    rows: list[dict[str, Any]] = []
    plain: dict[str, dict[str, Any]] = {}
    scale = None
    with _server(work) as server_env:
        env = {k: v for k, v in server_env.items() if not k.startswith("MEMCHUNK_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["MEMCHUNK_CACHE_DIR"] = str(work / "cache")
        for w in workloads:
            new, plain[w.name] = run_workload(w, work, env, statics, warm, runs, restart["first_task_seconds"],
                                              args.timeout, repeats=args.repeats)
            rows += new
        recorded = next((r for r in reversed(rows) if r["kind"] == "memchunk cold" and r["predicted"]), None)
        if recorded is not None:
            w = next(x for x in workloads if x.name == recorded["workload"])
            scale = thousand_workers(str(work / f"{w.name}.sqlite"), recorded["real"]["flow_run_id"],
                                     w.survey_shape[2], work, env)
    summary = summarize(rows, restart, scale, plain)
    summary["track_record"] = track_records([work / f"{w.name}.sqlite" for w in workloads], runs)
    summary["warm_first_calls"] = warm_first_calls([work / f"{w.name}.sqlite" for w in workloads])
    summary["error_by_extent"] = error_by_extent(rows, workloads, work)
    machine["loadavg_end"] = list(os.getloadavg())
    print()
    print(table(rows, summary))
    if args.json:
        doc = {"benchmark": "sim_validation", "seed": args.seed, "quick": args.quick, "scale": args.scale,
               "started": started,
               "seconds": time.time() - started, "machine": machine, "targets": TARGETS, "summary": summary,
               "restart": restart, "plain_tasks": plain, "thousand_workers": scale, "rows": rows, "runs": runs,
               "repeats": args.repeats, "workloads": [w.to_dict() for w in workloads]}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def _without_rise(work: Path) -> Path:
    """Copies of the stores in ``work`` with no run's memory rise (``rise_50``, ``rise_90``), in a new directory."""
    out = Path(tempfile.mkdtemp(prefix="memchunk-without-rise-"))
    for store in work.glob("*.sqlite"):
        shutil.copy2(store, out / store.name)
        con = sqlite3.connect(out / store.name)
        with con:
            con.execute("UPDATE observations SET rise_50 = NULL, rise_90 = NULL")
        con.close()
    return out


def main_replay(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``--replay``: the rows of a finished run predicted again (see the module docstring)."""
    if not args.work:
        p.error("--replay needs --work: the directory of the run it replays (its stores' copies are there)")
    doc = json.loads(Path(args.replay).read_text())
    from benchmarks.__main__ import machine_info

    started, machine = time.time(), machine_info()
    work = _without_rise(Path(args.work)) if args.without_rise else Path(args.work)
    try:
        rows = replay(doc, work, doc.get("runs", args.runs))
        summary = summarize(rows, doc.get("restart"), doc.get("thousand_workers"), doc.get("plain_tasks"))
        stores = [work / f"{w['name']}.sqlite" for w in doc["workloads"]]
        summary["warm_first_calls"] = warm_first_calls(stores)
        summary["error_by_extent"] = error_by_extent(rows, [Workload.from_dict(d) for d in doc["workloads"]], work)
        summary["track_record"] = track_records(stores, doc.get("runs", args.runs))
    finally:
        if args.without_rise:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows, summary))
    if args.json:
        # A replay of a replay keeps the real runs' own provenance: the commit and time they ran at.
        source = doc.get("replayed_from") or {"path": str(args.replay), "commit": doc["machine"].get("commit"),
                                              "started": doc.get("started")}
        out = {**doc, "replayed_from": source,
               "started": started, "seconds": time.time() - started, "machine": machine, "summary": summary,
               "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
