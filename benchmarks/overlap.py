"""Chunked maps that return at once: independent maps side by side, and chains that pipeline chunk by chunk.

    python -m benchmarks.overlap [--repeats 2] [--json PATH]

Each row runs the same flow two ways on the same cluster and store (warmed by one
untimed run of each flow, so no map probes), alternating which goes first:

- *blocking*: every map is waited for (``.wait()``) before the next is submitted, as
  every chunked ``.map`` behaved before it returned at once;
- *overlapped*: every map is submitted first, then all are waited for.

Rows:

- ``independent-half``: two maps over one small survey, each able to fill at most
  half the slots (2 workers x 2 threads; a survey of 2 x 1 traces cuts into 2
  chunks at most). The operator is the ``memory_hog`` test helper holding its
  memory ``--hold`` seconds a chunk (a sleep: no CPU, so 4 slots on 2 cores are
  real slots); the two maps use different memory multiples (two operator keys).
- ``independent-real``: ``envelope`` and ``semblance`` over one survey on 2 workers
  x 1 thread (each map fills every slot).
- ``chain-hold``: three ``memory_hog`` maps chained, with different memory multiples
  (three operator keys), a 2-iline halo on the second and third, on 2 workers x 2
  threads, each holding its memory ``--hold`` seconds per half of the survey, in
  proportion to a chunk's elements (``seconds_per_element``, a sleep), as an
  operator's time grows with its block. Time fixed per chunk would make one chunk a
  map as quick as two, and the runner, once it has learned that, rightly plans one:
  nothing left to pipeline, and the two ways chunked differently.
- ``chain-real``: ``envelope`` -> ``gaussian_smooth`` -> ``gst3d_dip`` over one survey
  on 2 workers x 1 thread.
- ``chain-straggler``: the three maps of ``chain-hold`` (same multiples and halos),
  each doing CPU work instead of a sleep: ``--hold`` seconds per half of the survey,
  in proportion to a chunk's elements (``busy_seconds_per_element``).
  On 2 workers x 1 thread, one of them a straggler: stopped half of every 0.2 s
  (``memchunk_prefect.testing.Throttle``, SIGSTOP / SIGCONT, duty 0.5), so its chunks
  take about twice as long, as on a node starved by a neighbour. A blocking chain
  waits at every map's end for the straggler's last chunk; a pipelined one gives the
  fast worker the next map's ready chunks meanwhile.

Reports per row the median wall of each way, their ratio (overlapped / blocking),
the chunk counts of each map, and whether the overlapped outputs equal the blocking
ones exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _cluster(threads: int):
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        return LocalCluster(n_workers=2, threads_per_worker=threads, processes=True, memory_limit="1.5GiB",
                            dashboard_address="127.0.0.1:0")


def _steps(row: str, hold: float, elements: int) -> list[tuple[Any, dict, Any]]:
    """(task, parameters, halo or None) of each map of a row over a survey of ``elements`` samples; chained rows
    read the map before."""
    from memchunk_prefect import operators
    from memchunk_prefect.testing import memory_hog

    if row == "independent-half":
        return [(memory_hog, {"multiple": 4, "seconds": hold}, None),
                (memory_hog, {"multiple": 6, "seconds": hold}, None)]
    if row == "independent-real":
        return [(operators.envelope, {}, None), (operators.semblance, {}, None)]
    if row in ("chain-hold", "chain-straggler"):
        per_element = 2 * hold / elements  # seconds per sample: a chunk of half the survey takes ``hold`` seconds
        spent = "seconds_per_element" if row == "chain-hold" else "busy_seconds_per_element"
        return [(memory_hog, {"multiple": 4, spent: per_element}, None),
                (memory_hog, {"multiple": 40, spent: per_element}, (2, 0, 0)),
                (memory_hog, {"multiple": 16, spent: per_element}, (2, 0, 0))]
    return [(operators.envelope, {}, None), (operators.gaussian_smooth, {}, None), (operators.gst3d_dip, {}, None)]


def _straggler(row: str, cluster):
    """For ``chain-straggler``: one worker process throttled to half speed for the row's runs; else nothing."""
    import os

    from distributed import Client

    from memchunk_prefect.testing import Throttle

    if row != "chain-straggler":
        return contextlib.nullcontext()
    with Client(cluster.scheduler_address) as c:
        pid = sorted(c.run(os.getpid).values())[0]
    return Throttle(pid, duty=0.5, period_seconds=0.2)


