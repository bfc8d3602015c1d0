"""A workload where no single static chunking is right: four operators of very different memory growth, two surveys.

    python -m benchmarks.heterogeneous [--quick] [--json PATH] [--workdir DIR] [--repeats N]

The chain, over each survey (the same local cluster as ``python -m benchmarks``:
single-thread worker processes with a nanny-enforced ``memory_limit``,
``allowed-failures`` 0):

- ``envelope``: linear and light (about 16 bytes per element, no halo);
- ``trace_correlation``: memory quadratic in the traces per chunk (a dense
  Gram matrix of all the chunk's traces: 8 N^2 bytes for N traces);
- ``gaussian_smooth`` with sigma 6 on every axis: a large halo (24 samples each
  side), so thin chunks read several times their own size;
- ``gst3d_dip``: linear and heavy (about 40-60x its float32 input).

Whole-volume slabs suit envelope and gaussian_smooth (few halos, few tasks),
trace_correlation wants many small chunks (its Gram matrix grows with the square
of their traces, and so does its time), and gst3d_dip wants the largest chunk
that fits. The oracle per survey is the best single static N (the same N
iline slabs for every operator) found by the sweep; strategies that do not
complete (a static N too coarse for trace_correlation or gst3d_dip) are listed.

Rows per survey: ``static-N`` for each N, ``static-best``, ``memchunk-cold``
(an empty store), ``memchunk-warm`` (the same store again), and the ablation
``heuristic-cold`` / ``heuristic-warm`` (the learned policy off, a store of its
own). Every row is the median of ``--repeats`` rounds (default 3; statics far
behind the fastest run once: ``benchmarks.strategies.in_rounds``), each round's
cold runs on empty stores of their own. Each survey gets fresh stores: what is learned on one survey is not
carried to the next (that is ``python -m benchmarks``'s scaling rows).

Targets (a learned decision policy that beats hand tuning):
memchunk-warm <= 0.85x static-best on every survey; memchunk-cold <= 1.10x;
the learned policy no slower than the heuristic (within 5%) on either.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.__main__ import _prefect_api, finish, machine_info, table

HETERO_STEPS: list[dict[str, Any]] = [
    {"name": "envelope"},
    {"name": "trace_correlation", "radius": [1, 1]},
    {"name": "gaussian_smooth", "sigma": [6.0, 6.0, 6.0]},
    {"name": "gst3d_dip"},
]
#: Many short traces: trace_correlation's Gram matrix (8 N^2 bytes for N traces per chunk) needs at least 8
#: chunks on the first (36,864 traces) and 4 on the second (32,768), while the others fit in one per slot.
#: (On 128 x 128 x 400 and 64 x 96 x 400, tried first, every operator fits in 2 chunks: static-2 is right for
#: all of them and the workload is not heterogeneous; that run is reported in BENCHMARKS.md.)
SURVEYS_FULL = ((192, 192, 100), (256, 128, 200))
SURVEYS_QUICK = ((48, 64, 400),)
STATIC_FULL = (1, 2, 4, 8, 16, 32)
STATIC_QUICK = (2, 8)
MEMORY_LIMIT = "1GiB"
N_WORKERS = 2

TARGETS = [
    ("memchunk-warm <= 0.85x static-best", "warm", 0.85),
    ("memchunk-cold <= 1.10x static-best", "cold", 1.10),
]


def run_survey(bench: Any, shape: tuple[int, int, int], statics: tuple[int, ...], workdir: Path,
               repeats: int = 1) -> dict:
    from benchmarks import strategies as st

    steps = [dict(s) for s in HETERO_STEPS]
    il, xl, nt = shape
    tag = f"{il}x{xl}x{nt}"
    survey = st.make_survey(workdir / f"survey-{tag}.sgy", shape)
    print(f"survey {shape} ({il * xl * nt * 4 / 2**20:.1f} MiB float32)", flush=True)

    def store_of(name: str, r: int) -> str:
        """Each round's cold run starts from an empty store of its own (the first round's is the one reported)."""
        return str(workdir / (f"{name}-{tag}.sqlite" if r == 0 else f"{name}-{tag}-{r}.sqlite"))

    rows = st.in_rounds(bench, [(f"static-{n}", lambda n=n: st.run_static(bench, survey, steps, n,
                                                                          f"static-{n}-{tag}")) for n in statics],
                        [(f"{name}-{phase}", lambda r, p=phase, lp=learned, n=name: (
                            st.run_memchunk(bench, survey, steps, store_of(n, r), f"{n}-{p}-{tag}-{r}",
                                            learned_policy=lp)))
                         for name, learned in (("memchunk", True), ("heuristic", False))
                         for phase in ("cold", "warm")], repeats)
    best = st.static_best(rows[:len(statics)])
    results = [*rows[:len(statics)], best, *rows[len(statics):]]
    warm = next(r for r in results if r.name == "memchunk-warm")
    quality = st.learning_quality(str(workdir / f"memchunk-{tag}.sqlite"), warm.to_dict())
    reach = st.per_operator_best(rows[:len(statics)], [s["name"] for s in steps])
    if reach and best.completed:
        reach["over_static_best"] = round(reach["seconds"] / best.wall_seconds, 3)
    return {"shape": list(shape), "strategies": [r.to_dict() for r in results], "learning_quality": quality,
            "per_operator_best": reach}


def reach_lines(survey: dict) -> list[str]:
    """The per-operator best of the sweep (:func:`benchmarks.strategies.per_operator_best`) step by step, beside
    memchunk-warm's and static-best's step walls: where a warm run's time goes, and what chunk counts alone
    could have saved."""
    reach = survey.get("per_operator_best")
    if not reach:
        return []
    by = {r["name"]: r for r in survey["strategies"]}
    best = by.get("static-best", {})
    best_steps = by.get(best.get("extra", {}).get("of"), {}).get("extra", {}).get("step_seconds") or []
    warm_steps = by.get("memchunk-warm", {}).get("extra", {}).get("step_seconds") or []
    ratio = reach.get("over_static_best")
    lines = [f"per-operator best of the sweep (each operator at its own fastest static N that reached it; derived, "
             f"not run): {reach['seconds']:.1f} s" + (f", {ratio:.2f}x static-best" if ratio is not None else "")]
    lines.append(f"  {'step':20s} {'best N':>10s} {'its s':>6s} {'static-best s':>13s} {'memchunk-warm s':>15s}  "
                 "no wall from (failed at or before it)")
    for i, step in enumerate(reach["steps"]):
        b = f"{best_steps[i]:.2f}" if i < len(best_steps) else "-"
        w = f"{warm_steps[i]:.2f}" if i < len(warm_steps) else "-"
        lines.append(f"  {step['step']:20s} {step['of']:>10s} {step['seconds']:6.2f} {b:>13s} {w:>15s}  "
                     f"{', '.join(step.get('not_reached', [])) or '-'}")
    return lines


def evaluate(surveys: list[dict]) -> dict[str, dict]:
    """Each target over every survey: met only if met on all."""
    from benchmarks.strategies import same_plans

    out: dict[str, dict] = {}
    for label, phase, limit in TARGETS:
        figures, met = [], True
        for s in surveys:
            by = {r["name"]: r for r in s["strategies"]}
            best, mine = by.get("static-best"), by.get(f"memchunk-{phase}")
            if not best or not best["completed"] or not mine or not mine["completed"]:
                met = False
                figures.append(f"{tuple(s['shape'])}: not completed")
                continue
            r = mine["wall_seconds"] / best["wall_seconds"]
            met = met and r <= limit
            reach = (s.get("per_operator_best") or {}).get("over_static_best")
            figures.append(f"{tuple(s['shape'])}: {r:.2f}x ({mine['wall_seconds']:.1f} s vs "
                           f"{best['wall_seconds']:.1f} s, {best['extra'].get('of')}"
                           + (f"; per-operator best of the N that reached each step {reach:.2f}x"
                              if reach is not None else "") + ")")
        out[label] = {"met": met, "figure": "; ".join(figures)}
    for phase in ("warm", "cold"):
        figures, met = [], True
        for s in surveys:
            by = {r["name"]: r for r in s["strategies"]}
            mine, ablation = by.get(f"memchunk-{phase}"), by.get(f"heuristic-{phase}")
            if not mine or not ablation or not (mine["completed"] and ablation["completed"]):
                met = False
                continue
            r = mine["wall_seconds"] / ablation["wall_seconds"]
            met = met and r <= 1.05
            same = " (the same plans in every round of both)" if same_plans(mine, ablation) else ""
            figures.append(f"{tuple(s['shape'])}: {r:.2f}x{same}")
        out[f"learned policy no slower than the heuristic, {phase} (within 5%)"] = {
            "met": met, "figure": "; ".join(figures) or "not measured"}
    missed = [f"{q['operator']} on {tuple(s['shape'])}{_floor_note(q)}" for s in surveys
              for q in s.get("learning_quality", []) if not q["met"]]
    out["learning quality per operator: >= 95% within the bound, MAPE <= 10% after 5 runs, bound 1-1.25x the "
        "peak at the chunks chosen"] = {
        "met": not missed and all(s.get("learning_quality") for s in surveys),
        "figure": f"missed by {', '.join(missed)}" if missed else "every operator on every survey"}
    return out


def _floor_note(q: dict) -> str:
    """What repeated blocks of the operator say no model could beat (empty when no block shape ran twice)."""
    if q.get("floor_mape") is None:
        return ""
    return (f" (repeated blocks' floor: MAPE {q['floor_mape'] * 100:.1f}%, "
            f"bound {q['floor_bound_over_peak']:.2f}x the peak)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.heterogeneous", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one small survey, two static counts (a smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--workdir", metavar="DIR", help="where surveys and outputs go (default: a temporary directory)")
    p.add_argument("--repeats", type=int, metavar="N",
                   help="rounds of the static sweep and the memchunk/heuristic rows per survey, each row the median "
                        "run (default 3; --quick 1)")
    args = p.parse_args(argv)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if repeats < 1:
        p.error(f"--repeats must be at least 1, got {repeats}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="memchunk-hetero-")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tasks` and `flows` beside the package
    from benchmarks import strategies as st

    surveys_cfg = SURVEYS_QUICK if args.quick else SURVEYS_FULL
    statics = STATIC_QUICK if args.quick else STATIC_FULL
    t0 = time.perf_counter()
    machine = machine_info()
    surveys: list[dict] = []
    try:
        with _prefect_api():
            bench = st.Bench(N_WORKERS, MEMORY_LIMIT, workdir)
            try:
                for shape in surveys_cfg:
                    surveys.append(run_survey(bench, shape, statics, workdir, repeats))
            finally:
                bench.close()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"steps": HETERO_STEPS, "surveys": surveys, "machine": machine, "quick": args.quick,
              "memory_limit": MEMORY_LIMIT, "n_workers": N_WORKERS, "static_counts": list(statics), "repeats": repeats,
              "targets": evaluate(surveys), "total_seconds": round(time.perf_counter() - t0, 1)}
    for s in surveys:
        print(f"\nsurvey {tuple(s['shape'])}")
        print(table(s["strategies"]))
        if s.get("learning_quality"):
            print("what was learned (memchunk's store: cold then warm; bound/peak chosen: memchunk-warm's chunks):")
            print(st.quality_table(s["learning_quality"]))
        for line in reach_lines(s):
            print(line)
    print()
    for label, v in result["targets"].items():
        verdict = {True: "MET   ", False: "MISSED", None: "n/a   "}[v["met"]]
        print(f"  {verdict} {label}: {v['figure']}")
    return finish(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
