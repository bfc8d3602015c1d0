"""What a worker process pays the first time an operator's working memory grows: seconds and kernel time per call.

    python -m benchmarks.studies.first_touch [--calls 3] [--processes 2] [--json PATH]

trace_correlation on one 86 x 97 x 100 float32 block (its Gram matrix: ~545 MiB of float64), called
``--calls`` times in each of ``--processes`` fresh Python processes, as a fresh Dask worker runs it
(one thread, ``MALLOC_TRIM_THRESHOLD_`` as Dask's nanny sets it, BLAS on one thread). Per call: wall
seconds, user and system CPU seconds (``getrusage``) and minor page faults.

Why it matters: the time model learns seconds per chunk from real runs. In the heterogeneous benchmark
the same 834,200-element block took 1.63-1.75 s on one pair of runs and 0.40-0.45 s on the next, with
the same peak memory: a run that grows the process's memory beyond what it held before pays the
kernel's page faults and zeroing, once per process, not per element. A time model fitted through those
runs cannot see how the operator's compute grows with its block. The extra cost is kernel time: wall
seconds less system CPU seconds (the last column) is the same on the first call as on later ones, which
is what the time model learns from a run that grew its worker (``OperatorModel.compute_seconds``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from benchmarks.studies.children import run_child

BLOCK = (86, 97, 100)


def child(calls: int) -> list[dict]:
    import numpy as np

    from memchunk_prefect.operators import trace_correlation

    block = np.random.default_rng(0).standard_normal(BLOCK).astype(np.float32)
    out = []
    for _ in range(calls):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        trace_correlation.fn(block)
        wall = time.perf_counter() - t
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        out.append({"wall_seconds": round(wall, 3), "user_seconds": round(r1.ru_utime - r0.ru_utime, 3),
                    "system_seconds": round(r1.ru_stime - r0.ru_stime, 3),
                    "minor_faults": r1.ru_minflt - r0.ru_minflt})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.first_touch", description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.calls < 2 or args.processes < 1:
        p.error(f"--calls must be at least 2 (a first call and a later one) and --processes at least 1, "
                f"got {args.calls} and {args.processes}")
    if args.child:
        print(json.dumps(child(args.calls)))
        return 0
    runs = [run_child("benchmarks.studies.first_touch", ["--child", "--calls", str(args.calls)])
            for _ in range(args.processes)]
    print(f"trace_correlation on one {' x '.join(map(str, BLOCK))} float32 block, {args.calls} calls in each of "
          f"{args.processes} fresh processes")
    print(f"{'process':>7s} {'call':>4s} {'wall s':>7s} {'user s':>7s} {'system s':>8s} {'minor faults':>12s} "
          f"{'wall-system s':>13s}")
    for i, calls in enumerate(runs, 1):
        for j, c in enumerate(calls, 1):
            print(f"{i:>7d} {j:>4d} {c['wall_seconds']:>7.2f} {c['user_seconds']:>7.2f} {c['system_seconds']:>8.2f} "
                  f"{c['minor_faults']:>12d} {c['wall_seconds'] - c['system_seconds']:>13.2f}")
    first = [calls[0]["wall_seconds"] for calls in runs]
    later = [c["wall_seconds"] for calls in runs for c in calls[1:]]
    print(f"first call {min(first):.2f}-{max(first):.2f} s, later calls {min(later):.2f}-{max(later):.2f} s: "
          f"the first costs {sum(first) / len(first) / (sum(later) / len(later)):.1f}x a later one")
    first_less = [calls[0]["wall_seconds"] - calls[0]["system_seconds"] for calls in runs]
    later_less = [c["wall_seconds"] - c["system_seconds"] for calls in runs for c in calls[1:]]
    print(f"less system time: first call {min(first_less):.2f}-{max(first_less):.2f} s, later calls "
          f"{min(later_less):.2f}-{max(later_less):.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