def run_row(row: str, survey: str, work: Path, *, threads: int, hold: float, budget: str | None, repeats: int) -> dict:
    from prefect import flow

    from memchunk_prefect import MemoryAwareRunner, chunked
    from memchunk_prefect.io.zarr_store import open_result

    chained = row.startswith("chain")
    steps = _steps(row, hold, int(np.prod(ROWS[row][0])))
    cluster = _cluster(threads)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(_straggler(row, cluster))
        runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(work / f"{row}.sqlite"),
                                   output_dir=str(work / "out"), memory_budget=budget, progress=False)

        @flow(task_runner=runner, name=f"overlap-{row}")
        def the_flow(overlapped: bool, tag: str) -> dict:
            t = time.perf_counter()
            results, current = [], survey
            for n, (op, params, halo) in enumerate(steps):
                source = current if chained else survey
                res = op.map(chunked(source, halo=halo, output=str(work / f"{row}-{tag}-{n}.zarr")), **params)
                if not overlapped:
                    res.wait()
                results.append(res)
                current = res
            for res in results:
                res.result()
            wall = time.perf_counter() - t
            return {"wall_seconds": wall, "chunks": [len(r.chunks) for r in results],
                    "decisions": [r.summary()["decisions"] for r in results],
                    # per map, each chunk's (worker, compute seconds): where the wall went, beside the wall
                    "chunk_seconds": [[(e["worker"], round(e["seconds"], 3)) for e in r.events if e["event"] == "ok"]
                                      for r in results],
                    "oom_events": sum(r.oom_events for r in results), "outputs": [r.output_path for r in results]}

        the_flow(True, "warm")  # the store learns every operator: no timed map probes
        runs: dict[str, list[dict]] = {"blocking": [], "overlapped": []}
        for i in range(repeats):
            for way in (("blocking", "overlapped") if i % 2 == 0 else ("overlapped", "blocking")):
                r = the_flow(way == "overlapped", f"{way}-{i}")
                runs[way].append(r)
                print(f"  {row} {way}: {r['wall_seconds']:.2f} s, chunks {r['chunks']}, {r['oom_events']} out of "
                      "memory", flush=True)
        equal = all(np.array_equal(open_result(a).values, open_result(b).values, equal_nan=True)
                    for a, b in zip(runs["blocking"][0]["outputs"], runs["overlapped"][0]["outputs"]))
    finally:
        stack.close()
        cluster.close()
    blocking = statistics.median(r["wall_seconds"] for r in runs["blocking"])
    overlapped = statistics.median(r["wall_seconds"] for r in runs["overlapped"])
    return {"row": row, "slots": 2 * threads, "blocking_seconds": blocking, "overlapped_seconds": overlapped,
            "ratio": overlapped / blocking, "outputs_equal": equal, "runs": runs}


ROWS = {  # row: (survey shape, threads per worker, memory budget)
    "independent-half": ((2, 1, 2000), 2, None),
    "independent-real": ((128, 96, 400), 1, None),
    "chain-hold": ((24, 2, 2000), 2, "24MiB"),
    "chain-real": ((128, 96, 400), 1, None),
    "chain-straggler": ((24, 2, 2000), 1, "24MiB"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each way per row (default 2)")
    p.add_argument("--hold", type=float, default=2.0,
                   help="seconds a memory_hog chunk holds its memory (independent-half), or a map's chunks per half "
                        "of the survey (chain-hold, chain-straggler) (default 2)")
    p.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect import synthetic_survey

    work = Path(tempfile.mkdtemp(prefix="memchunk-overlap-"))
    results = []
    with _prefect_api():
        for row in args.rows:
            shape, threads, budget = ROWS[row]
            survey = str(synthetic_survey(work / f"{row}.sgy", shape, seed=11))
            r = run_row(row, survey, work, threads=threads, hold=args.hold, budget=budget, repeats=args.repeats)
            results.append(r)
            print(f"{row} on {r['slots']} slots: blocking {r['blocking_seconds']:.2f} s, overlapped "
                  f"{r['overlapped_seconds']:.2f} s, ratio {r['ratio']:.2f}; outputs equal: {r['outputs_equal']}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hold": args.hold, "repeats": args.repeats, "rows": results}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
