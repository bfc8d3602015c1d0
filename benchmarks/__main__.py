"""Side by side: Dask auto-chunking, hand-tuned static chunks, split-on-failure and MemoryAwareRunner.

    python -m benchmarks [--quick] [--json PATH] [--plot PATH] [--workdir DIR] [--repeats N]
    python -m benchmarks report RUN.json... [--out BENCHMARKS.md]   # the results page (benchmarks.report)

On one local Dask cluster of single-thread worker processes with a real,
nanny-enforced ``memory_limit`` (``allowed-failures`` 0), every strategy runs
the same work — envelope -> gaussian_smooth -> gst3d_dip over a synthetic
survey sized so that gst3d_dip (about 42x its float32 input here) cannot run on
it in one piece under the limit — and the benchmark prints a table, writes the
JSON (``--json``) and a PNG plot (``--plot``, needs matplotlib). See
``benchmarks/strategies.py`` for what each strategy does and how each figure is
measured, and BENCHMARKS.md for the targets and the figures of a full run.
The static sweep and the memchunk/heuristic rows run in ``--repeats`` rounds
(default 3, ``--quick`` 1), each row the median run (``strategies.in_rounds``).

Also measured: the warm runner at 1x, 2x and 4x the volume (seconds per
element), and the runner's overhead over a plain ``DaskTaskRunner`` on identical
fixed chunking of a light operator (envelope), over repeated paired runs.

A Prefect API is needed: with no ``PREFECT_API_URL`` one local server is started
for the whole benchmark (``prefect_test_harness``), telemetry off.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Before Prefect is imported, here and (inherited) in every spawned worker: no network, quiet logs.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")


@dataclass(frozen=True)
class Config:
    shape: tuple[int, int, int]
    memory_limit: str
    n_workers: int
    static_counts: tuple[int, ...]
    overhead_chunks: int
    overhead_pairs: int
    scaling: tuple[int, ...]
    repeats: int  # rounds of the static sweep and the memchunk/heuristic rows (each row: the median run)


#: 128 x 128 x 400 float32 = 25 MiB: gst3d_dip in one piece needs ~1.05 GiB, over a 1 GiB worker.
FULL = Config(shape=(128, 128, 400), memory_limit="1GiB", n_workers=2, static_counts=(1, 2, 4, 8, 16),
              overhead_chunks=8, overhead_pairs=5, scaling=(1, 2, 4), repeats=3)
#: 64 x 96 x 400 = 9.4 MiB: ~400 MiB for gst3d_dip in one piece, over a 640 MiB worker's kill line (608 MiB)
#: with its ~200 MiB resting memory. A smoke test (one scaling point, one sweep point, one overhead pair): its
#: figures are not the benchmark's. The sweep point is 4 slabs: 12 plain tasks, each paying Prefect's task-run
#: start (about 1 s on 2 cores), whose peaks reach ~0.71 of the limit.
QUICK = Config(shape=(64, 96, 400), memory_limit="640MiB", n_workers=2, static_counts=(4,),
               overhead_chunks=8, overhead_pairs=1, scaling=(1,), repeats=1)

TARGETS = [
    ("memchunk-warm: 0 out-of-memory events", "warm_oom"),
    ("memchunk-warm: wall <= 1.05x static-best", "warm_vs_best"),
    ("learned policy: memchunk-warm no slower than heuristic-warm (within 5%)", "policy_warm"),
    ("learned policy: memchunk-cold no slower than heuristic-cold (within 5%)", "policy_cold"),
    ("memchunk-cold: wall <= 1.30x static-best", "cold_vs_best"),
    ("memchunk-cold: at most 1 out-of-memory event per operator", "cold_oom"),
    ("dask-auto fails on gst3d_dip, or memchunk-warm is no slower", "auto"),
    ("overhead ratio <= 1.05", "overhead"),
    ("time per element roughly flat 1x -> 4x (within 20%)", "scaling"),
    ("learning quality per operator: >= 95% within the bound, MAPE <= 10% after 5 runs, bound 1-1.25x the peak at "
     "the chunks chosen", "quality"),
]


def machine_info() -> dict[str, Any]:
    import dask
    import distributed
    import numpy
    import prefect
    import psutil

    return {
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {"prefect": prefect.__version__, "dask": dask.__version__,
                     "distributed": distributed.__version__, "numpy": numpy.__version__},
        "gpu": None,
        "loadavg_start": list(os.getloadavg()),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "commit": commit(),
    }


def commit() -> str:
    """The checkout's commit (short hash, ``+dirty`` with uncommitted changes to tracked files), or "" outside
    a git checkout: which code a result JSON measured."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+dirty" if dirty else "")


