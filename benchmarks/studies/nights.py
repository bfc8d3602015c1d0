"""The learned policy against the fixed heuristic over many nights: does what it learns from rewards pay?

    python -m benchmarks.studies.nights [--workload heterogeneous|pipeline] [--quick] [--nights N] [--survey IL XL NT]
                                [--json PATH] [--workdir DIR]

A workload on each of its surveys: ``heterogeneous`` (the default: ``python -m
benchmarks.heterogeneous``'s envelope, trace_correlation, gaussian_smooth,
gst3d_dip over its two surveys) or ``pipeline`` (``python -m benchmarks``'s
envelope, gaussian_smooth, gst3d_dip over 128 x 128 x 400), on 2 single-thread
workers x 1 GiB (``--quick``: 640 MiB for the pipeline, as its quick form), two
stores side by side: the learned policy's and the fixed heuristic's
(``learned_policy=False``). Night 0 is cold for both (empty
stores); nights 1..N are warm, each on a fresh cluster, the two runs of a night
back to back in alternating order so a slow spell of the host falls on both.

A learned policy must explore before it can exploit: its burn-in plays each arm
whose plan differs once (``memchunk_prefect.core.bandit``), so its first warm nights
cost what those plans cost. This benchmark reports both sides of that:

- **settled nights**: the warm nights on which no operator's arm was played for
  burn-in or exploration; the learned policy against the heuristic there (the
  median of the per-night ratios, and the ratio of the median walls) is what it
  earns once it has learned;
- **every warm night**: the sum of walls, exploration included (its cost);
- per operator, what each arm's plan earned (pulls and mean reward, the slot
  efficiency of ``bandit.reward_of``) and the plan the policy settled on.

The heuristic learns its memory and time models from the same nights; only the
choice among plans differs. ``--granularity`` gives the learned policy its
``finer`` / ``coarser`` arms (off by default; ``PolicySettings.granularity_arms``).
Issue target: the learned policy no slower than the heuristic (within 5%) on
either workload, and faster on at least one.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# benchmarks.__main__ (and benchmarks.heterogeneous, which imports it) set Prefect's and Dask's logging in
# os.environ when imported: imported where the benchmark runs, not here, so that importing this module (the
# tests read its pure functions) changes nothing for the process or the subprocesses it starts.


def workload(name: str, quick: bool) -> tuple[list[dict], list[tuple[int, int, int]], str, int]:
    """``(steps, surveys, memory_limit, n_workers)`` of a workload, as the benchmark that defines it runs it."""
    from benchmarks.__main__ import FULL, QUICK
    from benchmarks.heterogeneous import HETERO_STEPS, MEMORY_LIMIT, N_WORKERS, SURVEYS_FULL, SURVEYS_QUICK

    if name == "pipeline":
        from memchunk_prefect.operators.registry import DEFAULT_STEPS

        cfg = QUICK if quick else FULL
        return [dict(s) for s in DEFAULT_STEPS], [cfg.shape], cfg.memory_limit, cfg.n_workers
    return ([dict(s) for s in HETERO_STEPS], list(SURVEYS_QUICK if quick else SURVEYS_FULL), MEMORY_LIMIT,
            N_WORKERS)

NIGHTS_FULL = 10
NIGHTS_QUICK = 2
EXPLORING = ("burn-in", "explore")
"""Why-words (``bandit.ArmChoice.why``) of an arm played to learn, not because it was the best known."""


def plans_of(run: dict) -> dict[str, dict]:
    """Per operator in one run: its arms, why they were played, its chunks and decisions."""
    ops = run.get("extra", {}).get("operators", {})
    return {op: {"arms": v.get("arms", []), "why": v.get("arm_why", []), "chunks": v["chunks"],
                 "decisions": v["decisions"]} for op, v in ops.items()}


def exploring(run: dict) -> list[str]:
    """The operators whose arm was played to learn in this run (burn-in or exploration)."""
    return [op for op, v in plans_of(run).items() if any(w in EXPLORING for w in v["why"])]


def run_survey(bench: Any, steps: list[dict], shape: tuple[int, int, int], nights: int, workdir: Path,
               granularity: bool = False) -> dict:
    from benchmarks import strategies as st

    tag = "x".join(str(n) for n in shape)
    survey = st.make_survey(workdir / f"survey-{tag}.sgy", shape)
    stores = {"learned": str(workdir / f"learned-{tag}.sqlite"), "heuristic": str(workdir / f"heuristic-{tag}.sqlite")}
    print(f"survey {shape}: night 0 cold, nights 1-{nights} warm", flush=True)
    rows: list[dict] = []
    for night in range(nights + 1):
        order = ("learned", "heuristic") if night % 2 == 0 else ("heuristic", "learned")
        row: dict[str, Any] = {"night": night}
        for name in order:
            r = bench.measure(f"{name} night {night}", lambda n=name, k=night: st.run_memchunk(
                bench, survey, steps, stores[n], f"{n}-{tag}-{k}", learned_policy=n == "learned",
                granularity_arms=granularity and n == "learned"))
            row[name] = r.to_dict()
        row["learning"] = exploring(row["learned"]) if row["learned"]["completed"] else []
        rows.append(row)
    return {"shape": list(shape), "nights": rows, "summary": summarize(rows), "arms": arm_summary(stores["learned"])}


def summarize(rows: list[dict]) -> dict:
    """The learned policy against the heuristic on the settled nights and over every warm night."""
    warm = [r for r in rows if r["night"] > 0 and r["learned"]["completed"] and r["heuristic"]["completed"]]
    settled = [r for r in warm if not r["learning"]]

    def walls(rs: list[dict], name: str) -> list[float]:
        return [float(r[name]["wall_seconds"]) for r in rs]

    out: dict[str, Any] = {"warm_nights": len(warm), "settled_nights": [r["night"] for r in settled],
                           "incomplete_nights": [r["night"] for r in rows if r not in warm and r["night"] > 0],
                           "oom_learned_warm": sum(int(r["learned"]["oom_events"]) for r in warm),
                           "oom_heuristic_warm": sum(int(r["heuristic"]["oom_events"]) for r in warm)}
    if warm:
        out["warm_total_learned"] = round(sum(walls(warm, "learned")), 2)
        out["warm_total_heuristic"] = round(sum(walls(warm, "heuristic")), 2)
        out["warm_total_ratio"] = round(out["warm_total_learned"] / out["warm_total_heuristic"], 3)
    if settled:
        from benchmarks.strategies import same_plans

        # Nights on which both ran one and the same plan: their walls differ by the host, not the policy.
        out["settled_same_plans"] = [r["night"] for r in settled if same_plans(r["learned"], r["heuristic"])]
        ratios = [a / b for a, b in zip(walls(settled, "learned"), walls(settled, "heuristic"))]
        out["settled_median_ratio"] = round(statistics.median(ratios), 3)
        out["settled_median_learned"] = round(statistics.median(walls(settled, "learned")), 2)
        out["settled_median_heuristic"] = round(statistics.median(walls(settled, "heuristic")), 2)
        out["settled_ratio_of_medians"] = round(out["settled_median_learned"] / out["settled_median_heuristic"], 3)
    return out


def arm_summary(store: str) -> dict[str, list[dict]]:
    """Per operator key of the learned store: each arm's plans taught, mean reward and out-of-memory events."""
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.learn.store import Store

    with Store(store) as s:
        bank = ModelBank(s)
        return {key: bank.learner(key).summary() for key in s.keys()}


