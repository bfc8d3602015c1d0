"""``python -m benchmarks.family.compare``: two (or more) checkouts of the runner on the workload family, side by side.

A change is judged against the code before it on the same machine at the same time: a machine whose speed drifts
by 20% between two runs of :mod:`benchmarks.family` hides any change smaller than that. Here every workload's
runs of each checkout alternate (the order flips every round), each in a fresh process on a fresh cluster run
from that checkout (``PYTHONPATH`` and the working directory are the checkout's), against one Prefect server:

1. the static sweep over ``--static`` slab counts (from the first checkout: the static flow is the benchmark's,
   the same in every checkout), whose fastest is the workload's best static;
2. ``--rounds`` cold runs of each checkout, each on an empty store of its own;
3. unless ``--no-warm``, ``--rounds`` rounds of the best static then each checkout warm on the store of its
   first cold run.

Reported per workload and checkout: the median cold wall over the best static's, the median warm wall over the
static run of the same round; over the family, their medians and worsts. Make a checkout of the code before a
change with ``git worktree add ../before HEAD~1``::

    python -m benchmarks.family.compare --checkout before=../before after=. --json compare.json
    python -m benchmarks.family.compare --summarize compare.json   # the table again, from the JSON
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.family.__main__ import _server, make_source
from benchmarks.family.workloads import family


def run_child(root: str, spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """One strategy in a fresh process of the checkout at ``root``; its result, or a failed one saying why."""
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.family.child", json.dumps(spec)], cwd=root,
                              env={**env, "PYTHONPATH": root}, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"completed": False, "failed": f"timed out after {timeout:g} s", "wall_seconds": timeout}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FAMILY-RESULT ")), None)
    if line is None:
        return {"completed": False, "wall_seconds": time.perf_counter() - t,
                "failed": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(line[len("FAMILY-RESULT "):])


def _wall(r: dict[str, Any]) -> float:
    return float(r["wall_seconds"]) if r.get("completed") else math.inf


def summarize(results: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per workload and checkout the cold and warm ratios; over the family their medians and worsts (a failed run
    is an infinite ratio: it can never improve the figures)."""
    rows, cold, warm = [], {n: [] for n in names}, {n: [] for n in names}
    for res in results:
        ok = [_wall(r) for r in res["sweep"].values() if r.get("completed")]
        if not ok:
            continue
        best = min(ok)
        row: dict[str, Any] = {"workload": res["workload"]["name"], "best_static_seconds": best}
        statics = [_wall(s) for s in res["static"]]
        for n in names:
            c = statistics.median(_wall(r) for r in res["cold"][n]) / best if res["cold"][n] else None
            w = [_wall(m) / s for m, s in zip(res["warm"][n], statics)]
            row[n] = {"cold": c, "warm": statistics.median(w) if w else None, "warm_pairs": w}
            if c is not None:
                cold[n].append(c)
            if w:
                warm[n].append(statistics.median(w))
        rows.append(row)

    def figures(xs: list[float]) -> dict[str, float | None]:
        return {"median": statistics.median(xs) if xs else None, "worst": max(xs) if xs else None}

    return {"rows": rows, "family": {n: {"cold": figures(cold[n]), "warm": figures(warm[n])} for n in names}}


def table(summary: dict[str, Any], names: list[str]) -> str:
    def f(x: float | None) -> str:
        return "-" if x is None else ("failed" if math.isinf(x) else f"{x:.2f}x")

    head = "| workload | best static | " + " | ".join(f"{n} cold | {n} warm" for n in names) + " |"
    lines = [head, "|---|---|" + "---|---|" * len(names)]
    for row in summary["rows"]:
        cells = " | ".join(f"{f(row[n]['cold'])} | {f(row[n]['warm'])}" for n in names)
        lines.append(f"| {row['workload']} | {row['best_static_seconds']:.1f} s | {cells} |")
    fam = summary["family"]
    for n in names:
        lines.append(f"{n}: cold median {f(fam[n]['cold']['median'])}, worst {f(fam[n]['cold']['worst'])}; "
                     f"warm median {f(fam[n]['warm']['median'])}, worst {f(fam[n]['warm']['worst'])}")
    return "\n".join(lines)


