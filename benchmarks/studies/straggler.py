"""A worker slow rather than dead: what it costs a map, and when the runner names it.

    python -m benchmarks.studies.straggler [--shape 480 50 500] [--duty 0.1] [--busy 0.2] [--budget 24MiB] [--json PATH]

A local cluster of 2 single-thread worker processes (1 GiB each) and a local
Prefect server. The operator is the ``memory_hog`` test helper spending ``--busy``
seconds of CPU a chunk (its memory law seeded in the store, so the first plan is
final). Run twice on fresh clusters: with both workers as they are, then with one
stopped most of the time (SIGSTOP / SIGCONT at ``--duty``: 0.1 runs it a tenth of
the time, about 10x slower at everything, as a throttled or starved node) from the
map's start to its end. Reports per run: the map's wall, chunks in all and on the
slow worker, its median seconds a chunk against the other's, when the runner named
it (seconds after the map's first chunk started), and the tail (the last chunk's
end less the end of the other worker's last chunk: how long the map waited on the
slow one at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def one_run(survey: str, store: str, out: Path, *, duty: float | None, busy: float, budget: str) -> dict:
    from distributed import Client
    from prefect import flow

    from memchunk_prefect import MemoryAwareRunner, chunked
    from memchunk_prefect.testing import Throttle, memory_hog, start_local_cluster

    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        with Client(cluster.scheduler_address) as c:
            slow_address, slow_pid = sorted(c.run(os.getpid).items())[0]
        runner = MemoryAwareRunner(address=cluster.scheduler_address, memory_budget=budget, store=store,
                                   progress=False)

        @flow(task_runner=runner)
        def busy_map():
            res = memory_hog.map(chunked(survey, output=out), multiple=40, busy_seconds=busy)
            return res.summary(), res.observations

        t0 = time.perf_counter()
        with Throttle(slow_pid, duty=duty) if duty is not None else contextlib.nullcontext():
            summary, observations = busy_map()
        wall = time.perf_counter() - t0
    finally:
        cluster.close()
    ok = [o for o in observations if o.outcome == "ok" and o.started_at is not None]
    first = min((o.started_at for o in ok), default=0.0)
    ends = [o.started_at + o.seconds for o in ok]
    slow = [o for o in ok if o.worker == slow_address]
    fast = [o for o in ok if o.worker != slow_address]
    found = summary["slow_workers"][0]["found_at"] if summary["slow_workers"] else None
    last_fast = max((o.started_at + o.seconds for o in fast), default=0.0)
    return {
        "throttled": duty is not None, "wall_seconds": wall, "chunks": summary["chunks"],
        "on_slow_worker": len(slow), "named_after_seconds": found - first if found is not None else None,
        "slow_median_seconds": statistics.median([o.seconds for o in slow]) if slow else None,
        "fast_median_seconds": statistics.median([o.seconds for o in fast]) if fast else None,
        "tail_seconds": max(0.0, max(ends, default=0.0) - last_fast),
        "slow_workers": summary["slow_workers"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.straggler", description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=int, nargs=3, default=[480, 50, 500], metavar=("IL", "XL", "T"))
    p.add_argument("--duty", type=float, default=0.1, help="share of the time the slow worker runs (default 0.1)")
    p.add_argument("--busy", type=float, default=0.2, help="CPU seconds per chunk (default 0.2)")
    p.add_argument("--budget", default="24MiB", help="memory budget per task (default 24MiB)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect import synthetic_survey
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.operators import operator_key
    from memchunk_prefect.testing import memory_hog, seed_store

    work = Path(tempfile.mkdtemp(prefix="memchunk-straggler-"))
    survey = str(synthetic_survey(work / "survey.sgy", tuple(args.shape), seed=5))
    results: list[dict[str, Any]] = []
    with _prefect_api():
        for duty in (None, args.duty):
            store = str(work / f"store-{duty}.sqlite")
            with Store(store) as s:
                seed_store(s, operator_key(memory_hog, {"multiple": 40}), 168)
            r = one_run(survey, store, work / f"out-{duty}.zarr", duty=duty, busy=args.busy, budget=args.budget)
            results.append(r)
            named = r["named_after_seconds"]
            print(f"{'one worker throttled' if duty else 'no slow worker'}: {r['wall_seconds']:.1f} s, "
                  f"{r['chunks']} chunks, {r['on_slow_worker']} on the first worker (median "
                  f"{r['slow_median_seconds'] or 0:.2f} s a chunk there against {r['fast_median_seconds'] or 0:.2f} "
                  f"s), named slow {'after %.1f s' % named if named is not None else 'never'}, tail "
                  f"{r['tail_seconds']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "duty": args.duty, "busy": args.busy, "budget": args.budget,
                       "runs": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
