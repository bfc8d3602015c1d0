"""``python -m benchmarks.family``: the runner against hand-tuned static chunking on workloads it has never seen.

Each workload of the seeded family (:mod:`benchmarks.family.workloads`) runs the way a deployment runs it:
every strategy in a fresh process on a fresh cluster (:mod:`benchmarks.family.child`), against one Prefect
server (``PREFECT_API_URL`` when set, else one started here). Per workload:

1. the static sweep: the pipeline over N iline slabs for every N of ``--static``; the fastest that completes
   is the workload's oracle ("best static": what a user who tried every chunk size would pick);
2. memchunk cold: ``MemoryAwareRunner`` on an empty store;
3. ``--pairs`` pairs of (best static, memchunk warm on the same store), in alternating order;
4. with ``--external``, one more warm run on a cluster started by the child, given to the runner by address.

Reported: per workload, the ratio of memchunk's wall to the best static's (warm: the median of the pairs'
ratios; cold: against the sweep's best), kills cold and warm, and the seconds from each flow's start to its
first task; over the family, the median and worst ratios. Written as JSON (``--json``) and as a table on
standard output. ``--quick`` runs the family's smallest member with one pair (for CI: no timing is asserted).

    python -m benchmarks.family --json family.json                 # 6 workloads, 3 pairs each
    python -m benchmarks.family --seed 1 --workloads 10 --pairs 5   # another family, more pairs
    python -m benchmarks.family --scale 16 --json family-16.json    # the same family on 16x the traces
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks.family.workloads import Workload, family, quick

REPO = Path(__file__).resolve().parents[2]
TARGETS = {"warm_median": 0.95, "warm_worst": 1.15, "cold_median": 1.20}
#: Lines of a child's log that say why its cluster failed a run: warnings and errors, in Prefect's log format
#: (``12:00:00.000 | WARNING | distributed.nanny - ...``, which the child's Dask loggers use) or Dask's own
#: (``... - distributed.nanny - WARNING - ...``), and a worker process killed by a signal (logged at INFO).
WARNING_LINE = re.compile(r"\| (WARNING|ERROR|CRITICAL) +\|| - (WARNING|ERROR|CRITICAL) - |killed by signal")
#: Of those, the lines that tell why a worker died or a task failed: a nanny's restart over the memory budget, a
#: process killed by a signal, an error.
DEATH_LINE = re.compile(r"exceeded \d+% memory budget|killed by signal|\| ERROR +\|| - ERROR - ")
#: How many lines a failed run keeps: the last ones (the death comes at the end), and the first
#: :data:`CLUSTER_LOG_DEATHS` deaths wherever they are.
CLUSTER_LOG_LINES = 20
CLUSTER_LOG_DEATHS = 5


def make_source(w: Workload, work: Path) -> str:
    """The workload's input: a SEG-Y file with IBM floats and odd line steps, or a zarr store of the same."""
    from memchunk_prefect import synthetic_survey

    path = work / f"{w.name}-{w.scale}x.sgy"
    if not path.exists():
        synthetic_survey(path, w.survey_shape, seed=w.seed, sample_format=1, line_step=(2, 4), first_iline=1001)
    if w.source == "segy":
        return str(path)
    zpath = work / f"{w.name}-{w.scale}x.zarr"
    if not zpath.exists():
        from memchunk_prefect.io.volume import as_source
        from memchunk_prefect.io.zarr_store import ZarrOutput

        src = as_source(str(path))
        out = ZarrOutput.create(str(zpath), src.shape, src.coords())
        for i in range(0, src.shape[0], 16):
            from memchunk_prefect.core.chunks import Chunk

            box = Chunk((i, 0, 0), (min(src.shape[0], i + 16), src.shape[1], src.shape[2]))
            out.write(box, src.read(box))
            out.mark_done(box)
        out.finalize()
    return str(zpath)


