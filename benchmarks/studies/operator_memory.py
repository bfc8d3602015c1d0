"""Peak memory of every operator in ``tasks`` as a multiple of its input block's bytes.

    python -m benchmarks.studies.operator_memory                      # 64 x 64 x 400 float32 block, text table
    python -m benchmarks.studies.operator_memory --shape 128 128 400 --markdown
    python -m benchmarks.studies.operator_memory --operators envelope,gst3d_dip --json out.json
    python -m benchmarks.studies.operator_memory --operators gaussian_smooth --params '{"sigma": [6, 6, 6]}' \
        --shape 157 120 100

Each operator runs in a **fresh Python subprocess** (this module with ``--child``),
so one operator's peak never carries into another's: the child builds the input
block (:func:`memchunk_prefect.io.synthetic.synthetic_volume`, float32), runs the operator
once on a tiny block (so one-time costs such as lazy imports and FFT plans are
paid before, as on a warm worker), returns freed heap memory to the OS
(``malloc_trim``), then measures one call on the whole block with
:func:`memchunk_prefect.run.monitor.measure` — the same figures the runner records
for task runs: ``peak_bytes`` is the process's peak RSS during the call minus
its RSS just before (input block excluded, output included), ``seconds`` wall time.

Columns: input MiB (the block's bytes), peak MiB (``peak_bytes``), multiple
(peak / input bytes) and seconds. Parameters are each operator's defaults, or
``--params`` (a JSON object given to every operator measured; its key shows them).
Figures drift a few percent from run to run (allocator and page-cache noise:
determinism is not reachable for memory); ``trace_correlation`` is deliberately quadratic in the
block's traces, so its multiple grows with iline x xline.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
from typing import Any, Sequence

DEFAULT_SHAPE = (64, 64, 400)
DEFAULT_SEED = 0
MIB = 2**20
#: Seconds one child (import, build the block, run one operator) may take before it is abandoned.
CHILD_TIMEOUT_SECONDS = 600


def _release_free_heap() -> None:
    """Give freed heap pages back to the OS so they cannot hide part of the next peak (glibc only)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def measure_operator(name: str, shape: Sequence[int], seed: int = DEFAULT_SEED, device: str = "cpu",
                     params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure one operator on a synthetic block in *this* process (call it in a fresh one), with ``params``
    (keyword arguments of the operator; its defaults where None).

    ``device="cuda"``: the operator computes on the GPU (or the fake device, :mod:`memchunk_prefect.operators.device`);
    its GPU peak above what the device held before (``Backend.track``) is measured beside the host's, and the
    warm-up runs there too (CuPy's kernels compile and cuFFT plans are made on first use).
    """
    from memchunk_prefect import operators
    from memchunk_prefect.io.synthetic import synthetic_volume
    from memchunk_prefect.operators import operator_key
    from memchunk_prefect.operators.device import GpuUse, backend, resolve_device
    from memchunk_prefect.run.monitor import measure

    device = resolve_device(device)  # "cuda" without a usable GPU: DeviceError saying why
    op = operators.OPERATORS[name]
    params = dict(params or {})
    block = synthetic_volume(tuple(shape), seed)
    # warm-up: one-time costs out
    op.fn(synthetic_volume((2, 2, min(int(shape[2]), 32)), seed), device=device, **params)
    _release_free_heap()
    gpu = GpuUse()
    if device == "cuda":
        def call(b):
            nonlocal gpu
            with backend(device).track() as gpu:
                return op.fn(b, device=device, **params)
    else:
        def call(b):
            return op.fn(b, device=device, **params)
    result, m = measure(call, block)
    if m.error is not None:
        raise RuntimeError(f"{name} failed on a {tuple(shape)} block on {device}: {m.error}")
    row = {
        "operator": name,
        "device": device,
        "key": operator_key(op, params, dtype=str(block.dtype), device=device),
        "shape": list(block.shape),
        "input_bytes": int(block.nbytes),
        "output_bytes": int(result.nbytes),
        "peak_bytes": int(m.peak_bytes),
        "multiple": m.peak_bytes / block.nbytes,
        "seconds": m.seconds,
        "method": m.method,
    }
    if gpu.peak_bytes is not None:
        row.update(gpu_peak_bytes=int(gpu.peak_bytes), gpu_multiple=gpu.peak_bytes / block.nbytes,
                   gpu_method=gpu.method)
    return row


def run_in_subprocess(name: str, shape: Sequence[int], seed: int = DEFAULT_SEED, device: str = "cpu",
                      params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Measure one operator in a fresh interpreter; ``{"operator", "error"}`` if it failed."""
    cmd = [sys.executable, "-m", "benchmarks.studies.operator_memory", "--child", name,
           "--shape", *map(str, shape), "--seed", str(seed), "--device", device, "--params", json.dumps(params or {})]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        return {"operator": name, "device": device, "error": f"no result within {CHILD_TIMEOUT_SECONDS} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"operator": name, "device": device, "error": f"exit status {done.returncode}: {tail}"}
    return json.loads(lines[-1])


def format_table(rows: list[dict[str, Any]], markdown: bool) -> str:
    """One row per operator and device; GPU columns (the device's peak and multiple) when a row ran on one."""
    on_gpu = any(r.get("device") == "cuda" for r in rows)
    header = ["operator", *(["device"] if on_gpu else []), "input MiB", "peak MiB", "multiple", "seconds",
              *(["GPU peak MiB", "GPU multiple"] if on_gpu else [])]
    body = []
    for r in rows:
        dev = [r.get("device", "cpu")] if on_gpu else []
        if "error" in r:
            body.append([r["operator"], *dev, "-", "-", "failed", r["error"], *(["-", "-"] if on_gpu else [])])
            continue
        gpu = ([f"{r['gpu_peak_bytes'] / MIB:.1f}", f"{r['gpu_multiple']:.1f}x"] if "gpu_peak_bytes" in r
               else ["-", "-"]) if on_gpu else []
        body.append([r["operator"], *dev, f"{r['input_bytes'] / MIB:.1f}", f"{r['peak_bytes'] / MIB:.1f}",
                     f"{r['multiple']:.1f}x", f"{r['seconds']:.2f}", *gpu])
    if markdown:
        left = 2 if on_gpu else 1  # the operator (and device) columns read left-aligned
        rule = "|" + "|".join(["---"] * left + ["---:"] * (len(header) - left)) + "|"
        lines = ["| " + " | ".join(header) + " |", rule]
        lines += ["| " + " | ".join(row) + " |" for row in body]
        return "\n".join(lines)
    widths = [max(len(str(row[i])) for row in [header, *body]) for i in range(len(header))]
    fmt = lambda row: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, body)])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.operator_memory",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "T"), default=list(DEFAULT_SHAPE),
                        help="block shape (iline, xline, twt); default %(default)s")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="synthetic volume seed")
    parser.add_argument("--operators", default="", help="comma-separated names (default: every operator)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON to PATH")
    parser.add_argument("--device", choices=("cpu", "cuda", "both"), default="cpu",
                        help="where the operators compute: the CPU, the GPU (CuPy), or both side by side")
    parser.add_argument("--params", metavar="JSON", default="{}",
                        help='operator parameters as a JSON object, e.g. \'{"sigma": [6, 6, 6]}\' (default: none)')
    parser.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)  # internal: measure one, print JSON
    args = parser.parse_args(argv)
    if any(n <= 0 for n in args.shape):
        parser.error(f"--shape needs three positive sizes, got {args.shape}")
    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as exc:
        parser.error(f"--params must be a JSON object, got {args.params!r} ({exc})")
    if not isinstance(params, dict):
        parser.error(f"--params must be a JSON object such as '{{\"sigma\": [6, 6, 6]}}', got {args.params!r}")

    if args.child:
        print(json.dumps(measure_operator(args.child, args.shape, args.seed, args.device, params)))
        return 0

    from memchunk_prefect import operators

    names = [n.strip() for n in args.operators.split(",") if n.strip()] or list(operators.OPERATORS)
    unknown = sorted(set(names) - set(operators.OPERATORS))
    if unknown:
        parser.error(f"unknown operator(s) {unknown}; choose from {sorted(operators.OPERATORS)}")
    devices = ["cpu", "cuda"] if args.device == "both" else [args.device]
    rows = []
    for name in names:
        for device in devices:
            rows.append(run_in_subprocess(name, args.shape, args.seed, device, params))
            print(f"measured {name} on {device}", file=sys.stderr, flush=True)
    shape = " x ".join(map(str, args.shape))
    print(f"Peak memory per operator on one {shape} float32 block "
          f"({'parameters ' + json.dumps(params) if params else 'default parameters'}; "
          "each in a fresh process; `python -m benchmarks.studies.operator_memory"
          f"{'' if tuple(args.shape) == DEFAULT_SHAPE else ' --shape ' + ' '.join(map(str, args.shape))}"
          f"{' --params ' + repr(json.dumps(params)) if params else ''}`):\n")
    print(format_table(rows, args.markdown))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=2)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
