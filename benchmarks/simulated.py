"""The simulator against real runs: predicted makespan and failures beside what the benchmark measured.

    python -m benchmarks.simulated [--quick] [--runs 20] [--json PATH] [--markdown]
    python -m benchmarks.simulated --from RESULT.json --workdir DIR      # a benchmark already run

Runs the side-by-side benchmark (``python -m benchmarks``, full or ``--quick``)
into a work directory, or reads one already run (``--from`` its JSON,
``--workdir`` where it kept its store), then simulates every strategy it ran
(``memchunk-warm`` as ``memchunk``, ``split-on-failure`` as ``split``,
``dask-auto``, each ``static-N``) on the same survey shape and cluster shape
(workers, memory limit, one thread each; resting memory read from a fresh
cluster of that shape with the benchmark's warm-up), from the benchmark's own
store (``memchunk-store.sqlite``: the models as they stood at the end of the
benchmark), ``--runs`` times each, and prints predicted against measured:
makespan p50 and p90, completion, out-of-memory events. The per-task overhead
is the planner's figure (``PolicySettings.per_task_overhead_seconds``).

Measured walls are each strategy's own time inside its flow (the benchmark's
``wall_seconds``); a simulated makespan starts at the first task and ends at
the last, so what a plain flow does before and between maps (creating outputs,
Prefect's task-run creation beyond the per-task overhead) is not in it. The
runner's own work per map (before a map's first task and after its last) is:
measured from the benchmark's store (``memchunk_prefect.sim.inputs.measured_map_work``,
the medians over its maps) and simulated for the ``memchunk`` strategy.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Benchmark strategy name -> simulator strategy name.
NAMES = {"memchunk-warm": "memchunk", "split-on-failure": "split", "dask-auto": "dask-auto"}


def sim_name(measured: str) -> str | None:
    if measured in NAMES:
        return NAMES[measured]
    if measured.startswith("static-") and measured[7:].isdigit():
        return measured
    return None  # cold runs, ablations, static-best: not simulated


def resting_bytes(n_workers: int, memory_limit: str) -> int:
    """A worker's resting memory as the benchmark's workers rest (warmed as it warms them), the largest over them."""
    from distributed import Client

    from benchmarks.bench import warm_worker
    from memchunk_prefect.run.cluster import WORKER_MODULES, read_resting
    from memchunk_prefect.testing import start_local_cluster

    cluster = start_local_cluster(n_workers=n_workers, memory_limit=memory_limit)
    client = Client(cluster, set_as_default=False)
    try:
        client.run(warm_worker)
        return max(read_resting(client, (*WORKER_MODULES, "tasks")).values())
    finally:
        client.close()
        cluster.close()


def compare(result: dict, store: str, runs: int, resting: int) -> tuple[list[dict[str, Any]], Any]:
    from memchunk_prefect.core.units import parse_bytes
    from memchunk_prefect.sim.inputs import ClusterShape, Step, store_models
    from memchunk_prefect.sim.simulate import simulate

    cfg = result["config"]
    steps = [Step.of(dict(s)) for s in cfg["steps"]]
    models = store_models(store)
    work = models.map_work()
    cluster = ClusterShape(workers=int(cfg["n_workers"]), memory_limit_bytes=parse_bytes(cfg["memory_limit"]),
                           threads_per_worker=int(cfg.get("threads_per_worker", 1)), resting_bytes=resting,
                           map_start_seconds=work.start_seconds if work else 0.0,
                           map_end_seconds=work.end_seconds if work else 0.0)
    knowledge = models.knowledge
    rows = []
    for measured in result["strategies"]:
        name = sim_name(measured["name"])
        if name is None:
            continue
        (s,) = simulate([name], steps, tuple(cfg["shape"]), cluster, knowledge, runs=runs)
        wall = measured["wall_seconds"] if measured["completed"] else None
        error = (None if wall is None or s.makespan_p50 is None else (s.makespan_p50 - wall) / wall)
        rows.append({"strategy": measured["name"], "measured_completed": bool(measured["completed"]),
                     "measured_seconds": wall, "measured_oom": measured["oom_events"],
                     "predicted_completed": f"{s.completed}/{s.runs}", "predicted_p50": s.makespan_p50,
                     "predicted_p90": s.makespan_p90, "predicted_oom_per_run": s.out_of_memory_mean,
                     "error": error, "failure": s.failure})
    return rows, work


def markdown(rows: list[dict[str, Any]], result: dict, resting: int, runs: int, work: Any = None) -> str:
    from memchunk_prefect.core.errors import format_bytes

    cfg = result["config"]
    per_map = ("no per-map work measured" if work is None else
               f"the runner's work per map {work.start_seconds:.3f} s before and {work.end_seconds:.3f} s after its "
               f"tasks (medians of {work.maps} maps in the store)")
    lines = [f"Simulated from the benchmark's store ({runs} runs per strategy) against its measured runs: "
             f"{' x '.join(map(str, cfg['shape']))} survey, {cfg['n_workers']} workers x {cfg['memory_limit']}, "
             f"resting {format_bytes(resting)}; {per_map}.", "",
             "| strategy | measured | predicted p50 / p90 | error of p50 | completed (measured / predicted) | "
             "OOM measured / predicted per run |", "|---|---:|---:|---:|---|---|"]

    def sec(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f} s"

    for r in rows:
        err = "-" if r["error"] is None else f"{100 * r['error']:+.0f}%"
        lines.append(f"| {r['strategy']} | {sec(r['measured_seconds'])} | {sec(r['predicted_p50'])} / "
                     f"{sec(r['predicted_p90'])} | {err} | {'yes' if r['measured_completed'] else 'no'} / "
                     f"{r['predicted_completed']} | {r['measured_oom']} / {r['predicted_oom_per_run']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulated", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="run the quick benchmark (a smoke test, not the figures)")
    p.add_argument("--from", dest="source", metavar="RESULT.json", help="a benchmark's JSON instead of a new run")
    p.add_argument("--workdir", metavar="DIR", help="the benchmark's work directory (its store is read from it); "
                   "kept, for a later --from (without it a temporary one is made and removed at the end)")
    p.add_argument("--runs", type=int, default=20, help="simulated runs per strategy (default 20)")
    p.add_argument("--json", metavar="PATH", help="write the comparison as JSON")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    made_here: list[Path] = []  # a temporary work directory this run made: removed at the end (~250 MiB)
    try:
        return _main(p, args, made_here)
    finally:
        for d in made_here:
            shutil.rmtree(d, ignore_errors=True)


def _main(p: argparse.ArgumentParser, args: argparse.Namespace, made_here: list[Path]) -> int:
    if args.source:
        if not args.workdir:
            p.error("--from needs --workdir: the benchmark's work directory, where its store is")
        result = json.loads(Path(args.source).read_text())
        workdir = Path(args.workdir)
    else:
        from benchmarks.__main__ import FULL, QUICK, _prefect_api, run

        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="memchunk-simbench-")).absolute()
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.workdir:  # to keep it for a later --from, name one with --workdir
            made_here.append(workdir)
        with _prefect_api():
            result = run(QUICK if args.quick else FULL, args.quick, workdir)
    store = workdir / "memchunk-store.sqlite"
    if not store.exists():
        p.error(f"no benchmark store at {store}")
    cfg = result["config"]
    resting = resting_bytes(int(cfg["n_workers"]), cfg["memory_limit"])
    rows, work = compare(result, str(store), args.runs, resting)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "resting_bytes": resting, "runs": args.runs,
                                               "config": cfg, "map_work": None if work is None else
                                               {"start_seconds": work.start_seconds,
                                                "end_seconds": work.end_seconds, "maps": work.maps}}, indent=1))
    print(markdown(rows, result, resting, args.runs, work))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
