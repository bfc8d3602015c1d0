"""What reading and writing a chunk's region cost in memory and time, a few storage chunks at a time vs zarr's default.

    python -m benchmarks.studies.write_memory [--repeat 3] [--json PATH]

A chunk's measured peak covers its read, its operator and its write
(``memchunk_prefect.run.worker.run_block``), and the model learns from it. This
measures the write's share in one process, as a worker runs it (one thread,
``MALLOC_TRIM_THRESHOLD_`` as Dask's nanny sets it): a 128 x 128 x 400 float32
source store, gaussian_smooth (sigma 2) on iline slabs of two shapes (the demo's
warm chunks, and a small one), each written into a fresh ``ZarrOutput`` with
zarr's ``async.concurrency`` at 1 (:data:`memchunk_prefect.io.zarr_store.WRITE_CONCURRENCY`)
or at zarr's default (10), ``--repeat`` times; the peak of read + operator +
write per chunk (``memchunk_prefect.run.monitor``, VmHWM) and the seconds. Reads are
varied the same way (:data:`memchunk_prefect.io.zarr_store.READ_CONCURRENCY`): four
processes, reads and writes both at zarr's default, then writes one storage
chunk at a time with reads 10, 2 and 1 at a time. Each process first reads the same slabs alone
(16-iline slabs, 5 rounds, as the overhead pair's envelope reads them): the
read's own peak, and its spread over reads of one slab.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from benchmarks.studies.children import run_child

SHAPE = (128, 128, 400)
SLABS = {"72+56 ilines": (72, 56), "9+36 ilines": (9, 36)}


READ_SLAB = 16  # ilines per slab in the reads-only rows
READ_ROUNDS = 5


def child(concurrency: int, repeat: int, read_concurrency: int = 1) -> dict:
    import numpy as np
    import zarr

    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io import zarr_store as volume
    from memchunk_prefect.operators import gaussian_smooth
    from memchunk_prefect.run.monitor import Monitor

    volume.WRITE_CONCURRENCY = concurrency
    volume.READ_CONCURRENCY = read_concurrency
    mon = Monitor(method="auto")
    work = tempfile.mkdtemp(prefix="memchunk-write-")
    src_out = volume.ZarrOutput.create(os.path.join(work, "src.zarr"), SHAPE)
    rng = np.random.default_rng(0)
    for i in range(0, SHAPE[0], 32):
        src_out.write(Chunk((i, 0, 0), (i + 32, SHAPE[1], SHAPE[2])),
                      rng.standard_normal((32, SHAPE[1], SHAPE[2])).astype(np.float32))
    src_out.finalize()  # a complete store: reads take ZarrSource's plain path, as a finished upstream's
    src = volume.ZarrSource(src_out.path)
    out: dict = {"concurrency": concurrency, "read_concurrency": read_concurrency, "zarr": zarr.__version__,
                 "storage_chunks": list(src_out.zarr_chunks), "slabs": {}}
    read_peaks: list[float] = []
    t = time.perf_counter()
    for _ in range(READ_ROUNDS):
        for i in range(0, SHAPE[0], READ_SLAB):
            with mon.track() as run:
                block = src.read(Chunk((i, 0, 0), (i + READ_SLAB, SHAPE[1], SHAPE[2])))
                del block
            read_peaks.append(run.measurement.peak_bytes / 2**20)
    out["reads"] = {"peaks_mib": [round(p, 1) for p in read_peaks], "seconds": round(time.perf_counter() - t, 3)}
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
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.write_memory", description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", type=int, nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child[0], args.repeat, args.child[1])))
        return 0
    # Each in a fresh process: the allocator's state is part of what is measured.
    results = [run_child("benchmarks.studies.write_memory", ["--child", str(w), str(r), "--repeat", str(args.repeat)])
               for w, r in ((10, 10), (1, 10), (1, 2), (1, 1))]
    first = results[0]
    print(f"reads alone: {SHAPE[0] // READ_SLAB} slabs of {READ_SLAB} ilines x {READ_ROUNDS} rounds from a store in "
          f"{' x '.join(map(str, first['storage_chunks']))} storage chunks (zarr {first['zarr']})")
    print(f"{'reads at once':>13s} {'peak MiB per read (min / median / max)':>40s} {'seconds':>8s}")
    for r in results[1:]:  # the first two read alike; their writes differ
        pk = r["reads"]["peaks_mib"]
        print(f"{r['read_concurrency']:>13d} {min(pk):>14.1f} / {statistics.median(pk):5.1f} / {max(pk):5.1f}"
              f"{'':10s} {r['reads']['seconds']:8.2f}")
    print(f"gaussian_smooth on {SHAPE[0]} x {SHAPE[1]} x {SHAPE[2]} iline slabs, read + operator + write per chunk, "
          f"{args.repeat} repeats")
    print(f"{'slabs':14s} {'reads, writes at once':>22s} {'peak MiB per chunk (min / median / max)':>40s} "
          f"{'seconds':>8s}")
    for name in SLABS:
        for r in results:
            s = r["slabs"][name]
            pk = s["peaks_mib"]
            at_once = f"{r['read_concurrency']}, {r['concurrency']}"
            print(f"{name:14s} {at_once:>22s} {min(pk):>14.1f} / {statistics.median(pk):5.1f} / "
                  f"{max(pk):5.1f}{'':10s} {s['seconds']:8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
