"""Peak memory of one chunk's whole task (read with its halo, the operator, trim, write) against the operator alone.

    python -m benchmarks.studies.task_memory --operator gaussian_smooth --params '{"sigma": [6, 6, 6]}' \\
        --survey 192 192 100 --chunk 1 133 96 192 --chunk 96 192 0 192 [--repeat 3] [--json PATH]

A chunk's measured peak, what the model learns from, covers its whole task on
the worker (:func:`memchunk_prefect.run.worker.run_block`): the block read with its
halo from the source, the operator, the halo trimmed off, the region written.
``python -m benchmarks.studies.operator_memory`` measures the operator alone. This
measures both on the same block, so what the task adds around the operator can
be seen per chunk: the source a zarr store of the synthetic survey's values (as
an upstream operator's output is), the output a fresh ``ZarrOutput`` of the
survey's shape, both in default storage chunks.

Each ``--chunk I0 I1 X0 X1`` (whole traces, survey indices; the survey's edges
clip the halo, as in a flow) is measured ``--repeat`` times, each in a fresh
process set up as a Dask worker's (:mod:`benchmarks.studies.children`): the operator's
first call and one whole task on a small chunk first (lazy imports, zarr's and
the codecs' first use), freed heap returned to the OS, then one ``run_block``
measured as the runner measures it (``peak_bytes``: the peak RSS during the task
above the RSS before it), then the operator alone on the same block
(:func:`memchunk_prefect.run.monitor.measure`, the input block excluded).

Columns: the block read (halo included) and its MiB, the region written and its
MiB, the task's peak, the operator's peak, and what the task adds (their
difference) as a multiple of the block.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from typing import Any, Sequence

from benchmarks.studies.children import run_child

MIB = 2**20


def child(operator: str, params: dict, survey: Sequence[int], chunk: Sequence[int]) -> dict:
    """One measured task (and the operator alone on its block) in this fresh process."""
    shape = tuple(int(n) for n in survey)
    with tempfile.TemporaryDirectory(prefix="memchunk-task-memory-") as work:  # the stores go with the process
        return _measure(work, operator, params, shape, chunk)


def _measure(work: str, operator: str, params: dict, shape: tuple[int, ...], chunk: Sequence[int]) -> dict:
    """:func:`child`'s work, its stores under ``work``: the source survey, a warm-up task, the measured task,
    then the operator alone on the measured block."""
    import inspect

    from benchmarks.studies.operator_memory import _release_free_heap
    from memchunk_prefect import operators
    from memchunk_prefect.core.chunks import Chunk, with_halo
    from memchunk_prefect.io import zarr_store as volume
    from memchunk_prefect.io.synthetic import synthetic_volume
    from memchunk_prefect.operators import operator_key, spec_of
    from memchunk_prefect.run.monitor import measure
    from memchunk_prefect.run.worker import BlockJob, run_block

    task = operators.OPERATORS[operator]
    fn = task.fn
    halo = spec_of(task).halo_for(params)
    src_out = volume.ZarrOutput.create(os.path.join(work, "source.zarr"), shape)
    values = synthetic_volume(shape, seed=0)
    src_out.write(Chunk((0, 0, 0), shape), values)
    src_out.finalize()  # a complete store: read through ZarrSource's plain path, as a finished upstream's
    del values
    source = volume.ZarrSource(src_out.path)
    key = operator_key(task, params)

    def one(name: str, region: Chunk) -> dict:
        dst = volume.ZarrOutput.create(os.path.join(work, f"{name}.zarr"), shape)
        job = BlockJob(source=source, chunk=region, halo=halo, volume_shape=shape, output_path=dst.path,
                       operator=operator, operator_key=key, budget_bytes=0, label=name)
        bound = inspect.signature(fn).bind(job, **params)
        return run_block(fn, job, bound).observation

    i0, i1, x0, x1 = (int(v) for v in chunk)
    region = Chunk((i0, x0, 0), (i1, x1, shape[2]))
    small = Chunk((0, 0, 0), (min(4, shape[0]), min(4, shape[1]), shape[2]))
    one("warm-up", small)  # first use of the operator, zarr and its codecs, paid outside the measurement
    read, _ = with_halo(region, halo, shape)
    _release_free_heap()
    obs = one("measured", region)
    block = source.read(read)
    _release_free_heap()
    _, alone = measure(fn, block, **params)
    return {"chunk": region.key(), "read": list(read.shape), "written": list(region.shape),
            "block_mib": block.nbytes / MIB, "written_mib": region.elements * 4 / MIB,
            "task_peak_mib": obs["peak_bytes"] / MIB, "operator_peak_mib": alone.peak_bytes / MIB,
            "task_seconds": obs["seconds"], "operator_seconds": alone.seconds}


def spread(values: list[float]) -> str:
    """Median of ``values`` with their range, e.g. ``19.0 (18.4-19.2)``."""
    return f"{statistics.median(values):5.1f} ({min(values):.1f}-{max(values):.1f})"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.task_memory", description=__doc__.splitlines()[0])
    p.add_argument("--operator", default="gaussian_smooth")
    p.add_argument("--params", metavar="JSON", default="{}", help="the operator's parameters (a JSON object)")
    p.add_argument("--survey", type=int, nargs=3, metavar=("IL", "XL", "NT"), default=[192, 192, 100])
    p.add_argument("--chunk", type=int, nargs=4, action="append", metavar=("I0", "I1", "X0", "X1"),
                   help="a chunk of whole traces (repeatable; default: an iline slab and a corner block)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", metavar="JSON", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        c = json.loads(args.child)
        print(json.dumps(child(c["operator"], c["params"], c["survey"], c["chunk"])))
        return 0
    params = json.loads(args.params)
    if not isinstance(params, dict):
        p.error(f"--params must be a JSON object, got {args.params!r}")
    il, xl, _ = args.survey
    chunks = args.chunk or [[il // 2, il, 0, xl], [0, il // 2, xl // 2, xl]]
    for c in chunks:
        if not (0 <= c[0] < c[1] <= il and 0 <= c[2] < c[3] <= xl):
            p.error(f"--chunk {' '.join(map(str, c))} is not inside the survey's {il} ilines x {xl} xlines: give "
                    "I0 < I1 <= IL and X0 < X1 <= XL")
    rows: list[dict[str, Any]] = []
    for c in chunks:
        runs = [run_child("benchmarks.studies.task_memory", ["--child", json.dumps(
            {"operator": args.operator, "params": params, "survey": args.survey, "chunk": c})])
            for _ in range(args.repeat)]
        rows.append({**{k: runs[0][k] for k in ("chunk", "read", "written", "block_mib", "written_mib")},
                     "task_peaks_mib": [round(r["task_peak_mib"], 1) for r in runs],
                     "task_seconds": [round(r["task_seconds"], 3) for r in runs],
                     "operator_seconds": [round(r["operator_seconds"], 3) for r in runs],
                     "operator_peaks_mib": [round(r["operator_peak_mib"], 1) for r in runs]})
    print(f"{args.operator} {params or ''} on a {' x '.join(map(str, args.survey))} zarr survey, {args.repeat} "
          "fresh processes per chunk (median of the peaks; min-max)")
    print(f"{'chunk':22s} {'block read':>16s} {'MiB':>6s} {'written MiB':>11s} {'task peak':>16s} "
          f"{'operator peak':>16s} {'task adds':>10s}")
    for r in rows:
        task, op = statistics.median(r["task_peaks_mib"]), statistics.median(r["operator_peaks_mib"])
        print(f"{r['chunk']:22s} {' x '.join(map(str, r['read'])):>16s} {r['block_mib']:6.1f} "
              f"{r['written_mib']:11.1f} {spread(r['task_peaks_mib']):>16s} {spread(r['operator_peaks_mib']):>16s} "
              f"{(task - op) / r['block_mib']:9.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"operator": args.operator, "params": params, "survey": args.survey, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
