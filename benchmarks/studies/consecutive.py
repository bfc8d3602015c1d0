"""Consecutive runs of the pipeline on one store: plans, arms, walls and the store, night after night.

    python -m benchmarks.studies.consecutive [--runs N] [--heuristic] [--keep ROWS] [--quick] [--json PATH]

The cluster and survey of ``python -m benchmarks`` (2 single-thread workers x
1 GiB, 128 x 128 x 400; ``--quick``: its quick form, 640 MiB workers and 64 x
96 x 400, a smoke test), the pipeline run ``--runs`` times (default 5; the
"thirty nights" is ``--runs 30``) on one fresh store, a fresh cluster
each night; ``--heuristic`` switches the learned policy off. Prints, per run,
the wall, out-of-memory events, each operator's chunks and the arm it played,
each model's recent relative error, the store's size (the database file, and
its WAL beside it) and rows, and what this process holds (open file
descriptors, threads, entries in the temporary directory: anything else
writing there counts too); then whether decisions settled (the run after which no operator's
plan changed), whether the store stopped growing, and whether anything leaked
(descriptors, threads or temporary entries more after the last run than after
the second), then what each operator's bandit and model learned.

``--keep ROWS`` sets the per-key cap each map's end trims the store to
(``RunnerSettings.store_keep_per_key``, default 5,000: the demo adds 6-20 rows a
night, so a smaller cap is how a month shows the cap at work).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from benchmarks.__main__ import FULL, QUICK, _prefect_api


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.consecutive", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5, help="how many runs on the one store (default 5)")
    p.add_argument("--heuristic", action="store_true", help="the learned policy off (the fixed heuristic)")
    p.add_argument("--keep", type=int, metavar="ROWS",
                   help="rows per operator key the store is trimmed to at each map's end (default: the runner's)")
    p.add_argument("--quick", action="store_true", help="the quick benchmark's smaller survey and workers")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tasks` and `flows` beside the package
    from benchmarks import strategies as st
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.operators.registry import DEFAULT_STEPS
    from memchunk_prefect.run import executor

    if args.keep is not None:
        executor.RUNNER_SETTINGS = dataclasses.replace(executor.RUNNER_SETTINGS, store_keep_per_key=args.keep)
    keep = executor.RUNNER_SETTINGS.store_keep_per_key
    work = Path(tempfile.mkdtemp(prefix="memchunk-consecutive-"))
    runs = []
    try:
        with _prefect_api():
            bench = st.Bench(cfg.n_workers, cfg.memory_limit, work)
            survey = st.make_survey(work / "survey.sgy", cfg.shape)
            store = str(work / "store.sqlite")
            try:
                for k in range(args.runs):
                    r = bench.measure(f"run {k + 1}", lambda k=k: st.run_memchunk(
                        bench, survey, [dict(s) for s in DEFAULT_STEPS], store, f"run{k}",
                        learned_policy=not args.heuristic))
                    runs.append({**r.to_dict(), "night": night_state(store, work)})
                    print_night(k + 1, runs[-1])
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
    verdict = judge(runs, keep)
    for line in verdict["lines"]:
        print(line)
    for key, v in learned.items():
        played = ", ".join(f"{a['arm']} {a['mean_reward']:.2f}x{a['pulls']}" for a in v["policy"] if a["pulls"])
        margin = "-" if v["margin"] is None else f"{v['margin']:.3f}"
        print(f"{key}: policy {played or '-'}; margin {margin}; form {v['form']}, time {v['time_form']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "learned": learned, "heuristic": args.heuristic, "quick": args.quick,
                       "keep_per_key": keep, "verdict": {k: v for k, v in verdict.items() if k != "lines"}},
                      f, indent=2, default=str)
    return 0


def night_state(store: str, work: Path) -> dict[str, Any]:
    """After a run: the store's size and rows, each model's recent error, and what this process holds."""
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.learn.store import Store

    size = os.path.getsize(store)
    wal = sum(os.path.getsize(store + x) for x in ("-wal", "-shm") if os.path.exists(store + x))
    with Store(store) as s:
        bank = ModelBank(s)
        errors = {k.split("|")[0].split("[")[0]: bank.model(k).summary()["recent_mape"] for k in s.keys()}
        rows = {"observations": s.count(), "rewards": len(s.rewards()), "maps": len(s.maps())}
    tmp = Path(tempfile.gettempdir())
    temp_entries = sum(1 for e in os.scandir(tmp) if Path(e.path) != work)
    return {"store_bytes": size, "wal_bytes": wal, "rows": rows, "recent_mape": errors,
            "fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(), "temp_entries": temp_entries}


def print_night(k: int, r: dict[str, Any]) -> None:
    n = r["night"]
    mape = ", ".join(f"{op} {'-' if v is None else f'{v:.0f}%'}" for op, v in n["recent_mape"].items())
    print(f"  night {k}: {r['wall_seconds']:.1f} s, {r['oom_events']} out-of-memory; store "
          f"{n['store_bytes'] / 1024:.0f} KiB (+{n['wal_bytes'] / 1024:.0f} KiB WAL), "
          f"{n['rows']['observations']} observations, "
          f"{n['rows']['rewards']} rewards, {n['rows']['maps']} maps; recent error {mape}; this process: "
          f"{n['fds']} fds, {n['threads']} threads; {n['temp_entries']} entries in {tempfile.gettempdir()}",
          flush=True)


def plans(r: dict[str, Any]) -> dict[str, tuple]:
    """Each operator's plan in one run: its decisions and chunk count."""
    return {op: (tuple(v["decisions"]), v["chunks"]) for op, v in r["extra"].get("operators", {}).items()}


def judge(runs: list[dict[str, Any]], keep: int) -> dict[str, Any]:
    """Did decisions settle, did the store stop growing, did anything leak? (Figures, not pass/fail.)"""
    lines = []
    changes = [k + 1 for k in range(1, len(runs)) if plans(runs[k]) != plans(runs[k - 1])]
    settled = (changes[-1] if changes else 1)
    lines.append(f"decisions: {len(changes)} run(s) changed a plan from the run before "
                 f"({', '.join(map(str, changes)) or 'none'}); unchanged from run {settled} to run {len(runs)}")
    walls = [r["wall_seconds"] for r in runs]
    nights = [r["night"] for r in runs]
    sizes = [n["store_bytes"] for n in nights]
    rows = [n["rows"]["observations"] for n in nights]
    lines.append(f"wall: run 1 {walls[0]:.1f} s, runs 2-{len(runs)} {min(walls[1:], default=0):.1f}-"
                 f"{max(walls[1:], default=0):.1f} s; out-of-memory events {sum(r['oom_events'] for r in runs)}")
    lines.append(f"store: {sizes[0] / 1024:.0f} KiB after run 1, {sizes[-1] / 1024:.0f} KiB after run {len(runs)} "
                 f"(largest {max(sizes) / 1024:.0f} KiB); observations {rows[0]} -> {rows[-1]} "
                 f"(cap {keep} per key)")
    base = nights[min(1, len(nights) - 1)]  # after run 2: imports, the server's client and pools are warm
    leaks = {f: nights[-1][f] - base[f] for f in ("fds", "threads", "temp_entries")}
    lines.append("held by this process after run 2 -> after the last: " + ", ".join(
        f"{f} {base[f]} -> {nights[-1][f]}" for f in leaks))
    return {"lines": lines, "plan_changes": changes, "settled_from": settled, "store_bytes": sizes,
            "observations": rows, "growth_after_run_2": leaks}


if __name__ == "__main__":
    raise SystemExit(main())
