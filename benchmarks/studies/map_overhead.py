"""Where a chunked map's own time goes in the flow process: a profile of the overhead pair's map.

    python -m benchmarks.studies.map_overhead [--runs 5] [--chunks 8] [--top 25] [--json PATH]

The overhead row of ``python -m benchmarks`` compares MemoryAwareRunner with a plain
DaskTaskRunner on identical chunks (envelope over the survey cut into ``--chunks``
iline slabs; the runner keeps them: ``continue``); the gap is the runner's per-map
work. This runs that map ``--runs`` times on a warm store and a local cluster of 2
single-thread workers (1 GiB) with a local Prefect server, under ``cProfile`` in the
flow's thread and in the map's own thread (a chunked ``.map`` runs in one), and prints
the functions where those threads spent their time (cumulative seconds per map, both
threads added), the runner's own first: what to make cheaper.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

#: The runner's steps of one map (ChunkedMap and what it calls), reported whatever their rank.
STEPS = ("executor.py:*(_run)", "runner.py:*(budget)", "cluster.py:*(read_marks)", "runner.py:*(record_machines)",
         "identity.py:*(open_output)", "executor.py:*(submit)", "executor.py:*(next_event)",
         "executor.py:*(record)", "executor.py:*(finalize)", "executor.py:*(record_map)",
         "executor.py:*(compact_store)", "task_runners.py:*(submit)", "context.py:*(serialize_context)",
         "tokenize.py:*(tokenize)", "observe.py:*(emit)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.map_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="profiled maps (default 5)")
    p.add_argument("--chunks", type=int, default=8, help="iline slabs (default 8)")
    p.add_argument("--shape", type=int, nargs=3, default=[128, 128, 400], metavar=("IL", "XL", "T"))
    p.add_argument("--top", type=int, default=25, help="functions listed by cumulative time (default 25)")
    p.add_argument("--json", metavar="PATH", help="write the per-map seconds of each step as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.__main__ import _prefect_api
    from benchmarks.strategies import convert_to_zarr, iline_slabs, overhead_memchunk_flow
    from memchunk_prefect import MemoryAwareRunner, synthetic_survey
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.run import executor
    from memchunk_prefect.testing import start_local_cluster

    work = Path(tempfile.mkdtemp(prefix="memchunk-map-overhead-"))
    survey = str(synthetic_survey(work / "survey.sgy", tuple(args.shape), seed=1))
    src = convert_to_zarr(survey, str(work / "input.zarr"))
    shape = list(as_source(src).shape)
    chunks = iline_slabs(shape, args.chunks)
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    result: dict = {"runs": args.runs, "chunks": args.chunks, "shape": shape}
    try:
        with _prefect_api():
            runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(work / "store.sqlite"),
                                       output_dir=str(work / "runs"), progress=False,
                                       policy={"continue_tolerance": 1e9, "replan_threshold": 1e9})
            flow_ = overhead_memchunk_flow.with_options(task_runner=runner)
            out = str(work / "out.zarr")
            for _ in range(2):  # warm-up: the probe on a fresh store, then a warm map
                shutil.rmtree(out, ignore_errors=True)
                flow_(src, shape, chunks, out)
            prof = cProfile.Profile()
            # A chunked map runs in a thread of its own (its .map returns at once): profiled there by a second
            # profiler (a profiler is per thread), added to the flow thread's below.
            map_prof = cProfile.Profile()
            run_map = executor.ChunkedMap.run

            def profiled_run(self: Any) -> None:
                map_prof.enable()
                try:
                    run_map(self)
                finally:
                    map_prof.disable()

            walls = []
            for _ in range(args.runs):
                shutil.rmtree(out, ignore_errors=True)
                executor.ChunkedMap.run = profiled_run  # type: ignore[method-assign]
                prof.enable()
                try:
                    info = flow_(src, shape, chunks, out)
                finally:
                    prof.disable()
                    executor.ChunkedMap.run = run_map  # type: ignore[method-assign]
                walls.append(info["seconds"])
                if info["decisions"] != ["continue"]:
                    print(f"  note: decided {info['decisions']}, not continue", flush=True)
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    stats = pstats.Stats(prof)
    stats.add(map_prof)
    n = args.runs
    print(f"map wall (inside the flow): {', '.join(f'{w:.2f}' for w in walls)} s over {args.chunks} chunks")
    steps = {}
    raw = stats.stats  # type: ignore[attr-defined]  # (file, line, name) -> (cc, nc, tt, ct, callers)
    for (fname, _, func), (_, ncalls, _, ct, _) in raw.items():
        short = f"{Path(fname).name}:*({func})"
        if short in STEPS:
            steps[short] = {"seconds_per_map": ct / n, "calls_per_map": ncalls / n}
    print("\nthe runner's steps (cumulative seconds per map, calls per map):")
    for name in STEPS:
        if name in steps:
            print(f"  {name:40s} {steps[name]['seconds_per_map']:7.3f} s  {steps[name]['calls_per_map']:6.1f}")
    print(f"\ntop {args.top} by cumulative time (per {n} maps):")
    stats.sort_stats("cumulative").print_stats(args.top)
    result.update(walls=walls, steps=steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