def cluster_log(stderr: str | bytes | None, lines: int = CLUSTER_LOG_LINES,
                deaths: int = CLUSTER_LOG_DEATHS) -> list[str]:
    """The warnings and errors of a child's log (:data:`WARNING_LINE`) a failed run keeps, in the log's order, each
    cut to 300 characters: the first ``deaths`` that tell of a death (:data:`DEATH_LINE`), so that a run that logs
    many errors after it keeps its cause, and the last ``lines``. What a worker's death can be read from afterwards,
    without the thousands of lines a run logs."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode(errors="replace")
    found = [ln.rstrip()[:300] for ln in (stderr or "").splitlines() if WARNING_LINE.search(ln)]
    first_deaths = [i for i, ln in enumerate(found) if DEATH_LINE.search(ln)][:max(0, deaths)]
    last = range(max(0, len(found) - lines), len(found)) if lines > 0 else range(0)
    return [found[i] for i in sorted(set(first_deaths) | set(last))]


def run_child(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one strategy in a fresh process; its result, or a failed one saying why. A run that did not complete
    keeps its cluster's last warnings and errors (``cluster_log``: :func:`cluster_log`)."""
    t = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.family.child", json.dumps(spec)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return {"completed": False, "failed": f"timed out after {timeout:g} s", "wall_seconds": timeout,
                "cluster_log": cluster_log(exc.stderr)}
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("FAMILY-RESULT ")), None)
    if line is None:
        return {"completed": False, "wall_seconds": time.perf_counter() - t,
                "failed": f"exit {proc.returncode}: " + (proc.stderr.strip().splitlines() or ["no output"])[-1][:300],
                "cluster_log": cluster_log(proc.stderr)}
    result: dict[str, Any] = json.loads(line[len("FAMILY-RESULT "):])
    if not result.get("completed"):
        result["cluster_log"] = cluster_log(proc.stderr)
    return result


def run_workload(w: Workload, work: Path, env: dict[str, str], statics: list[int], pairs: int, external: bool,
                 timeout: float) -> dict[str, Any]:
    source = make_source(w, work)
    store = str(work / f"{w.name}.sqlite")
    for p in Path(store).parent.glob(Path(store).name + "*"):
        p.unlink()
    out_dir = str(work / "out" / w.name)

    def child(strategy: str, **extra: Any) -> dict[str, Any]:
        shutil.rmtree(out_dir, ignore_errors=True)
        r = run_child({"workload": w.to_dict(), "strategy": strategy, "source": source, "store": store,
                       "out_dir": out_dir, **extra}, env, timeout)
        r["strategy"] = strategy
        print(f"  {strategy:<12} {r.get('wall_seconds', 0):7.1f} s  "
              + ("ok" if r.get("completed") else f"FAILED {r.get('failed', '')}")
              + (f"  chunks {r['chunks']}" if r.get("chunks") else "")
              + (f"  kills {r['kills']}" if r.get("kills") else ""), flush=True)
        return r

    print(f"{w.name}: {w.survey_shape} {w.source}, 2 workers x {w.memory_limit_mib} MiB x {w.threads} thread(s)",
          flush=True)
    sweep = [child(f"static-{n}") for n in statics]
    ok = [r for r in sweep if r.get("completed")]
    result: dict[str, Any] = {"workload": w.to_dict(), "sweep": sweep}
    if not ok:
        result["note"] = "no static chunking completed"
    best = min(ok, key=lambda r: r["wall_seconds"]) if ok else None
    result["cold"] = child("memchunk")
    warm_pairs = []
    for k in range(pairs):
        order = ["static", "memchunk"] if k % 2 == 0 else ["memchunk", "static"]
        pair: dict[str, Any] = {}
        for s in order:
            pair[s] = child(best["strategy"]) if s == "static" and best else (child("memchunk") if s == "memchunk"
                                                                               else None)
        warm_pairs.append(pair)
    result["pairs"] = warm_pairs
    if external:
        result["external"] = child("memchunk", cluster="address")
    result.update(summarize_workload(result, best))
    return result


def _ratio(a: dict | None, b: dict | None) -> float | None:
    """memchunk's wall over the static's; ``inf`` where the static completed and memchunk did not (a failed run
    is the worst ratio there is, never a run left out); None where the static did not complete."""
    if not a or not b or not b.get("completed"):
        return None
    if not a.get("completed"):
        return math.inf
    return a["wall_seconds"] / b["wall_seconds"]


def _kills(r: dict | None) -> int:
    """Chunks killed in a run: the ones it counted, or one for a run that stopped on a chunk out of memory."""
    if not r:
        return 0
    return int(r.get("kills") or 0) or int("ChunkOutOfMemoryError" in str(r.get("failed", "")))


def _finite(x: float | None) -> float | None:
    return None if x is None or math.isinf(x) else x


