"""How long a Prefect task run takes to start on a Dask worker: Prefect's own hydration against the settings kept.

    python -m benchmarks.studies.task_start [--tasks 40] [--rounds 2] [--json PATH]

A flow on prefect-dask's DaskTaskRunner submits ``--tasks`` trivial task runs one after another (each waits
for the last), on a fresh local cluster of one single-thread worker, with a local Prefect server. Each task
returns the time its function started; the latency is that less the time of its submit: the flow's submit,
Dask's scheduling, and Prefect's task engine on the worker up to the function's first line. Two modes, on a
fresh cluster each, alternating for ``--rounds`` rounds: ``prefect`` (as installed) and ``kept``, with
``memchunk_prefect.run.hydration`` installed on the worker (as a chunked map's first chunk installs it), whose
counts of settings validated and reused, and of API clients opened and reused, are reported. A plain Dask task's
latency on the same cluster is the floor. Medians of each mode's tasks after the first two (a fresh worker's
first task imports Prefect's engine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

MODES = ("prefect", "kept")


@task(cache_policy=NO_CACHE)
def started_at(i: int) -> float:
    """When this task run's function started (epoch seconds)."""
    return time.time()


def plain_started_at(i: int) -> float:
    return time.time()


def latencies(address: str, n: int) -> list[float]:
    """``n`` task runs through prefect-dask, one after another: each one's submit-to-start seconds."""
    from prefect_dask import DaskTaskRunner

    @flow(name="benchmark-task-start", task_runner=DaskTaskRunner(address=address))
    def one_by_one(n: int) -> list[float]:
        out = []
        for i in range(n):
            t = time.time()
            out.append(started_at.submit(i).result() - t)
        return out

    return one_by_one(n)


def run_mode(mode: str, n: int) -> dict[str, Any]:
    from distributed import Client

    from memchunk_prefect.run import hydration
    from memchunk_prefect.testing import start_local_cluster

    cluster = start_local_cluster(n_workers=1, memory_limit="1GiB")
    client = Client(cluster.scheduler_address, set_as_default=False)
    try:
        if mode == "kept":
            assert all(client.run(hydration.install).values()), "the hydration could not be installed"
        lat = latencies(cluster.scheduler_address, n)
        plain = []
        for i in range(n):
            t = time.time()
            plain.append(client.submit(plain_started_at, i, pure=False).result() - t)
        stats = next(iter(client.run(hydration.stats).values()))
        clients = next(iter(client.run(hydration.client_stats).values())) if hasattr(hydration, "client_stats") \
            else None  # (a checkout from before the worker kept its API client: measured as the "before" side)
    finally:
        client.close()
        cluster.close()
    return {"mode": mode, "seconds": lat, "median": statistics.median(lat[2:]), "plain_median":
            statistics.median(plain[2:]), "worker_hydration": stats, "worker_clients": clients}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.task_start", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=40, help="task runs per mode and round (default 40)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of both modes, alternating (default 2)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if args.tasks < 3 or args.rounds < 1:
        p.error(f"--tasks must be at least 3 (the first two are not counted) and --rounds at least 1, got "
                f"{args.tasks} and {args.rounds}")
    from benchmarks.__main__ import _prefect_api

    runs = []
    with _prefect_api():
        for r in range(args.rounds):
            for mode in MODES:
                res = run_mode(mode, args.tasks)
                res["round"] = r + 1
                runs.append(res)
                h, c = res["worker_hydration"], res["worker_clients"]
                clients = "" if c is None else f"; API clients opened {c['opened']}, reused {c['reused']}"
                print(f"round {r + 1} {mode:<8s} submit to start: median {res['median']:.3f} s (min "
                      f"{min(res['seconds'][2:]):.3f}, max {max(res['seconds'][2:]):.3f}); a plain Dask task "
                      f"{res['plain_median']:.3f} s; settings validated {h['validated']}, reused {h['reused']}, "
                      f"kept at install {h['seeded']} on the worker{clients}", flush=True)
    medians = {mode: statistics.median(x["median"] for x in runs if x["mode"] == mode) for mode in MODES}
    print(f"median over rounds: prefect {medians['prefect']:.3f} s, kept {medians['kept']:.3f} s "
          f"({medians['kept'] - medians['prefect']:+.3f} s per task run)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tasks": args.tasks, "rounds": args.rounds, "runs": runs, "medians": medians}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
