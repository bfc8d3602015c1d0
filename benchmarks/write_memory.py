"""What writing a chunk's region costs in memory and time, one storage chunk at a time against zarr's default.

    python -m benchmarks.write_memory [--repeat 3] [--json PATH]

A chunk's measured peak covers its read, its operator and its write
(``memchunk_prefect.worker.run_block``), and the model learns from it. This
measures the write's share in one process, as a worker runs it (one thread,
``MALLOC_TRIM_THRESHOLD_`` as Dask's nanny sets it): a 128 x 128 x 400 float32
source store, gaussian_smooth (sigma 2) on iline slabs of two shapes (the demo's
warm chunks, and a small one), each written into a fresh ``ZarrOutput`` with
zarr's ``async.concurrency`` at 1 (:data:`memchunk_prefect.volume.WRITE_CONCURRENCY`)
or at zarr's default (10), ``--repeat`` times; the peak of read + operator +
write per chunk (``memchunk_prefect.monitor``, VmHWM) and the seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks.children import run_child

SHAPE = (128, 128, 400)
SLABS = {"72+56 ilines": (72, 56), "9+36 ilines": (9, 36)}


def child(concurrency: int, repeat: int) -> dict:
    import numpy as np
    import zarr

    from memchunk_prefect import volume
    from memchunk_prefect.chunks import Chunk
    from memchunk_prefect.monitor import Monitor
    from tasks import gaussian_smooth

    volume.WRITE_CONCURRENCY = concurrency
    mon = Monitor(method="auto")
    work = tempfile.mkdtemp(prefix="memchunk-write-")
    src_out = volume.ZarrOutput.create(os.path.join(work, "src.zarr"), SHAPE)
    rng = np.random.default_rng(0)
    for i in range(0, SHAPE[0], 32):
        src_out.write(Chunk((i, 0, 0), (i + 32, SHAPE[1], SHAPE[2])),
                      rng.standard_normal((32, SHAPE[1], SHAPE[2])).astype(np.float32))
    src = volume.ZarrSource(src_out.path)
    out: dict = {"concurrency": concurrency, "zarr": zarr.__version__, "slabs": {}}
    for name, widths in SLABS.items():
        peaks: list[float] = []
        seconds = 0.0
        for rep in range(repeat):
            dst = volume.ZarrOutput.create(os.path.join(work, f"{name}-{rep}.zarr".replace(" ", "_")), SHAPE)
            i0 = 0
            for w in widths:
                c = Chunk((i0, 0, 0), (i0 + w, SHAPE[1], SHAPE[2]))
                with mon.track() as run:
                    t = time.perf_counter()
                    block = src.read(c)
                    dst.write(c, gaussian_smooth.fn(block, sigma=(2, 2, 2)), mark_done=False)
                    seconds += time.perf_counter() - t
                    del block
                peaks.append(run.measurement.peak_bytes / 2**20)
                i0 += w
        out["slabs"][name] = {"peaks_mib": [round(p, 1) for p in peaks], "seconds": round(seconds, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.write_memory", description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child, args.repeat)))
        return 0
    # Each in a fresh process: the allocator's state is part of what is measured.
    results = [run_child("benchmarks.write_memory", ["--child", str(concurrency), "--repeat", str(args.repeat)])
               for concurrency in (1, 10)]
    print(f"gaussian_smooth on {SHAPE[0]} x {SHAPE[1]} x {SHAPE[2]} iline slabs, read + operator + write per chunk, "
          f"{args.repeat} repeats (zarr {results[0]['zarr']})")
    print(f"{'slabs':14s} {'writes at once':>14s} {'peak MiB per chunk (min / median / max)':>40s} {'seconds':>8s}")
    for name in SLABS:
        for r in results:
            s = r["slabs"][name]
            pk = s["peaks_mib"]
            print(f"{name:14s} {r['concurrency']:>14d} {min(pk):>14.1f} / {statistics.median(pk):5.1f} / "
                  f"{max(pk):5.1f}{'':10s} {s['seconds']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
