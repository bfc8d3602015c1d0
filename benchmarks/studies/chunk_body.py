"""What the runner's worker side costs one chunk: ``worker.run_block`` against the static baseline's task body.

    python -m benchmarks.studies.chunk_body [--pairs 5] [--operator gst3d_dip] [--chunks 2] [--shape IL XL T] \
        [--json PATH]

The full run's memchunk-warm row plans the same chunks as static-2 (2 iline slabs per operator) and still ran
4-12% slower than it in rounds side by side. This separates the worker's share of that gap from the flow's:
one chunk (the first of ``--chunks`` iline slabs of a ``--shape`` synthetic survey, read from zarr with the
operator's halo) is run by the static baseline's body (``benchmarks.strategies.slab_task``: read, compute, trim,
write a contiguous copy) and by the runner's (``memchunk_prefect.run.worker.run_block``: the same, measured by the
monitor, the view written, the completion marker with its observation), each in a fresh worker-like process
(``benchmarks.studies.children``: first touches paid, as on the benchmark's fresh workers), the two alternating
``--pairs`` times. Both children import everything they use before the clock starts (a worker has imported
Prefect and the operator modules before its first task). Per run: wall and CPU seconds of the body, and the
operator's own call; the medians of each side, and the medians of the pairs' differences. Each child reads back
the region it wrote (its sum and unwritten NaN count, in the JSON): both sides do the same work.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.studies.children import run_child

SIDES = ("static", "memchunk")


def child(side: str, source_path: str, output_path: str, operator: str, chunks: int) -> dict:
    """One chunk by one side's body, in this fresh process; its seconds."""
    import numpy as np
    import prefect  # noqa: F401 - a worker has Prefect loaded before its first task (run_block asks its context)

    from memchunk_prefect import operators
    from memchunk_prefect.core.chunks import balanced_grid
    from memchunk_prefect.io.volume import as_source, read_block
    from memchunk_prefect.io.zarr_store import ZarrOutput
    from memchunk_prefect.operators import spec_of
    from memchunk_prefect.run.worker import BlockJob, run_block

    source = as_source(source_path)
    op = operators.OPERATORS[operator]
    halo = spec_of(op).halo_for({})
    chunk = balanced_grid(tuple(source.shape), (chunks, 1, 1))[0]
    call: dict[str, float] = {}

    @functools.wraps(op.fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        out = op.fn(*args, **kwargs)
        call["seconds"] = time.perf_counter() - t
        return out

    t, cpu = time.perf_counter(), time.process_time()
    if side == "static":  # benchmarks.strategies.slab_task's body
        block, trim = read_block(source, chunk, halo)
        out = timed(block)
        del block
        ZarrOutput.open(output_path).write(chunk, np.ascontiguousarray(np.asarray(out)[trim], dtype=np.float32))
    else:
        job = BlockJob(source=source, chunk=chunk, halo=tuple(halo), volume_shape=tuple(source.shape),
                       output_path=output_path, operator=operator, operator_key=f"{operator}|float32|cpu",
                       budget_bytes=2**40, label=chunk.key())
        run_block(timed, job, inspect.signature(timed).bind(job))
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    written = ZarrOutput.open(output_path).read_locked(chunk)  # what the side wrote: the two must agree
    return {"wall_seconds": wall, "cpu_seconds": cpu, "operator_seconds": call["seconds"],
            "max_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
            "written_sum": float(np.nansum(written, dtype=np.float64)), "written_nan": int(np.isnan(written).sum())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.chunk_body", description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="runs of each side, alternating (default 5)")
    p.add_argument("--operator", default="gst3d_dip", help="an operator of operators.OPERATORS (default gst3d_dip)")
    p.add_argument("--chunks", type=int, default=2, help="iline slabs; the first is run (default 2, static-2's)")
    p.add_argument("--shape", type=int, nargs=3, default=[128, 128, 400], metavar=("IL", "XL", "T"))
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", nargs=3, metavar=("SIDE", "SOURCE", "OUTPUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.child[2], args.operator, args.chunks)))
        return 0
    if args.pairs < 1 or args.chunks < 1:
        p.error(f"--pairs and --chunks must be at least 1, got {args.pairs} and {args.chunks}")
    from memchunk_prefect import operators

    if args.operator not in operators.OPERATORS:
        p.error(f"--operator {args.operator!r} is not one of {sorted(operators.OPERATORS)}")
    from benchmarks.strategies import convert_to_zarr
    from memchunk_prefect import synthetic_survey
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.io.zarr_store import ZarrOutput

    work = Path(tempfile.mkdtemp(prefix="memchunk-chunk-body-"))
    runs: dict[str, list[dict]] = {side: [] for side in SIDES}
    try:
        survey = str(synthetic_survey(work / "survey.sgy", tuple(args.shape), seed=1))
        src = convert_to_zarr(survey, str(work / "input.zarr"))
        shape = as_source(src).shape
        print(f"{args.operator}: the first of {args.chunks} iline slabs of a {' x '.join(map(str, shape))} survey "
              f"(zarr input), each side in a fresh worker-like process, {args.pairs} pairs")
        print(f"{'pair':>4s} {'side':<9s} {'wall s':>7s} {'cpu s':>7s} {'operator s':>10s} {'max RSS MiB':>11s}")
        for i in range(args.pairs):
            for side in SIDES:
                out = str(work / f"out-{side}.zarr")
                ZarrOutput.create(out, shape, as_source(src).coords(), attrs={}, overwrite=True)
                r = run_child("benchmarks.studies.chunk_body", ["--child", side, src, out, "--operator", args.operator,
                                                        "--chunks", str(args.chunks)])
                runs[side].append(r)
                print(f"{i + 1:>4d} {side:<9s} {r['wall_seconds']:>7.2f} {r['cpu_seconds']:>7.2f} "
                      f"{r['operator_seconds']:>10.2f} {r['max_rss_kib'] / 1024:>11.1f}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {}
    for key in ("wall_seconds", "cpu_seconds", "operator_seconds"):
        med = {side: statistics.median(r[key] for r in runs[side]) for side in SIDES}
        diff = statistics.median(m[key] - s[key] for s, m in zip(runs["static"], runs["memchunk"]))
        summary[key] = {**med, "median_difference": diff}
        print(f"{key.replace('_', ' ')}: static {med['static']:.3f}, memchunk {med['memchunk']:.3f}, "
              f"median of the pairs' differences {diff:+.3f} ({diff / med['static']:+.1%})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"operator": args.operator, "shape": list(args.shape), "chunks": args.chunks, "runs": runs,
                       "summary": summary}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
