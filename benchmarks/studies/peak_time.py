"""When in its run each workload-family operator reaches its memory peak: the fraction of the run, per call.

    python -m benchmarks.studies.peak_time [--repeats 2] [--json PATH]

Each operator of the workload family (``benchmarks.family.archetypes``) is called once on a block, in a fresh
process set up as a Dask worker's (``benchmarks.studies.children``), after one small call that imports what it
uses. A thread reads the process's resident set (``/proc/self/statm``) every millisecond while the call runs.
Per call: wall seconds, the peak above the resting level (MiB), and the fraction of the run at which memory above
resting first reached 50% and 90% of that peak.

Why it matters: the simulator (``memchunk_prefect.sim.cluster``) kills a worker when a task's memory crosses the
kill line on its rise, and the moment of a kill, so what a failed attempt costs, follows the operator: a Gram
matrix filled by BLAS reaches its peak near the end of its run, an autocorrelation that holds one 64-trace product
at a time reaches it at the start. The runner times every run's rise too (``Observation.rise_50``,
``rise_90``: :mod:`memchunk_prefect.run.rise`) and the simulator follows each operator's learned one; this study
times the operator's call alone, without the chunk's read and write around it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

from benchmarks.studies.children import run_child

#: (operator, block): float32 blocks whose peaks above resting are 40-280 MiB here (the study prints each).
CALLS = (("fam_autocorr", (40, 40, 400)), ("fam_table", (120, 80, 400)), ("fam_linear", (120, 80, 400)),
         ("fam_first_use", (120, 80, 400)), ("fam_gram", (100, 60, 400)))
INTERVAL_SECONDS = 0.001


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def child(name: str, shape: tuple[int, ...]) -> dict:
    """One timed call of ``name`` on a ``shape`` block in this process, its memory sampled on a thread."""
    import numpy as np

    from benchmarks.family.archetypes import ARCHETYPES

    fn = ARCHETYPES[name].fn
    block = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    fn(block[:2, :2])  # imports and a first-use library: not this call's memory
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), _rss_bytes()))
            time.sleep(INTERVAL_SECONDS)

    resting = _rss_bytes()
    thread = threading.Thread(target=sample)
    start = time.perf_counter()
    thread.start()
    fn(block)
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    peak = max(r for _, r in samples) - resting

    def first_at(share: float) -> float:
        return next((t - start) / seconds for t, r in samples if r - resting >= share * peak)

    return {"operator": name, "block": list(shape), "seconds": round(seconds, 3), "peak_mib": round(peak / 2**20, 1),
            "at_50": round(first_at(0.5), 3), "at_90": round(first_at(0.9), 3), "samples": len(samples)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.peak_time", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per operator (default 2)")
    p.add_argument("--operators", nargs="+", choices=[n for n, _ in CALLS], default=[n for n, _ in CALLS])
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", nargs=2, metavar=("OPERATOR", "BLOCK"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.child:
        name, block = args.child
        print(json.dumps(child(name, tuple(int(v) for v in block.split("x")))))
        return 0
    rows = [run_child("benchmarks.studies.peak_time", ["--child", name, "x".join(map(str, shape))])
            for name, shape in CALLS if name in args.operators for _ in range(args.repeats)]
    print(f"{'operator':<14s} {'block':<12s} {'seconds':>7s} {'peak MiB':>8s} {'50% at':>6s} {'90% at':>6s}")
    for r in rows:
        print(f"{r['operator']:<14s} {'x'.join(map(str, r['block'])):<12s} {r['seconds']:>7.3f} {r['peak_mib']:>8.1f} "
              f"{r['at_50']:>6.2f} {r['at_90']:>6.2f}")
    for name in dict.fromkeys(r["operator"] for r in rows):
        at = [r["at_90"] for r in rows if r["operator"] == name]
        print(f"{name}: 90% of its peak at {statistics.median(at):.2f} of its run (median of {len(at)}); "
              "where no rise is learned, the simulator takes 0.45")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
