"""What reading a SEG-Y file's geometry costs a flow, scanned and kept: seconds per million traces.

    python -m benchmarks.studies.segy_scan [--ilines 2000 --xlines 1000 --samples 25] [--json PATH]

Writes a synthetic survey of ``ilines x xlines`` traces (IBM floats, line steps 2 and 4, a few samples per
trace: the scan reads trace headers only, so the samples barely matter), then times, each in a fresh
process so nothing is warm:

- ``scan``: :func:`memchunk_prefect.io.segy.scan`, every trace header read (what each map of each run paid
  before the geometry was kept);
- ``first``: :func:`memchunk_prefect.io.segy_cache.cached_scan` on an empty cache (the scan, plus writing the
  geometry to the cache);
- ``kept``: the same call in another fresh process, reading the kept geometry (what every later map and run
  pays).

The default is 2,000,000 traces, a survey of real size for its trace count.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.studies.children import run_child


def child(path: str, mode: str, cache: str) -> dict:
    os.environ["MEMCHUNK_CACHE_DIR"] = cache
    from memchunk_prefect.io import segy, segy_cache

    t = time.perf_counter()
    geom = segy.scan(path) if mode == "scan" else segy_cache.cached_scan(path)
    return {"mode": mode, "seconds": time.perf_counter() - t, "traces": int(geom.tracecount),
            "shape": [len(geom.ilines), len(geom.xlines)]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.segy_scan", description=__doc__.split("\n\n")[0])
    p.add_argument("--ilines", type=int, default=2000)
    p.add_argument("--xlines", type=int, default=1000)
    p.add_argument("--samples", type=int, default=25)
    p.add_argument("--work", default=None, help="where the survey and the cache go (default: a temporary dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=3, metavar=("PATH", "MODE", "CACHE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    from memchunk_prefect import synthetic_survey

    work = Path(args.work or tempfile.mkdtemp(prefix="memchunk-scan-"))
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"survey-{args.ilines}x{args.xlines}x{args.samples}.sgy"
    t = time.perf_counter()
    if not path.exists():
        synthetic_survey(path, (args.ilines, args.xlines, args.samples), sample_format=1, line_step=(2, 4))
    written = time.perf_counter() - t
    age = time.time() - path.stat().st_mtime
    if age < 2.5:  # a file changed in the last seconds is scanned, not kept (segy_cache.SETTLE_SECONDS)
        time.sleep(2.5 - age)
    cache = str(work / "cache")
    from benchmarks.__main__ import machine_info

    machine = machine_info()
    rows = [run_child("benchmarks.studies.segy_scan", ["--child", str(path), mode, cache])
            for mode in ("scan", "first", "kept")]
    traces = rows[0]["traces"]
    print(f"{traces:,} traces ({path.stat().st_size / 2**20:,.0f} MiB, written in {written:.1f} s)")
    for r in rows:
        print(f"  {r['mode']:<6} {r['seconds']:7.2f} s  ({r['seconds'] / traces * 1e6:.2f} s per million traces)")
    if args.json:
        machine["loadavg_end"] = list(os.getloadavg())
        Path(args.json).write_text(json.dumps({"benchmark": "segy_scan", "machine": machine, "traces": traces,
                                               "bytes": path.stat().st_size, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
