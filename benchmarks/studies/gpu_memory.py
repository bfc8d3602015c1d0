"""How well a task's GPU memory is measured: CuPy's pool and NVML against known allocations, then per operator.

    python -m benchmarks.studies.gpu_memory [--json PATH] [--shapes IL XL NT ...]

The runner records a GPU chunk's peak as what CuPy's memory pool grew by while
the task ran (:meth:`memchunk_prefect.operators.device.Backend.track`); NVML's per-process
figure (:mod:`memchunk_prefect.run.gpu_energy`) is the other candidate. Both are taken
here, in one process on the GPU, around:

- allocations of known size (the truth is the most held at once): one array;
  two alive together; one freed, then a smaller one (the pool reuses the block);
  many small arrays. ``error`` = measured / truth - 1;
- each operator on blocks of growing size, twice in a row (the first call in a
  process also creates cuFFT plans and cuSOLVER / cuBLAS handles: what NVML
  sees above the pool is memory the pool does not hold).

NVML is read three ways: at the task's end before the pool is freed
(``nvml_end``), and the most seen by a thread polling every
:data:`POLL_SECONDS` while it ran (``nvml_sampled``), each less the process's
figure before the task. Without a real GPU (the fake device, or none) the NVML
columns are empty; the fake device's figure (``tracemalloc``) is what the pool
column shows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

MIB = 1 << 20
#: Seconds between two NVML reads of this process's GPU memory while a case runs.
POLL_SECONDS = 0.002
#: Operator blocks (ilines, xlines, samples), float32.
SHAPES = ((64, 64, 400), (128, 128, 400), (256, 256, 400))
QUICK_SHAPES = ((16, 16, 64),)
OPERATORS = ("envelope", "gaussian_smooth", "gst3d_dip")


class _NvmlPoll:
    """The most NVML reported for this process while the block ran, bytes (None without NVML)."""

    def __init__(self) -> None:
        from memchunk_prefect.run.gpu_energy import _nvml

        self.nvml = _nvml()
        self.pid = os.getpid()
        self.most: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> int | None:
        return self.nvml.process_bytes(self.pid)[0] if self.nvml.available else None

    def __enter__(self) -> "_NvmlPoll":
        if self.nvml.available:
            self.most = self.now()
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            v = self.now()
            if v is not None and (self.most is None or v > self.most):
                self.most = v

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def measure_case(be: Any, fn: Callable[[Any], Any]) -> dict[str, Any]:
    """``fn(xp)`` inside ``be.track()``: the pool's figure, and NVML's at the end and sampled, above before."""
    poll = _NvmlPoll()
    sync = (lambda: be.xp.cuda.Device().synchronize()) if be.fake_capacity is None else (lambda: None)
    sync()
    if be.fake_capacity is None:
        be.xp.get_default_memory_pool().free_all_blocks()
    before = poll.now()
    end: int | None = None
    t = time.perf_counter()
    with poll, be.track() as use:
        keep = fn(be.xp)
        sync()
        end = poll.now()
        del keep
    seconds = time.perf_counter() - t
    return {"pool_bytes": use.peak_bytes, "method": use.method, "seconds": round(seconds, 4),
            "nvml_end_bytes": None if end is None or before is None else end - before,
            "nvml_sampled_bytes": None if poll.most is None or before is None else poll.most - before}


def _known_cases() -> list[tuple[str, int, Callable[[Any], Any]]]:
    """(name, truth in bytes, fn(xp)) for allocations of known size; each returns what it keeps alive."""
    def one(xp):
        return xp.ones(1024 * MIB, dtype=xp.uint8)

    def two(xp):
        return xp.ones(256 * MIB, dtype=xp.uint8), xp.ones(768 * MIB, dtype=xp.uint8)

    def freed_then_smaller(xp):
        a = xp.ones(1024 * MIB, dtype=xp.uint8)
        del a
        return xp.ones(512 * MIB, dtype=xp.uint8)

    def many(xp):
        return [xp.ones(16 * MIB, dtype=xp.uint8) for _ in range(64)]

    return [("one array of 1 GiB", 1024 * MIB, one), ("256 MiB and 768 MiB alive together", 1024 * MIB, two),
            ("1 GiB freed, then 512 MiB", 1024 * MIB, freed_then_smaller),
            ("64 arrays of 16 MiB", 1024 * MIB, many)]


def run(shapes: Sequence[Sequence[int]], known: bool = True) -> dict[str, Any]:
    from memchunk_prefect import operators
    from memchunk_prefect.operators.device import CUDA, backend, gpu_status

    status = gpu_status()
    if not status.usable:
        return {"skipped": status.why}
    be = backend(CUDA).load()
    rows: list[dict[str, Any]] = []
    if known:
        for name, truth, fn in _known_cases():
            r = measure_case(be, fn)
            r.update(case=name, truth_bytes=truth)
            for k in ("pool", "nvml_end", "nvml_sampled"):
                v = r[f"{k}_bytes"]
                r[f"{k}_error"] = None if v is None else v / truth - 1
            rows.append(r)
            print(_row_text(r), flush=True)
    rng = np.random.default_rng(0)
    for shape in shapes:
        block = rng.standard_normal(tuple(shape)).astype(np.float32)
        for op in OPERATORS:
            for call in ("first", "second"):
                r = measure_case(be, lambda xp, op=op, block=block: operators.OPERATORS[op].fn(block, device=CUDA))
                r.update(case=f"{op} {'x'.join(map(str, shape))} ({call} call)", operator=op, shape=list(shape),
                         input_bytes=block.nbytes, call=call)
                rows.append(r)
                print(_row_text(r), flush=True)
    return {"gpu": status.why, "fake": status.fake, "rows": rows, "poll_seconds": POLL_SECONDS}


def _mib(v: int | None) -> str:
    return "-" if v is None else f"{v / MIB:.1f}"


def _row_text(r: dict[str, Any]) -> str:
    errs = "".join(f"  {k} {r[k + '_error']:+.2%}" for k in ("pool", "nvml_end", "nvml_sampled")
                   if r.get(k + "_error") is not None)
    truth = f"truth {_mib(r['truth_bytes'])} MiB  " if "truth_bytes" in r else ""
    return (f"  {r['case']:<44} {truth}pool {_mib(r['pool_bytes'])}  NVML end {_mib(r['nvml_end_bytes'])}  "
            f"sampled {_mib(r['nvml_sampled_bytes'])} MiB  {r['seconds']:.3f} s{errs}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.gpu_memory", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the rows as JSON here")
    p.add_argument("--quick", action="store_true", help="one small block per operator (the fake device, CI)")
    p.add_argument("--no-known", action="store_true", help="skip the known allocations (1 GiB each)")
    args = p.parse_args(argv)
    result = run(QUICK_SHAPES if args.quick else SHAPES, known=not args.no_known)
    if "skipped" in result:
        print(f"GPU memory measurement skipped: {result['skipped']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
