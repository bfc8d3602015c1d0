"""Consecutive runs of the benchmark pipeline on one store: how plans, arms and walls evolve night after night.

    python -m benchmarks.consecutive [--runs N] [--heuristic] [--json PATH]

The cluster and survey of ``python -m benchmarks`` (2 single-thread workers x
1 GiB, 128 x 128 x 400), the pipeline run ``--runs`` times (default 5) on one
fresh store; ``--heuristic`` switches the learned policy off. Prints, per run,
the wall, out-of-memory events, each operator's chunks and the arm it played,
then what each operator's bandit and model learned.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from benchmarks.__main__ import FULL, _prefect_api


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.consecutive", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="how many runs on the one store (default 5)")
    p.add_argument("--heuristic", action="store_true", help="the learned policy off (the fixed heuristic)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tasks` and `flows` beside the package
    from benchmarks import strategies as st
    from flows.pipeline import DEFAULT_STEPS
    from memchunk_prefect.model import ModelBank
    from memchunk_prefect.store import Store

    work = Path(tempfile.mkdtemp(prefix="memchunk-consecutive-"))
    runs = []
    try:
        with _prefect_api():
            bench = st.Bench(FULL.n_workers, FULL.memory_limit, work)
            survey = st.make_survey(work / "survey.sgy", FULL.shape)
            store = str(work / "store.sqlite")
            try:
                for k in range(args.runs):
                    r = bench.measure(f"run {k + 1}", lambda k=k: st.run_memchunk(
                        bench, survey, [dict(s) for s in DEFAULT_STEPS], store, f"run{k}",
                        learned_policy=not args.heuristic))
                    runs.append(r.to_dict())
            finally:
                bench.close()
        learned = {}
        with Store(store) as s:
            bank = ModelBank(s)
            for key in s.keys():
                summary = bank.model(key).summary()
                learned[key] = {"policy": bank.learner(key).summary(),
                                **{f: summary[f] for f in ("margin", "recent_mape", "form", "time_form")}}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    for k, r in enumerate(runs, start=1):
        arms = {op: v["arms"] for op, v in r["extra"].get("operators", {}).items()}
        print(f"run {k}: {r['wall_seconds']:.1f} s, {r['oom_events']} out-of-memory; {r['notes']}; arms {arms}")
    for key, v in learned.items():
        played = ", ".join(f"{a['arm']} {a['mean_reward']:.2f}x{a['pulls']}" for a in v["policy"] if a["pulls"])
        margin = "-" if v["margin"] is None else f"{v['margin']:.3f}"
        print(f"{key}: policy {played or '-'}; margin {margin}; form {v['form']}, time {v['time_form']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "learned": learned, "heuristic": args.heuristic}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