def _plan_of(knowledge: Any, run: Any, read_range: Any = None) -> Any:
    """The plan the planner makes for a stored map record from ``knowledge`` (None where nothing fits)."""
    from memchunk_prefect.core import policy
    from memchunk_prefect.core.errors import BudgetError
    from memchunk_prefect.core.estimates import Estimates

    try:
        estimates = Estimates(predict=knowledge.predict, seconds_per_element=knowledge.seconds_per_element(),
                              seconds_for=knowledge.seconds_for)
        return policy.plan(tuple(run.shape), budget_bytes=int(run.budget_bytes), estimates=estimates,
                           halo=tuple(run.halo), slots=int(run.slots), read_range=read_range)
    except BudgetError:
        return None


def replay_rewards(store: str) -> list[dict]:
    """Every reward in ``store``, oldest first per operator key, beside what the planner estimated that night.

    For each reward: the arm played, the chunks and wall seconds of its plan, its reward; and, from a model
    rebuilt on the observations recorded before that map started, the ``safe`` plan's chunk count and
    estimated seconds and the ``finer`` / ``coarser`` neighbours' (None where none fits), each estimate over
    the safe one's. The map's shape, halo, slots and budget are its stored record's (the budget at its start,
    before any drift), plans keep whole traces and the upstream chunking is not weighed (a night whose map
    continued its input can show a different count): a reading of which plans the model saw, and how far its
    estimate was from the wall the played plan took.
    """
    import math
    import os

    from memchunk_prefect.core import bandit
    from memchunk_prefect.core.chunks import with_halo
    from memchunk_prefect.core.settings import DEFAULT_SETTINGS
    from memchunk_prefect.learn.bank import BankKnowledge, ModelBank
    from memchunk_prefect.learn.store import Store

    out: list[dict] = []
    with Store(store) as s, tempfile.TemporaryDirectory() as tmp:
        maps = s.maps()
        for key in s.keys():
            observations = s.observations(key)
            for n, r in enumerate(s.rewards(key)):
                runs = [m for m in maps if m.operator_key == key and m.started_at <= r.created_at]
                if not runs:
                    continue
                m = max(runs, key=lambda x: x.started_at)
                path = os.path.join(tmp, f"{n}-{len(out)}.sqlite")
                with Store(path) as t:
                    t.add_many([o for o in observations if o.created_at < m.started_at])
                    kn = BankKnowledge(ModelBank(t), key, DEFAULT_SETTINGS)
                    shape, halo = tuple(m.shape), tuple(m.halo)
                    safe = _plan_of(kn, m)
                    row: dict[str, Any] = {"key": key, "arm": r.arm, "chunks": r.n_chunks,
                                           "wall_seconds": round(r.wall_seconds, 3), "reward": round(r.reward, 3)}
                    if safe is not None and not safe.probe and safe.estimated_seconds:
                        read = max(math.prod(with_halo(c, halo, shape)[0].shape) for c in safe.chunks)
                        row["safe"] = [safe.n_chunks, round(safe.estimated_seconds, 3)]
                        for arm in bandit.GRANULARITY_ARMS:
                            alt = _plan_of(kn, m, bandit.read_range(arm, read))
                            row[arm] = None if alt is None or not alt.estimated_seconds else [
                                alt.n_chunks, round(alt.estimated_seconds / safe.estimated_seconds, 3)]
                    out.append(row)
    return out


