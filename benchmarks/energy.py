"""objective="energy" against objective="time" on the same work: wall time and energy side by side.

    python -m benchmarks.energy [--quick] [--pairs N] [--json PATH]

The cluster and survey of ``python -m benchmarks`` (``--quick``: its smaller
ones), the benchmark pipeline (envelope -> gaussian_smooth -> gst3d_dip) on one
fresh store: one warm-up run teaches the models, then ``--pairs`` (default 3)
pairs of runs, one per objective, in alternating order. Per run:

- **wall**: the flow's own seconds (as in ``python -m benchmarks``);
- **busy J**: the sum of the run's task energies from the store (every task
  run, failed attempts included), labelled with their source: measured by a
  counter (``rapl``, ``nvml``) or ``estimate`` (CPU seconds x ``watts_per_core``,
  10 W by default, where no counter can be read: these 2-core machines have none);
- **idle J**: slots the run held but did not use (``slots x wall`` less the
  tasks' seconds) at ``idle_watts_per_core`` (3 W): the cost of a last wave that
  leaves slots waiting; always an estimate;
- **host J (rapl)**: the CPU packages' RAPL counter over the whole run, where
  ``/sys/class/powercap/intel-rapl:*/energy_uj`` is readable; "n/a" otherwise.

The table gives each objective's medians; the JSON every run. Then, from the store
the runs left, what the planner's cost model estimates for each operator cut into
1 to 4 iline slabs (seconds, joules, whether the largest block fits the budget the
runs had): why the two objectives chose what they chose.
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

from benchmarks.__main__ import FULL, QUICK, _prefect_api


def _run(bench: Any, survey: str, steps: list[dict], store_path: str, tag: str, objective: str) -> dict:
    """One pipeline run under ``objective``; its wall, chunks and energy (from the store and, if readable, RAPL)."""
    from benchmarks import strategies as st
    from memchunk_prefect.core.settings import PolicySettings
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.run.gpu_energy import _rapl

    with Store(store_path) as s:
        last = max((i for i, _ in s.rows()), default=0)
    rapl0 = _rapl().read()
    r = bench.measure(f"{objective} {tag}", lambda: st.run_memchunk(bench, survey, [dict(x) for x in steps],
                                                                     store_path, tag, objective=objective))
    rapl_j = _rapl().joules(rapl0, _rapl().read()) if rapl0 is not None else None
    with Store(store_path) as s:
        new = [o for _, o in s.rows(after=last)]
    settings = PolicySettings()
    busy = sum(o.energy_joules or 0.0 for o in new)
    task_seconds = sum(o.seconds for o in new)
    idle_seconds = max(0.0, bench.slots * r.wall_seconds - task_seconds)
    ops = r.extra.get("operators", {})
    return {"objective": objective, "tag": tag, "completed": r.completed, "wall_seconds": round(r.wall_seconds, 3),
            "oom_events": r.oom_events, "tasks": r.tasks,
            "chunks": {op: v["chunks"] for op, v in ops.items()},
            "busy_joules": round(busy, 2), "energy_sources": sorted({o.energy_source or "none" for o in new}),
            "idle_joules": round(idle_seconds * settings.idle_watts_per_core, 2),
            "total_joules": round(busy + idle_seconds * settings.idle_watts_per_core, 2),
            "host_rapl_joules": None if rapl_j is None else round(rapl_j, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.energy", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the quick benchmark's smaller survey and workers")
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs (one per objective) after a warm-up")
    p.add_argument("--json", metavar="PATH", help="write every run as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `tasks` and `flows` beside the package
    from benchmarks import strategies as st
    from memchunk_prefect.operators.registry import DEFAULT_STEPS

    cfg = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="memchunk-energy-"))
    runs: list[dict] = []
    try:
        with _prefect_api():
            bench = st.Bench(cfg.n_workers, cfg.memory_limit, work)
            try:
                survey = st.make_survey(work / "survey.sgy", cfg.shape)
                store = str(work / "store.sqlite")
                steps = [dict(s) for s in DEFAULT_STEPS]
                print(f"warm-up ({cfg.shape[0]} x {cfg.shape[1]} x {cfg.shape[2]}, {cfg.n_workers} workers x "
                      f"{cfg.memory_limit}):", flush=True)
                _run(bench, survey, steps, store, "warm-up", "time")
                for k in range(args.pairs):
                    order = ("time", "energy") if k % 2 == 0 else ("energy", "time")
                    for objective in order:
                        runs.append(_run(bench, survey, steps, store, f"pair{k + 1}", objective))
                estimates = _cost_model(store, cfg.shape, bench.slots)
            finally:
                bench.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print()
    print("objective  wall s  busy J  idle J  total J  host J (rapl)  energy source  chunks per operator")
    for objective in ("time", "energy"):
        mine = [r for r in runs if r["objective"] == objective and r["completed"]]
        if not mine:
            print(f"{objective:<9}  no completed run")
            continue

        def med(field: str, rs: list[dict] = mine) -> float | None:
            vals = [r[field] for r in rs if r[field] is not None]
            return statistics.median(vals) if vals else None

        host = med("host_rapl_joules")
        sources = sorted({s for r in mine for s in r["energy_sources"]})
        print(f"{objective:<9}  {med('wall_seconds'):6.1f}  {med('busy_joules'):6.0f}  {med('idle_joules'):6.0f}  "
              f"{med('total_joules'):7.0f}  {'n/a' if host is None else f'{host:.0f}':>13}  "
              f"{'+'.join(sources):<13}  {mine[-1]['chunks']}")
    print()
    print("the planner's estimates from the runs' store, per operator and iline slabs (energy objective's figures):")
    print("operator         slabs  block read         fits  seconds  joules")
    for e in estimates:
        print(f"{e['operator']:<16} {e['slabs']:>5}  {' x '.join(map(str, e['extents'])):<17}  "
              f"{'yes' if e['fits'] else 'no':<4}  {e['seconds']:7.2f}  {e['joules']:6.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": list(cfg.shape), "memory_limit": cfg.memory_limit,
                                               "n_workers": cfg.n_workers, "runs": runs, "estimates": estimates,
                                               "at": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
    return 0


def _cost_model(store_path: str, shape: tuple[int, int, int], slots: int) -> list[dict]:
    """The planner's estimated seconds and joules for each operator of the store cut into 1..4 iline slabs
    (halo included, clipped at the volume's edges), with the learned models, and whether the largest block's
    upper bound fits the budget its last map had."""
    from memchunk_prefect.core.chunks import Chunk, largest_read_extents
    from memchunk_prefect.core.estimates import estimate_joules, estimate_seconds
    from memchunk_prefect.core.settings import PolicySettings
    from memchunk_prefect.learn.bank import BankKnowledge, ModelBank
    from memchunk_prefect.learn.store import Store

    settings = PolicySettings(objective="energy")
    out = []
    with Store(store_path) as s:
        bank = ModelBank(s)
        last = {m.operator_key: m for m in s.maps()}
        for key, m in last.items():
            k = BankKnowledge(bank, key, settings)
            for n in (1, 2, 3, 4):
                ext = largest_read_extents(Chunk.whole(shape), (n, 1, 1), m.halo, shape)
                out.append({"operator": m.operator, "slabs": n, "extents": list(ext),
                            "fits": bool(k.predict(ext).upper_bytes <= m.budget_bytes),
                            "seconds": estimate_seconds(n, ext, slots, settings, k.seconds_per_element(),
                                                        k.seconds_for),
                            "joules": estimate_joules(n, ext, slots, settings, k.seconds_per_element(),
                                                      k.seconds_for, k.joules_for)})
    return out


if __name__ == "__main__":
    raise SystemExit(main())
