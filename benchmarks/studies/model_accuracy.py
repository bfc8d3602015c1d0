"""How well the online memory model predicts real operators: error of the mean, coverage of the bound.

    python -m benchmarks.studies.model_accuracy                 # collect (if no cached run) and replay
    python -m benchmarks.studies.model_accuracy --collect       # measure again, overwrite the cache
    python -m benchmarks.studies.model_accuracy --json out.json --markdown

Collect. For each operator in ``operators.OPERATORS`` (default parameters) a fresh
Python subprocess (this module with ``--child``) builds the synthetic survey
volume (:func:`memchunk_prefect.io.synthetic.synthetic_volume`, float32), warms the
operator up on a tiny block, then measures ``--blocks`` blocks of random
shapes cut from it. Each block runs in its own ``fork`` of that warm process, so
every peak is clean (nothing left from the previous block) and one-time costs
(imports, FFT plans) are already paid, as on a warm Dask worker. Figures are
:func:`memchunk_prefect.run.monitor.measure`'s: ``peak_bytes`` above the resting
RSS, ``seconds`` wall. Whole-trace operators get blocks with every sample of
the trace; the others are cut along time too. Observations are cached in
``~/.cache/memchunk-prefect/model_observations.json`` (``--cache`` moves it).

Replay. For each operator the observations are fed in ``--orders`` random
orders through :class:`memchunk_prefect.learn.operator.OperatorModel`; before learning
the (k+1)-th observation the model predicts it from the first k. Columns:

- ``MAPE@k``: mean absolute percentage error of the mean prediction for the
  next observation after k observations (k = 3, 5, 10), over the orders;
- ``coverage``: share of next observations (k >= 3, model ready) at or below
  the upper bound;
- ``bound/truth``: mean ratio of the upper bound to the measured peak there.

Goals: MAPE@5 <= 10 %, coverage >= 95 %, bound/truth <= 1.25.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

VOLUME_SHAPE = (72, 72, 288)
SEED = 0
BLOCKS = 14
ORDERS = 50
KS = (3, 5, 10)
CACHE = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memchunk-prefect"
         / "model_observations.json")
CHILD_TIMEOUT_SECONDS = 300
MIB = 2**20


def _release_free_heap() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def block_extents(rng: random.Random, volume: Sequence[int], whole_traces: bool, n: int) -> list[tuple[int, int, int]]:
    """``n`` block shapes spread over about a 30x range of sizes (small ones are mostly noise, so >= 12 x 12)."""
    out = []
    for _ in range(n):
        il = rng.randint(12, volume[0])
        xl = rng.randint(12, volume[1])
        t = volume[2] if whole_traces else rng.choice([volume[2] // 4, volume[2] // 2, 3 * volume[2] // 4, volume[2]])
        out.append((il, xl, t))
    return out


def _measure_in_fork(fn, block, params) -> dict[str, Any]:
    """Run ``measure(fn, block)`` in a forked child; returns its measurement as a dict."""
    from memchunk_prefect.run.monitor import measure

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            b = block.copy()
            _release_free_heap()
            _, m = measure(fn, b, **params)
            payload = json.dumps({"peak_bytes": int(m.peak_bytes), "seconds": m.seconds, "method": m.method,
                                  "outcome": m.outcome, "cpu_seconds": m.cpu_seconds})
        except BaseException as exc:  # noqa: BLE001 - report anything to the parent
            payload = json.dumps({"error": repr(exc)})
        os.write(w, payload.encode())
        os.close(w)
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        data = os.read(r, 65536)
        if not data:
            break
        chunks.append(data)
    os.close(r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks).decode() or '{"error": "child died"}')


def collect_operator(name: str, n_blocks: int, seed: int) -> list[dict[str, Any]]:
    """Measure ``n_blocks`` random blocks of operator ``name`` (call in a fresh process)."""
    from memchunk_prefect import operators
    from memchunk_prefect.io.synthetic import synthetic_volume
    from memchunk_prefect.operators import operator_key, spec_of

    op = operators.OPERATORS[name]
    spec = spec_of(op)
    volume = synthetic_volume(VOLUME_SHAPE, seed)
    op.fn(synthetic_volume((4, 4, 64), seed))  # warm-up: imports, FFT plans
    rng = random.Random(f"{name}-{seed}")
    key = operator_key(op, {}, dtype=str(volume.dtype))
    rows = []
    for ext in block_extents(rng, VOLUME_SHAPE, spec.whole_traces, n_blocks):
        o = [rng.randint(0, v - e) for v, e in zip(VOLUME_SHAPE, ext)]
        block = volume[o[0]:o[0] + ext[0], o[1]:o[1] + ext[1], o[2]:o[2] + ext[2]]
        m = _measure_in_fork(op.fn, block, {})
        if "error" in m:
            raise RuntimeError(f"{name} on a {ext} block: {m['error']}")
        e = ext[0] * ext[1] * ext[2]
        rows.append({"operator_key": key, "elements": e, "extents": list(ext), "bytes_in": 4 * e, **m})
    return rows


def collect(names: Sequence[str], n_blocks: int, seed: int) -> list[dict[str, Any]]:
    """One fresh subprocess per operator, two at a time (memory is per process, so they do not mix)."""
    procs: dict[str, subprocess.Popen] = {}
    pending = list(names)
    rows: list[dict[str, Any]] = []
    while pending or procs:
        while pending and len(procs) < 2:
            name = pending.pop(0)
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.studies.model_accuracy", "--child", name, "--blocks", str(n_blocks),
                 "--seed", str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.1)
        for name, p in list(procs.items()):
            if p.poll() is None:
                continue
            out, err = p.communicate()
            del procs[name]
            if p.returncode != 0:
                print(f"{name}: failed: {(err.strip().splitlines() or ['no output'])[-1]}", file=sys.stderr)
                continue
            rows += json.loads(out.strip().splitlines()[-1])
            print(f"measured {name}", file=sys.stderr, flush=True)
    return rows


def replay(rows: list[dict[str, Any]], orders: int, seed: int) -> dict[str, dict[str, Any]]:
    """Per operator key: MAPE@k, coverage, bound/truth over ``orders`` random orders."""
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.operator import OperatorModel

    by_key: dict[str, list[Observation]] = {}
    for r in rows:
        o = Observation(r["operator_key"], r["elements"], tuple(r["extents"]), r["bytes_in"], r["peak_bytes"],
                        seconds=r["seconds"], method=r.get("method", ""))
        by_key.setdefault(o.operator_key, []).append(o)
    rng = random.Random(seed)
    results = {}
    for key, observations in sorted(by_key.items()):
        errors: dict[int, list[float]] = {k: [] for k in KS}
        covered, ratios = [], []
        for _ in range(orders):
            order = observations[:]
            rng.shuffle(order)
            m = OperatorModel(key)
            for k, o in enumerate(order):
                p = m.predict(o.extents)
                if p.ready:
                    if k in errors:
                        errors[k].append(abs(p.mean_bytes / o.peak_bytes - 1))
                    covered.append(o.peak_bytes <= p.upper_bytes)
                    ratios.append(p.upper_bytes / o.peak_bytes)
                m.learn(o)
        last = OperatorModel(key)
        for o in observations:
            last.learn(o)
        s = last.summary()
        results[key] = {
            "n": len(observations),
            **{f"mape_{k}": (sum(v) / len(v) if v else None) for k, v in errors.items()},
            "coverage": sum(covered) / len(covered) if covered else None,
            "bound_over_truth": sum(ratios) / len(ratios) if ratios else None,
            "bytes_per_element": s["bytes_per_element"],
            "fixed_overhead_bytes": s["fixed_overhead_bytes"],
            "form": s["form"],
            "peak_mib_range": [min(o.peak_bytes for o in observations) / MIB,
                               max(o.peak_bytes for o in observations) / MIB],
        }
    return results


def format_table(results: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    header = ["operator key", "obs", "MAPE@3", "MAPE@5", "MAPE@10", "coverage", "bound/truth", "bytes/elem",
              "overhead MiB", "form"]
    body = [[k, str(r["n"]), pct(r["mape_3"]), pct(r["mape_5"]), pct(r["mape_10"]), pct(r["coverage"]),
             "-" if r["bound_over_truth"] is None else f"{r['bound_over_truth']:.2f}",
             "-" if r["bytes_per_element"] is None else f"{r['bytes_per_element']:.1f}",
             "-" if r["fixed_overhead_bytes"] is None else f"{r['fixed_overhead_bytes'] / MIB:.1f}", r["form"]]
            for k, r in results.items()]
    if markdown:
        rule = "|" + "|".join(["---"] + ["---:"] * (len(header) - 2) + ["---"]) + "|"
        lines = ["| " + " | ".join(header) + " |", rule]
        return "\n".join(lines + ["| " + " | ".join(c.replace("|", "\\|") for c in b) + " |" for b in body])
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in [header, *body])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.model_accuracy",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--collect", action="store_true", help="measure again even if a cached run exists")
    parser.add_argument("--cache", default=str(CACHE), help="observations cache (JSON); default %(default)s")
    parser.add_argument("--operators", default="", help="comma-separated names (default: every operator)")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks measured per operator")
    parser.add_argument("--orders", type=int, default=ORDERS, help="random replay orders per operator")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    parser.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        print(json.dumps(collect_operator(args.child, args.blocks, args.seed)))
        return 0

    cache = Path(args.cache)
    if args.collect or not cache.exists():
        from memchunk_prefect import operators

        names = [n.strip() for n in args.operators.split(",") if n.strip()] or list(operators.OPERATORS)
        unknown = sorted(set(names) - set(operators.OPERATORS))
        if unknown:
            parser.error(f"unknown operator(s) {unknown}; choose from {sorted(operators.OPERATORS)}")
        t0 = time.perf_counter()
        rows = collect(names, args.blocks, args.seed)
        print(f"collected {len(rows)} observations in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"volume_shape": VOLUME_SHAPE, "seed": args.seed, "observations": rows}, indent=1))
    else:
        rows = json.loads(cache.read_text())["observations"]
        print(f"replaying {len(rows)} cached observations from {cache} (--collect to measure again)", file=sys.stderr)
    results = replay(rows, args.orders, args.seed)
    print(f"Online memory model on real operator runs ({args.orders} random orders; next-observation figures):\n")
    print(format_table(results, args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
