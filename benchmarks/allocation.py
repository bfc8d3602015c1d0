"""The allocation model against the simulator: P(U(T0) >= U0) by formula and by simulated runs, same inputs.

    python -m benchmarks.allocation [--store PATH] [--quick] [--runs 40] [--json PATH]

An HPC allocation of 32 jobs (one 8 GiB, 1-thread worker each; queue waits
exponential, mean 5 min; a 1 h walltime) runs the demo pipeline on a
3,000 x 3,000 x 1,500 survey (``--quick``: 16 jobs, 1,500 x 1,500 x 1,500),
``--runs`` times in the simulator (the runner's own state machine, models from
``--store`` or two ``memchunk demo`` runs made here). For windows T0 from 15 to
40 min, and U0 at the 20th, 50th and 80th percentiles of the simulated runs'
U(T0) (so the simulated probability is about 0.8, 0.5 and 0.2 by
construction), the model's P(U(T0) >= U0) (:mod:`memchunk_prefect.sim.allocation`:
the same queue-wait distribution, the per-job utilisation the simulated runs
measured, jobs independent) is set beside the simulated one. Where they part,
the independence assumption is what fails: a job that starts late finds less
work left (windows the work outlasts agree; windows past the end of the work
do not).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

GiB = 2**30
MiB = 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.allocation", description=__doc__.split("\n\n")[0])
    p.add_argument("--store", help="a store of real runs of the demo pipeline (default: two demo runs made here)")
    p.add_argument("--quick", action="store_true", help="a smaller survey and fewer runs (the CI smoke test)")
    p.add_argument("--runs", type=int, help="simulated runs (default 40; --quick 8)")
    p.add_argument("--json", help="also write every figure here")
    args = p.parse_args(argv)

    from benchmarks.sim_scale import demo_store
    from memchunk_prefect.operators.registry import DEFAULT_STEPS
    from memchunk_prefect.sim.allocation import QueueWait
    from memchunk_prefect.sim.inputs import ClusterShape, Step, store_models
    from memchunk_prefect.sim.runs import run_strategy
    from memchunk_prefect.sim.simulate import allocation_check, window_utilisation

    tmp = tempfile.TemporaryDirectory(prefix="memchunk-allocation-")
    store = Path(args.store) if args.store else demo_store(Path(tmp.name))
    models = store_models(str(store))
    steps = [Step.of(s) for s in DEFAULT_STEPS]
    runs = args.runs or (8 if args.quick else 40)
    workers, shape = (16, (1500, 1500, 1500)) if args.quick else (32, (3000, 3000, 1500))
    wait = QueueWait.parse("exp:5min")
    cluster = ClusterShape(workers=workers, memory_limit_bytes=8 * GiB, resting_bytes=250 * MiB, queue_wait=wait,
                           walltime_seconds=3600.0)
    t0 = time.perf_counter()
    results = [run_strategy("memchunk", steps, shape, cluster, models.knowledge, np.random.default_rng(i),
                            truth_for=models.truth) for i in range(runs)]
    sim_seconds = time.perf_counter() - t0
    spans = [r.makespan_seconds for r in results]
    print(f"{workers} jobs x 8 GiB, {wait.describe()}, 1 h walltime; demo pipeline on {' x '.join(map(str, shape))}; "
          f"{runs} simulated runs in {sim_seconds:.0f} s: {sum(r.completed for r in results)} completed, makespan "
          f"p50 {np.median(spans):.0f} s (p10 {np.percentile(spans, 10):.0f}, p90 {np.percentile(spans, 90):.0f})")
    print(f"{'T0 s':>6} {'U0':>6} {'P sim':>6} {'P model':>8} {'P normal':>8} {'U mean sim':>10} "
          f"{'U mean model':>12} {'job u p50':>9}")
    rows = []
    windows = (900.0, 1800.0) if args.quick else (900.0, 1200.0, 1500.0, 1800.0, 2400.0)
    for window in windows:
        u_runs = [window_utilisation(r, cluster, window)[0] for r in results]
        for q in (20, 50, 80):
            target = float(np.percentile(u_runs, q))
            if target <= 0:
                continue
            c = allocation_check(results, cluster, window=window, target=target)
            rows.append({"window_s": window, "target": target, "p_simulated": c.p_simulated,
                         "p_model": c.model.p_exact, "p_normal": c.model.p_normal, "u_mean_simulated":
                         float(np.mean(u_runs)), "u_mean_model": c.model.mean,
                         "job_utilisation_p50": c.job_utilisation_p50})
            print(f"{window:>6.0f} {target:>6.3f} {c.p_simulated:>6.2f} {c.model.p_exact:>8.2f} "
                  f"{c.model.p_normal:>8.2f} {np.mean(u_runs):>10.3f} {c.model.mean:>12.3f} "
                  f"{c.job_utilisation_p50:>9.2f}")
    gaps = [abs(r["p_model"] - r["p_simulated"]) for r in rows]
    print(f"model - simulated: mean |gap| {np.mean(gaps):.2f}, largest {max(gaps):.2f} over {len(rows)} rows")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "runs": runs, "workers": workers, "shape": list(shape),
                                               "queue_wait": wait.describe(), "simulation_seconds": sim_seconds,
                                               "makespans": spans, "store": str(store)}, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