def night_line(r: dict) -> str:
    def side(name: str) -> str:
        run = r[name]
        if not run["completed"]:
            return f"{name} FAILED ({run['notes']})"
        ops = ", ".join(f"{op} {'/'.join(v['arms']) or '-'}{'*' if op in r['learning'] and name == 'learned' else ''}"
                        f" {v['chunks']}" for op, v in plans_of(run).items())
        return f"{name} {run['wall_seconds']:6.1f} s oom {run['oom_events']} [{ops}]"

    return f"night {r['night']:>2}: {side('learned')} | {side('heuristic')}"


def verdict(s: dict) -> str:
    if "settled_median_ratio" not in s:
        return "no settled night: the learned policy was still exploring on every warm night (run more nights)"
    same = s.get("settled_same_plans") or []
    same_note = (f"; the same plans as the heuristic on {len(same)} of them ({same})" if same else
                 "; plans differing from the heuristic's on every one")
    return (f"settled nights {s['settled_nights']}: learned / heuristic median of per-night ratios "
            f"{s['settled_median_ratio']:.2f}x (medians {s['settled_median_learned']:.1f} s vs "
            f"{s['settled_median_heuristic']:.1f} s{same_note}); every warm night, exploration included: "
            f"{s['warm_total_ratio']:.2f}x ({s['warm_total_learned']:.1f} s vs {s['warm_total_heuristic']:.1f} s); "
            f"out-of-memory events warm: {s['oom_learned_warm']} learned, {s['oom_heuristic_warm']} heuristic")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.nights", description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("heterogeneous", "pipeline"), default="heterogeneous",
                   help="python -m benchmarks.heterogeneous's chain and surveys (default), or python -m benchmarks'")
    p.add_argument("--granularity", action="store_true",
                   help="the learned policy with its granularity arms (PolicySettings.granularity_arms; off by "
                        "default)")
    p.add_argument("--quick", action="store_true", help="one small survey, 2 warm nights (a smoke test)")
    p.add_argument("--nights", type=int, metavar="N", help=f"warm nights per survey (default {NIGHTS_FULL}; "
                                                           f"--quick {NIGHTS_QUICK})")
    p.add_argument("--survey", type=int, nargs=3, metavar=("IL", "XL", "NT"),
                   help="one survey of this shape instead of the heterogeneous benchmark's")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--workdir", metavar="DIR", help="where surveys, stores and outputs go (default: temporary)")
    p.add_argument("--rewards", metavar="STORE",
                   help="instead of running: every reward in a kept store beside the plans the planner estimated "
                        "that night (replay_rewards)")
    args = p.parse_args(argv)
    if args.rewards:
        if not Path(args.rewards).is_file():
            p.error(f"--rewards: no store at {args.rewards}")
        for row in replay_rewards(args.rewards):
            print(json.dumps(row))
        return 0
    nights = args.nights if args.nights is not None else (NIGHTS_QUICK if args.quick else NIGHTS_FULL)
    if nights < 1:
        p.error(f"--nights must be at least 1, got {nights}")
    if args.survey and min(args.survey) < 1:
        p.error(f"--survey needs three positive extents, got {args.survey}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="memchunk-nights-")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tasks` and `flows` beside the package
    from benchmarks import strategies as st
    from benchmarks.__main__ import _prefect_api, finish, machine_info

    steps, shapes, memory_limit, n_workers = workload(args.workload, args.quick)
    if args.survey:
        shapes = [tuple(args.survey)]  # type: ignore[list-item]
    t0 = time.perf_counter()
    machine = machine_info()
    surveys: list[dict] = []
    try:
        with _prefect_api():
            bench = st.Bench(n_workers, memory_limit, workdir)
            try:
                for shape in shapes:
                    surveys.append(run_survey(bench, steps, shape, nights, workdir, args.granularity))
            finally:
                bench.close()
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"workload": args.workload, "granularity_arms": args.granularity, "steps": steps, "surveys": surveys,
              "machine": machine, "quick": args.quick,
              "nights": nights, "memory_limit": memory_limit, "n_workers": n_workers,
              "total_seconds": round(time.perf_counter() - t0, 1)}
    for s in surveys:
        print(f"\nsurvey {tuple(s['shape'])} (* an arm played to learn: burn-in or exploration)")
        for r in s["nights"]:
            print(night_line(r))
        for key, arms in s["arms"].items():
            played = ", ".join(f"{a['arm']} {a['mean_reward']:.2f}x{a['pulls']}" + (f"!{a['out_of_memory']}"
                                                                                   if a["out_of_memory"] else "")
                               for a in arms if a["pulls"])
            print(f"  {key}: {played or '-'}")
        print("  " + verdict(s["summary"]))
    return finish(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