def summarize_workload(result: dict[str, Any], best: dict | None) -> dict[str, Any]:
    warm = [r for r in (_ratio(p.get("memchunk"), p.get("static")) for p in result["pairs"]) if r is not None]
    cold = _ratio(result["cold"], best)
    warm_median = statistics.median(warm) if warm else None
    return {
        "best_static": best["strategy"] if best else None,
        "best_static_seconds": best["wall_seconds"] if best else None,
        "cold_ratio": _finite(cold), "cold_failed": cold is not None and math.isinf(cold),
        "warm_ratios": [_finite(x) for x in warm],
        "warm_ratio": _finite(warm_median), "warm_failed": sum(1 for x in warm if math.isinf(x)),
        "warm_median_failed": warm_median is not None and math.isinf(warm_median),
        "cold_kills": _kills(result["cold"]),
        "warm_kills": sum(_kills(p.get("memchunk")) for p in result["pairs"]),
        "first_task_seconds": {
            "static": [_first_task(p["static"]) for p in result["pairs"] if p.get("static")],
            "memchunk_warm": [_first_task(p["memchunk"]) for p in result["pairs"] if p.get("memchunk")],
        },
    }


def _first_task(r: dict[str, Any]) -> float | None:
    """Seconds from the flow call to the first operator call on a worker: the call is the start both strategies
    share, the task runner's entry included (runs recorded before it was measured: from the flow function's first
    line)."""
    return r.get("first_task_from_call_seconds", r.get("first_task_seconds"))