def evaluate(strategies: list[dict], overhead: dict, scaling: list[dict], n_operators: int) -> dict[str, dict]:
    from benchmarks.strategies import same_plans

    by = {s["name"]: s for s in strategies}
    best, warm = by.get("static-best"), by.get("memchunk-warm")
    cold, auto = by.get("memchunk-cold"), by.get("dask-auto")
    out: dict[str, dict] = {}

    def put(key: str, met: bool | None, figure: str) -> None:
        out[key] = {"met": met, "figure": figure}

    if warm:
        put("warm_oom", warm["completed"] and warm["oom_events"] == 0, f"{warm['oom_events']} events")
    if warm and best and warm["completed"]:
        r = warm["wall_seconds"] / best["wall_seconds"]
        put("warm_vs_best", r <= 1.05, f"{r:.2f}x ({warm['wall_seconds']:.1f} s vs {best['wall_seconds']:.1f} s, "
                                       f"{best.get('extra', {}).get('of', '?')})")
    if cold and best and cold["completed"]:
        r = cold["wall_seconds"] / best["wall_seconds"]
        put("cold_vs_best", r <= 1.30, f"{r:.2f}x ({cold['wall_seconds']:.1f} s vs {best['wall_seconds']:.1f} s)")
    if cold:
        put("cold_oom", cold["completed"] and cold["oom_events"] <= n_operators,
            f"{cold['oom_events']} events over {n_operators} operators")
    for phase, learned in (("warm", warm), ("cold", cold)):
        ablation = by.get(f"heuristic-{phase}")
        if learned and ablation and learned["completed"] and ablation["completed"]:
            r = learned["wall_seconds"] / ablation["wall_seconds"]
            same = "; the same plans in every round of both" if same_plans(learned, ablation) else ""
            put(f"policy_{phase}", r <= 1.05, f"{r:.2f}x ({learned['wall_seconds']:.1f} s vs "
                                              f"{ablation['wall_seconds']:.1f} s{same})")
    if auto and warm:
        if not auto["completed"]:
            put("auto", True, f"dask-auto failed ({auto['notes']})")
        else:
            r = warm["wall_seconds"] / auto["wall_seconds"]
            put("auto", r <= 1.0, f"dask-auto completed; memchunk-warm {r:.2f}x its wall")
    if overhead:
        put("overhead", overhead["overhead_ratio"] <= 1.05,
            f"{overhead['overhead_ratio']:.3f} (median of {len(overhead['ratios'])} pairs)")
    if len(scaling) >= 2 and all(s["completed"] for s in scaling):
        spe = [s["seconds_per_element"] for s in scaling]
        r = max(spe) / min(spe)
        put("scaling", r <= 1.2, " / ".join(f"{s['factor']}x {s['seconds_per_element'] * 1e6:.2f} us" for s in scaling)
            + f" (max/min {r:.2f})")
    return out