def _workload(w: Any, work: Path, env: dict[str, str], checkouts: dict[str, str], args: argparse.Namespace
              ) -> dict[str, Any]:
    source = make_source(w, work)
    out_dir = str(work / "out" / w.name)
    names = list(checkouts)

    def run(name: str, strategy: str, store: str = "") -> dict[str, Any]:
        shutil.rmtree(out_dir, ignore_errors=True)
        r = run_child(checkouts[name], {"workload": w.to_dict(), "strategy": strategy, "source": source,
                                        "store": store, "out_dir": out_dir}, env, args.timeout)
        print(f"  {name:<10} {strategy:<10} {r.get('wall_seconds', 0):6.2f} s  "
              + ("ok" if r.get("completed") else f"FAILED {str(r.get('failed'))[:100]}")
              + f"  chunks {r.get('chunks', '')}", flush=True)
        return r

    print(f"{w.name}: {w.survey_shape} {w.source}, 2 workers x {w.memory_limit_mib} MiB x {w.threads} thread(s)",
          flush=True)
    res: dict[str, Any] = {"workload": w.to_dict(), "sweep": {n: run(names[0], f"static-{n}") for n in args.static},
                           "cold": {n: [] for n in names}, "warm": {n: [] for n in names}, "static": []}
    ok = {n: r for n, r in res["sweep"].items() if r.get("completed")}
    best = min(ok, key=lambda n: ok[n]["wall_seconds"]) if ok else None

    def store(name: str, k: int) -> str:
        path = work / f"{w.name}-{name}-cold{k}.sqlite"
        for p in work.glob(path.name + "*"):
            p.unlink()
        return str(path)

    for k in range(args.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            res["cold"][name].append(run(name, "memchunk", store(name, k)))
    if not args.no_warm and best is not None:
        for k in range(args.rounds):
            res["static"].append(run(names[0], f"static-{best}"))
            for name in names if k % 2 == 0 else names[::-1]:
                res["warm"][name].append(run(name, "memchunk", str(work / f"{w.name}-{name}-cold0.sqlite")))
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.family.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkout", nargs="+", metavar="NAME=PATH", help="checkouts to compare, by name")
    p.add_argument("--summarize", metavar="JSON", help="print the table of a finished comparison and stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", type=int, default=6)
    p.add_argument("--only", nargs="*", default=None, help="run only workloads whose name starts with these")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--static", type=int, nargs="+", default=[2, 4], help="slab counts of the sweep")
    p.add_argument("--no-warm", action="store_true", help="cold runs only")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--work", default=None, help="where inputs, stores and outputs go (default: a temporary dir)")
    p.add_argument("--json", default=None, help="write the runs and the summary here")
    args = p.parse_args(argv)
    if args.summarize:
        doc = json.loads(Path(args.summarize).read_text())
        print(table(summarize(doc["results"], doc["checkouts"]), doc["checkouts"]))
        return 0
    if not args.checkout or any("=" not in c for c in args.checkout):
        p.error("--checkout takes NAME=PATH pairs, e.g. --checkout before=../before after=.")
    checkouts = {n: str(Path(path).resolve()) for n, path in (c.split("=", 1) for c in args.checkout)}
    missing = [f"{n}={path}" for n, path in checkouts.items() if not (Path(path) / "benchmarks" / "family").is_dir()]
    if missing:
        p.error(f"not a checkout of this repository (no benchmarks/family): {', '.join(missing)}")
    workloads = family(args.seed, args.workloads)
    if args.only:
        workloads = [w for w in workloads if any(w.name.startswith(o) for o in args.only)]
    if args.scale != 1:
        workloads = [w.scaled(args.scale) for w in workloads]
    work = Path(args.work or tempfile.mkdtemp(prefix="memchunk-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with _server(work) as server_env:
        env = {k: v for k, v in server_env.items() if not k.startswith("MEMCHUNK_")}
        env["MEMCHUNK_CACHE_DIR"] = str(work / "cache")
        for w in workloads:
            results.append(_workload(w, work, env, checkouts, args))
            if args.json:
                Path(args.json).write_text(json.dumps({"benchmark": "family-compare", "seed": args.seed,
                                                       "scale": args.scale, "checkouts": list(checkouts),
                                                       "results": results}, indent=1))
    print()
    print(table(summarize(results, list(checkouts)), list(checkouts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