def summarize_family(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Median and worst over the workloads; a workload whose memchunk runs failed (the median of its pairs, or
    its cold run) counts as the worst ratio there is, so a failure can never improve the figures."""
    warm = [math.inf if r.get("warm_median_failed") else r["warm_ratio"] for r in results
            if r.get("warm_ratio") is not None or r.get("warm_median_failed")]
    cold = [math.inf if r.get("cold_failed") else r["cold_ratio"] for r in results
            if r.get("cold_ratio") is not None or r.get("cold_failed")]
    static_first = [x for r in results for x in r["first_task_seconds"]["static"] if x is not None]
    runner_first = [x for r in results for x in r["first_task_seconds"]["memchunk_warm"] if x is not None]
    s = {
        "warm_median": statistics.median(warm) if warm else None, "warm_worst": max(warm) if warm else None,
        "cold_median": statistics.median(cold) if cold else None, "cold_worst": max(cold) if cold else None,
        "warm_kills": sum(r["warm_kills"] for r in results), "cold_kills": sum(r["cold_kills"] for r in results),
        "warm_failed_runs": sum(r.get("warm_failed", 0) for r in results),
        "cold_failed_runs": sum(1 for r in results if r.get("cold_failed")),
        "first_task_static_median": statistics.median(static_first) if static_first else None,
        "first_task_memchunk_median": statistics.median(runner_first) if runner_first else None,
        "workloads": len(results), "measured": len(warm),
    }
    s["targets"] = {
        "warm_median": _verdict(s["warm_median"], TARGETS["warm_median"]),
        "warm_worst": _verdict(s["warm_worst"], TARGETS["warm_worst"]),
        "cold_median": _verdict(s["cold_median"], TARGETS["cold_median"]),
        "warm_kills": "met" if s["warm_kills"] == 0 and s["warm_failed_runs"] == 0 else "missed",
        "first_task_extra": _verdict(None if s["first_task_memchunk_median"] is None
                                     or s["first_task_static_median"] is None
                                     else s["first_task_memchunk_median"] - s["first_task_static_median"], 1.0),
    }
    for k in ("warm_median", "warm_worst", "cold_median", "cold_worst"):  # JSON has no infinity: None and a flag
        if s[k] is not None and math.isinf(s[k]):
            s[k], s[k + "_failed"] = None, True
    return s


def resummarize(doc: dict[str, Any]) -> dict[str, Any]:
    """A run's JSON with its per-workload and family figures computed again from its raw runs by this code."""
    for r in doc["results"]:
        ok = [x for x in r["sweep"] if x.get("completed")]
        r.update(summarize_workload(r, min(ok, key=lambda x: x["wall_seconds"]) if ok else None))
    doc["summary"] = summarize_family(doc["results"])
    return doc


def _verdict(value: float | None, limit: float) -> str:
    return "not measured" if value is None else ("met" if value <= limit else "missed")  # inf: missed


def table(results: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    def f(x: Any, fmt: str = "{:.2f}") -> str:
        return "-" if x is None else fmt.format(x)

    def ratio(x: Any, failed: bool) -> str:
        return "failed" if failed else f"{f(x)}x"

    def runs(xs: list) -> str:
        return ", ".join("failed" if x is None else f(x) for x in xs)

    rows = ["| workload | survey | workers | best static | warm / best (pairs) | cold / best | kills cold, warm |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        w = r["workload"]
        shape = "x".join(str(v) for v in Workload.from_dict(w).survey_shape)
        pairs = runs(r["warm_ratios"])
        rows.append(f"| {w['name']} | {shape} {w['source']} | 2 x {w['memory_limit_mib']} MiB x {w['threads']} | "
                    f"{r['best_static'] or '-'} {f(r['best_static_seconds'], '{:.1f} s')} | "
                    f"{ratio(r['warm_ratio'], r.get('warm_median_failed', False))} ({pairs}) | "
                    f"{ratio(r['cold_ratio'], r.get('cold_failed', False))} | {r['cold_kills']}, {r['warm_kills']} |")
    t = summary["targets"]
    rows += ["", f"warm: median {ratio(summary['warm_median'], summary.get('warm_median_failed', False))} "
                 f"({t['warm_median']}, target <= 0.95), worst "
                 f"{ratio(summary['warm_worst'], summary.get('warm_worst_failed', False))} ({t['warm_worst']}, "
                 f"target <= 1.15); cold: median "
                 f"{ratio(summary['cold_median'], summary.get('cold_median_failed', False))} ({t['cold_median']}, "
                 f"target <= 1.20); kills: cold {summary['cold_kills']}, warm "
                 f"{summary['warm_kills']}; failed memchunk runs: cold {summary.get('cold_failed_runs', 0)}, warm "
                 f"{summary.get('warm_failed_runs', 0)} ({t['warm_kills']}, target 0 kills, 0 failures warm)",
             f"flow call to first task (median): static {f(summary['first_task_static_median'])} s, memchunk warm "
             f"{f(summary['first_task_memchunk_median'])} s ({t['first_task_extra']}, target <= 1.0 s more)"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.family", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workloads", type=int, default=6)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--static", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="slab counts of the sweep")
    p.add_argument("--external", action="store_true", help="also one warm run on a cluster given by address")
    p.add_argument("--quick", action="store_true", help="the smallest workload, one pair, slabs 2 and 4 (CI)")
    p.add_argument("--only", nargs="*", default=None, help="run only workloads whose name starts with these")
    p.add_argument("--scale", type=int, default=1,
                   help="every survey with this many times its traces (a square: 4 doubles both line axes)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds one strategy may run; past it the run counts as failed (a worker paused over its "
                        "memory never finishes)")
    p.add_argument("--work", default=None, help="where inputs, stores and outputs go (default: a temporary dir)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    workloads = [quick()] if args.quick else family(args.seed, args.workloads)
    if args.only:
        workloads = [w for w in workloads if any(w.name.startswith(o) for o in args.only)]
    if args.scale != 1:
        try:
            workloads = [w.scaled(args.scale) for w in workloads]
        except ValueError as exc:
            p.error(str(exc))
    statics, pairs = ([2, 4], 1) if args.quick else (args.static, args.pairs)
    work = Path(args.work or tempfile.mkdtemp(prefix="memchunk-family-"))
    work.mkdir(parents=True, exist_ok=True)
    from benchmarks.__main__ import machine_info

    results = []
    started = time.time()
    machine = machine_info()
    with _server(work) as server_env:
        env = {k: v for k, v in server_env.items() if not k.startswith("MEMCHUNK_")}
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["MEMCHUNK_CACHE_DIR"] = str(work / "cache")  # the SEG-Y scans every strategy shares, kept with the run
        for w in workloads:
            results.append(run_workload(w, work, env, statics, pairs, args.external, args.timeout))
    summary = summarize_family(results)
    machine["loadavg_end"] = list(os.getloadavg())
    print()
    print(table(results, summary))
    if args.json:
        doc = {"benchmark": "family", "seed": args.seed, "quick": args.quick, "scale": args.scale, "started": started,
               "seconds": time.time() - started,
               "machine": machine, "summary": summary, "results": results}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


@contextlib.contextmanager
def _server(work: Path) -> Iterator[dict[str, str]]:
    """The environment of the children: the Prefect server of ``PREFECT_API_URL`` when one is set, else a local
    server started here for the whole family (and stopped after it)."""
    if os.environ.get("PREFECT_API_URL"):
        yield dict(os.environ)
        return
    from deployments.local_server import local_server

    with local_server(work / "prefect-home") as srv:
        yield dict(srv.env)


if __name__ == "__main__":
    sys.exit(main())