def table(strategies: list[dict]) -> str:
    head = (f"{'strategy':<18} {'done':<5} {'wall s':>8} {'OOM':>4} {'tasks':>6} {'lost w-s':>9} "
            f"{'peak/limit':>10}  notes")
    lines = [head, "-" * len(head)]
    for s in strategies:
        peak = "n/a" if s["peak_memory_fraction"] is None else f"{s['peak_memory_fraction']:.2f}"
        lines.append(f"{s['name']:<18} {'yes' if s['completed'] else 'NO':<5} {s['wall_seconds']:>8.1f} "
                     f"{s['oom_events']:>4d} {s['tasks']:>6d} {s['lost_worker_seconds']:>9.1f} {peak:>10}  "
                     f"{s.get('notes', '')}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    strategies = result["strategies"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5))
    ax = axes[0]
    names = [s["name"] for s in strategies]
    walls = [s["wall_seconds"] for s in strategies]
    colors = ["tab:green" if s["completed"] else "tab:red" for s in strategies]
    ax.barh(names, walls, color=colors)
    for i, s in enumerate(strategies):
        ax.text(walls[i], i, f" {s['oom_events']} OOM" if s["oom_events"] else "", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("wall seconds (red: did not complete)")
    ax.set_title("same pipeline, same cluster")
    ax = axes[1]
    ax.barh(names, [s["peak_memory_fraction"] or 0 for s in strategies], color=colors)
    ax.axvline(0.95, color="k", ls="--", lw=1)
    ax.text(0.95, len(names) - 0.5, " nanny kills", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("peak worker RSS / memory_limit")
    ax.set_yticklabels([])
    ax = axes[2]
    sc = [s for s in result["scaling"] if s["completed"]]
    if sc:
        ax.plot([s["factor"] for s in sc], [s["seconds_per_element"] * 1e6 for s in sc], "o-")
        ax.set_ylim(bottom=0)
    ax.set_xlabel("volume (x base survey)")
    ax.set_ylabel("microseconds per element")
    ov = result.get("overhead_ratio")
    ax.set_title("memchunk-warm scaling" + (f"; overhead ratio {ov:.3f}" if ov else ""))
    fig.suptitle(f"python -m benchmarks{' --quick' if result['config']['quick'] else ''}: "
                 f"{result['config']['shape']} survey, {result['config']['n_workers']} workers x "
                 f"{result['config']['memory_limit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


#: The block of the GPU section's per-operator comparison: (quick, full).
GPU_SHAPES = ((32, 32, 200), (128, 128, 400))


def gpu_section(quick: bool, workdir: Path) -> dict:
    """Every operator on the CPU and on the GPU side by side (``benchmarks.studies.operator_memory --device both``: each
    in a fresh process, seconds and memory multiples, the GPU's own peak beside the host's), then gst3d_dip over a
    survey too large for the GPU in one piece (``benchmarks.gpu``: dask-auto, a static sweep, memchunk cold and
    warm, checked against the CPU; in ``survey``), where this machine has a GPU work can run on
    (:func:`memchunk_prefect.run.pinning.usable_gpus`); ``{"skipped": why}`` elsewhere. The strategies above run on
    the CPU either way."""
    from benchmarks import gpu as gpu_survey
    from benchmarks.studies import operator_memory
    from memchunk_prefect.run.pinning import usable_gpus

    devices, found = usable_gpus()
    print(f"GPU section: {found}" + ("" if devices else ": skipped, the operators run on the CPU only"), flush=True)
    if not devices:
        return {"skipped": found}
    shape = GPU_SHAPES[0] if quick else GPU_SHAPES[1]
    from memchunk_prefect import operators

    rows = [operator_memory.run_in_subprocess(name, shape, device=device)
            for name in operators.OPERATORS for device in ("cpu", "cuda")]
    survey = gpu_survey.run(gpu_survey.QUICK if quick else gpu_survey.FULL, workdir / "gpu", quick, prefect_api=False)
    return {"found": found, "shape": list(shape), "rows": rows, "survey": survey}


def run(cfg: Config, quick: bool, workdir: Path) -> dict:
    from benchmarks import strategies as st
    from memchunk_prefect.operators.registry import DEFAULT_STEPS

    steps = [dict(s) for s in DEFAULT_STEPS]
    t_start = time.perf_counter()
    machine = machine_info()
    il, xl, nt = cfg.shape
    survey = st.make_survey(workdir / f"survey-{il}x{xl}x{nt}.sgy", cfg.shape)
    print(f"survey {cfg.shape} ({il * xl * nt * 4 / 2**20:.1f} MiB float32), {cfg.n_workers} workers x "
          f"{cfg.memory_limit}, steps: {st.STEPS_NOTE}", flush=True)
    bench = st.Bench(cfg.n_workers, cfg.memory_limit, workdir)
    results: list[st.StrategyResult] = []
    scaling: list[dict] = []
    overhead: dict = {}
    quality: list[dict] = []
    try:
        results.append(bench.measure("dask-auto", lambda: st.run_dask_auto(bench, survey, steps)))
        results.append(bench.measure("split-on-failure", lambda: st.run_split(bench, survey, steps)))
        store = str(workdir / "memchunk-store.sqlite")  # the first round's: scaling, overhead and quality use it

        def store_of(kind: str, r: int) -> str:
            """Each round's cold run starts from an empty store of its own."""
            return store if kind == "memchunk" and r == 0 else str(workdir / f"{kind}-store-{r}.sqlite")

        # The ablation (heuristic-*): the same runner with the learned policy off, on a store of its own.
        rows = st.in_rounds(bench, [(f"static-{n}", lambda n=n: st.run_static(bench, survey, steps, n, f"static-{n}"))
                                    for n in cfg.static_counts],
                            [(f"{kind}-{phase}", lambda r, k=kind, ph=phase: st.run_memchunk(
                                bench, survey, steps, store_of(k, r), f"{k}-{ph}-{r}", learned_policy=k == "memchunk"))
                             for kind in ("memchunk", "heuristic") for phase in ("cold", "warm")], cfg.repeats)
        statics = rows[:len(cfg.static_counts)]
        results[1:1] = [*statics, st.static_best(statics)]
        results += rows[len(cfg.static_counts):]
        warm = next(r for r in results if r.name == "memchunk-warm")

        elements = st.volume_elements(cfg.shape)
        for k in cfg.scaling:
            if k == 1:
                r, shape = warm, cfg.shape
            else:
                shape = (il * k, xl, nt)
                path = st.make_survey(workdir / f"survey-{shape[0]}x{xl}x{nt}.sgy", shape)
                r = bench.measure(f"memchunk-warm {k}x", lambda p=path, k=k: st.run_memchunk(
                    bench, p, steps, store, f"warm-{k}x"))
            scaling.append({"factor": k, "shape": list(shape), "elements": elements * k,
                            "wall_seconds": round(r.wall_seconds, 3), "completed": r.completed,
                            "oom_events": r.oom_events, "tasks": r.tasks,
                            "seconds_per_element": r.wall_seconds / (elements * k)})
            print(f"  scaling {k}x: {r.wall_seconds:.1f} s, {r.wall_seconds / (elements * k) * 1e6:.3f} us/element",
                  flush=True)
        overhead = st.overhead_pairs(bench, survey, store, cfg.overhead_chunks, cfg.overhead_pairs)
        # What was learned, over every run on the learned policy's store (cold, warm, scaling, overhead pairs).
        quality = st.learning_quality(store, warm.to_dict())
    finally:
        bench.close()
    gpu = gpu_section(quick, workdir)
    machine["loadavg_end"] = list(os.getloadavg())
    machine["memory_limit_bytes"] = bench.memory_limit
    strategies = [r.to_dict() for r in results]
    out = {
        "gpu": gpu,
        "strategies": strategies,
        "overhead_ratio": round(overhead["overhead_ratio"], 4) if overhead else None,
        "overhead": overhead,
        "scaling": scaling,
        "learning_quality": quality,
        "machine": machine,
        "config": {"quick": quick, "shape": list(cfg.shape), "memory_limit": cfg.memory_limit,
                   "n_workers": cfg.n_workers, "threads_per_worker": 1, "allowed_failures": 0,
                   "static_counts": list(cfg.static_counts), "overhead_chunks": cfg.overhead_chunks,
                   "overhead_pairs": cfg.overhead_pairs, "repeats": cfg.repeats, "steps": steps},
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    targets = evaluate(strategies, overhead, scaling, len(steps))
    if quality:
        missed = [q["operator"] for q in quality if not q["met"]]
        targets["quality"] = {"met": not missed, "figure": (f"every operator ({len(quality)})" if not missed
                                                             else f"missed by {', '.join(missed)}")}
    out["targets"] = {label: targets.get(key, {"met": None, "figure": "not measured"}) for label, key in TARGETS}
    return out


def finish(result: dict, json_path: str | None) -> int:
    """A benchmark's last lines: its total seconds, and its JSON written to ``json_path`` when given; 0."""
    print(f"\ntotal {result['total_seconds']:.0f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"JSON written to {json_path}")
    return 0


def _prefect_api():
    """A local Prefect server for the whole benchmark unless PREFECT_API_URL is set; says which it uses."""
    import contextlib

    if os.environ.get("PREFECT_API_URL"):
        print(f"using the Prefect API at {os.environ['PREFECT_API_URL']}", flush=True)
        return contextlib.nullcontext()
    from prefect.testing.utilities import prefect_test_harness

    print("starting a local Prefect server", flush=True)
    return prefect_test_harness(server_startup_timeout=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # python -m benchmarks report RUN.json...: the results page
        from benchmarks.report import main as report

        return report(argv[1:])
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller survey and sweep, fewer paired runs (CI smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    p.add_argument("--workdir", metavar="DIR", help="where surveys and outputs go (default: a temporary directory)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="rounds of the static sweep and the memchunk/heuristic rows, each row the median run "
                        "(default 3; --quick 1)")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            p.error(f"--repeats must be at least 1, got {args.repeats}")
        cfg = dataclasses.replace(cfg, repeats=args.repeats)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="memchunk-bench-")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tasks` and `flows` beside the package
    try:
        with _prefect_api():
            result = run(cfg, args.quick, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(result["strategies"]))
    print()
    if result["overhead"]:
        o = result["overhead"]
        print(f"overhead ratio (MemoryAwareRunner / DaskTaskRunner, envelope, {o['chunks']} identical chunks): "
              f"{o['overhead_ratio']:.3f} median of {len(o['ratios'])} pairs "
              f"({', '.join(f'{r:.3f}' for r in o['ratios'])}); identical chunking: {o['identical_chunking']}")
    for s in result["scaling"]:
        print(f"scaling {s['factor']}x {tuple(s['shape'])}: {s['wall_seconds']:.1f} s, "
              f"{s['seconds_per_element'] * 1e6:.3f} us per element")
    if result.get("learning_quality"):
        from benchmarks.strategies import quality_table

        print("\nwhat was learned, over every run on the learned policy's store (bound/peak chosen: memchunk-warm's "
              "chunks, the model's figures when each was submitted):")
        print(quality_table(result["learning_quality"]))
    print()
    for label, v in result["targets"].items():
        verdict = {True: "MET   ", False: "MISSED", None: "n/a   "}[v["met"]]
        print(f"  {verdict} {label}: {v['figure']}")
    gpu = result["gpu"]
    if gpu.get("rows"):
        from benchmarks.studies.operator_memory import format_table

        print(f"\nevery operator on the CPU and on the GPU ({gpu['found']}), one {' x '.join(map(str, gpu['shape']))} "
              "float32 block each, in a fresh process:")
        print(format_table(gpu["rows"], markdown=False))
        from benchmarks.gpu import format_report

        print("\n" + format_report(gpu["survey"]))
    else:
        print(f"\nGPU section skipped: {gpu['skipped']}")
    m = result["machine"]
    print(f"\n{m['cpus']} cpus, {m['memory_bytes'] / 2**30:.1f} GiB, load average at start "
          f"{m['loadavg_start'][0]:.2f}, at end {m['loadavg_end'][0]:.2f}; total {result['total_seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
        print(f"JSON written to {args.json}")
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
