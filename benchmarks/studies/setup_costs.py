"""What a benchmark pays before its flows run: a Prefect server's start, and a new cluster per strategy.

    python -m benchmarks.studies.setup_costs [--fresh N] [--json PATH]

Starts one local Prefect server (``prefect_test_harness``, as every benchmark
does without ``PREFECT_API_URL``) and times it; then the quick benchmark's
cluster (2 single-thread workers x 640 MiB) and ``N`` new clusters through
``Bench.fresh`` (default 3), each split into its phases: closing the old
cluster, starting the new one, the workers' imports (``warm_worker``) and the
fixed 1 s wait for heartbeats. These figures explain where the benchmark smoke
tests' time goes (BENCHMARKS.md, "`--quick` (CI smoke test)").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.setup_costs", description=__doc__.splitlines()[0])
    p.add_argument("--fresh", type=int, default=3, metavar="N", help="new clusters to time (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    args = p.parse_args(argv)
    if args.fresh < 1:
        p.error(f"--fresh must be at least 1, got {args.fresh}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tasks` beside the package (warm_worker)
    from prefect.testing.utilities import prefect_test_harness

    from benchmarks import strategies as st
    from benchmarks.__main__ import QUICK

    work = Path(tempfile.mkdtemp(prefix="memchunk-setup-"))
    try:
        t = time.perf_counter()
        with prefect_test_harness(server_startup_timeout=120):
            server = time.perf_counter() - t
            print(f"Prefect server start: {server:.1f} s", flush=True)
            t = time.perf_counter()
            bench = st.Bench(QUICK.n_workers, QUICK.memory_limit, work)
            first = time.perf_counter() - t
            print(f"first cluster ({QUICK.n_workers} workers x {QUICK.memory_limit}): {first:.1f} s", flush=True)
            fresh = []
            try:
                for k in range(args.fresh):
                    t = time.perf_counter()
                    bench.fresh()
                    phases = {name: round(v, 3) for name, v in bench.fresh_seconds.items()}
                    fresh.append({"seconds": round(time.perf_counter() - t, 3), **phases})
                    print(f"new cluster {k + 1}: {fresh[-1]['seconds']:.1f} s ("
                          + ", ".join(f"{name} {v:.1f} s" for name, v in phases.items()) + ")", flush=True)
            finally:
                bench.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"median new cluster: {statistics.median(f['seconds'] for f in fresh):.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"server_start_seconds": round(server, 3), "first_cluster_seconds": round(first, 3),
                       "fresh": fresh, "loadavg": list(os.getloadavg())}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
