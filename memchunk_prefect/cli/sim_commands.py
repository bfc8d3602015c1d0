"""The ``memchunk`` subcommands that simulate from what was learned: ``simulate``, ``compare-traces``, ``recommend``.

A flow's chunked maps on a cluster shape (strategies side by side, no cluster needed), a real
run's trace against a simulated one, and the cluster to ask for to meet a deadline. Seconds,
bytes, joules and core-hours throughout; durations accept ``45min``, ``6h`` or ``HH:MM[:SS]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from memchunk_prefect.cli.format import table
from memchunk_prefect.cli.registry import EXIT_FAILURE, EXIT_OK, arguments, emit, register
from memchunk_prefect.core.errors import SimulationInputError, VolumeError, format_bytes
from memchunk_prefect.core.settings import DEFAULT_SETTINGS
from memchunk_prefect.core.units import parse_bytes

# --------------------------------------------------------------------------- simulate


def _flow_arguments(p: argparse.ArgumentParser) -> None:
    """What `simulate` and `recommend` both take: the flow's steps, the survey, the workers' threads and rest."""
    p.add_argument("--flow-run", metavar="ID",
                   help="simulate a recorded flow run's maps (same operators, parameters, halos and chaining): its "
                        "id, the start of it, or `latest`; survey and cluster default to the recorded ones")
    p.add_argument("--steps", nargs="+", metavar="OPERATOR",
                   help="operators in the flow's order: built-in names (default parameters) or any operator key the "
                        "store holds, as `memchunk models` lists them (default: the demo pipeline)")
    p.add_argument("--steps-json", help='steps with parameters, as the flows take them: \'[{"name": "gst3d_dip"}]\', '
                                        'or by key: \'[{"key": "my_box[r=2]|float32|cpu", "halo": [2, 2, 2]}]\'')
    p.add_argument("--shape", nargs=3, type=int, metavar=("IL", "XL", "T"),
                   help="survey shape (needed without --flow-run; with it, default the recorded survey's)")
    p.add_argument("--threads", type=int, help="threads per worker (default: the recorded run's with --flow-run, "
                                               "else 1)")
    p.add_argument("--resting", help="a worker's memory before any task (default: the recorded run's with "
                                     "--flow-run, else 256MiB)")
    p.add_argument("--prior-multiple", type=float,
                   help="simulate an operator with no history from a stated prior: peak = this x its input "
                        "(flagged in the output); without it such an operator is an error")
    p.add_argument("--prior-seconds-per-element", type=float, default=1e-6,
                   help="the prior's compute time per element (default 1e-6 s)")
    p.add_argument("--queue-wait", metavar="WAIT",
                   help="an HPC allocation: each worker is a batch job that waits in the queue first: "
                        "20min (fixed), exp:MEAN, lognormal:MEDIAN,P90 (e.g. lognormal:10min,2h) or file:PATH "
                        "(measured waits in seconds, one per line); makespans then count from submission")
    p.add_argument("--walltime", help="each job leaves this long after it started (its running tasks are lost and "
                                      "rerun): seconds, 45min, 6h or HH:MM[:SS]")
    p.add_argument("--external", action="store_true",
                   help="the workers join a scheduler started elsewhere (MemoryAwareRunner(address=...)): each map "
                        "plans for the workers that have joined and follows them, instead of for all requested")
    p.add_argument("--json", action="store_true", help="print JSON")


def _simulate_arguments(p: argparse.ArgumentParser) -> None:
    _flow_arguments(p)
    p.add_argument("--workers", type=int, help="worker processes (needed without --flow-run)")
    p.add_argument("--memory-limit", help="memory limit per worker, e.g. 8GiB (needed without --flow-run)")
    p.add_argument("--cold", action="store_true",
                   help="plan as a first run on an empty store would (probing, learning from its own chunks), "
                        "chunks still drawn from the store's models: what a run on a new site's store costs")
    p.add_argument("--strategies", nargs="+", default=["memchunk", "split", "dask-auto", "static-1", "static-2",
                                                       "static-4", "static-8"],
                   help="memchunk, split, dask-auto, static-N (default: all of these, N = 1 2 4 8)")
    p.add_argument("--runs", type=int, default=20, help="simulated runs per strategy (default 20)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first run (default 0)")
    p.add_argument("--deadline", help="also give the chance of finishing within it: seconds, 45min, 6h, HH:MM")
    p.add_argument("--trace", metavar="FILE",
                   help="also write the first simulated run of the memchunk strategy as a WfCommons (WfFormat) "
                        "trace, to compare with a real run's (`memchunk compare-traces REAL FILE`)")
    p.add_argument("--utilisation", type=float, metavar="U0",
                   help="also give the chance that the allocation's utilisation over --window reaches U0 (a "
                        "fraction), simulated and by the queue-wait model (memchunk_prefect/sim/allocation.py)")
    p.add_argument("--window", help="the window for --utilisation: seconds, 45min, 6h or HH:MM (default: the "
                                    "deadline)")
    p.add_argument("--track-record", type=int, metavar="N",
                   help="also predict the store's N latest completed flow runs (of the same flow, with --flow-run) "
                        "again on their own survey and cluster, beside the makespans they had: how far to trust the "
                        "prediction, and the multiple of the p90 to book (memchunk_prefect/sim/track.py)")


def _allocation_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``queue_wait`` and ``walltime_seconds`` for a ClusterShape, from --queue-wait and --walltime."""
    from memchunk_prefect.core.units import parse_seconds
    from memchunk_prefect.sim.allocation import QueueWait

    out: dict[str, Any] = {"external": bool(args.external)}
    if args.queue_wait is not None:
        out["queue_wait"] = QueueWait.parse(args.queue_wait)
    if args.walltime is not None:
        out["walltime_seconds"] = parse_seconds(args.walltime)
    return out


def _allocation_note(cluster: Any, summaries: list[Any]) -> str | None:
    if cluster.queue_wait is None and cluster.walltime_seconds is None:
        return None
    wait = cluster.queue_wait.describe() if cluster.queue_wait is not None else "no queue wait"
    wall = f"a {cluster.walltime_seconds:g} s walltime" if cluster.walltime_seconds is not None else "no walltime"
    lost = ", ".join(f"{s.strategy} {s.walltime_losses_mean:.1f}" for s in summaries if s.walltime_losses_mean)
    return (f"an allocation of {cluster.workers} batch jobs (one worker each), {wait}, {wall}: makespans count from "
            "submission, core-hours from each job's start"
            + ("; each map plans for the workers that have joined (a scheduler started elsewhere)" if cluster.external
               else "")
            + (f"; tasks lost at walltime per run: {lost}" if lost else ""))


def _utilisation_line(s: Any) -> str:
    a = s.allocation
    return (f"{s.strategy}: P(U >= {a.target:g} within {a.window_seconds:g} s) simulated {a.p_simulated:.2f} "
            f"({a.runs} runs, U p50 {a.utilisation_p50:.2f}); model {a.model.p_exact:.2f} (normal approximation "
            f"{a.model.p_normal:.2f}) from the queue waits and the simulated jobs' own utilisation (p50 "
            f"{a.job_utilisation_p50:.2f})")


def _sim_models(args: argparse.Namespace) -> Any:
    from memchunk_prefect.sim.inputs import PriorKnowledge, store_models

    prior = (PriorKnowledge(args.prior_multiple, args.prior_seconds_per_element)
             if args.prior_multiple is not None else None)
    return store_models(args.store, prior=prior, cold=bool(getattr(args, "cold", False)))


def _flow_inputs(args: argparse.Namespace, models: Any) -> tuple[list[Any], tuple[int, int, int], Any]:
    """The steps, the survey shape and the recorded flow run (None without --flow-run) to simulate; every
    step's key checked for enough history first (:class:`TooLittleHistoryError` names the one that lacks it)."""
    from memchunk_prefect.sim.recorded import recorded_flow, step_for

    store = models.bank.store
    if args.flow_run is not None:
        if args.steps or args.steps_json:
            raise SimulationInputError("give either --flow-run (its maps are the steps) or --steps / --steps-json, "
                                       "not both")
        recorded = recorded_flow(store, args.flow_run)
        steps, shape = recorded.steps, tuple(args.shape) if args.shape else recorded.shape
    else:
        if args.shape is None:
            raise SimulationInputError("give the survey's shape (--shape IL XL T), or --flow-run ID|latest to "
                                       "simulate a recorded flow run on its own survey")
        recorded, steps, shape = None, [step_for(s, store) for s in _steps_of(args)], tuple(args.shape)
    models.check_history([s.key for s in steps])
    return steps, shape, recorded


def _sim_cluster(args: argparse.Namespace, recorded: Any, work: Any) -> Any:
    """The cluster ``simulate`` runs on: the recorded flow run's with each figure given replaced, else the
    figures given (--workers and --memory-limit needed)."""
    from memchunk_prefect.sim.inputs import ClusterShape

    memory = parse_bytes(args.memory_limit) if args.memory_limit is not None else None
    resting = parse_bytes(args.resting) if args.resting is not None else None
    kw = {**_map_work_kwargs(work), **_allocation_kwargs(args)}
    if recorded is not None:
        return recorded.cluster_shape(workers=args.workers, memory_limit_bytes=memory,
                                      threads_per_worker=args.threads, resting_bytes=resting, **kw)
    if args.workers is None or memory is None:
        raise SimulationInputError("give the cluster: --workers N and --memory-limit SIZE (or --flow-run ID|latest "
                                   "for the cluster a recorded flow run had)")
    return ClusterShape(workers=args.workers, memory_limit_bytes=memory, threads_per_worker=args.threads or 1,
                        resting_bytes=resting if resting is not None else parse_bytes("256MiB"), **kw)


def _recorded_note(recorded: Any, shape: Any) -> list[str]:
    """What a simulated flow run was, as recorded, and what had to be assumed."""
    if recorded is None:
        return []
    c = recorded.cluster
    ran = f"; it ran on {c.describe()}" if c is not None else ""
    return [f"flow run {recorded.flow_run_id}: {recorded.describe_steps()}; recorded on "
            f"{' x '.join(map(str, recorded.shape))} in {recorded.makespan_seconds:.1f} s (first map's start to last "
            f"one's end){ran}; simulated on {' x '.join(map(str, shape))}", *recorded.notes]


def _prior_note(models: Any, args: argparse.Namespace) -> str | None:
    if not models.from_prior:
        return None
    return (f"simulated from a stated prior, not from what was learned ({args.prior_multiple:g}x the input, "
            f"{args.prior_seconds_per_element:g} s per element; the runner starts cold and learns): "
            f"{', '.join(sorted(models.from_prior))}")


def _steps_of(args: argparse.Namespace) -> list[Any]:
    if args.steps_json:
        try:
            steps = json.loads(args.steps_json)
        except json.JSONDecodeError as exc:
            raise VolumeError(f"--steps-json is not JSON ({exc}): give a list like "
                              "'[{\"name\": \"envelope\"}]'") from exc
        if not isinstance(steps, list) or not steps:
            raise VolumeError(f"--steps-json must be a non-empty list of steps, got {args.steps_json!r}")
        return steps
    if args.steps:
        return list(args.steps)
    from memchunk_prefect.operators.registry import DEFAULT_STEPS

    return list(DEFAULT_STEPS)


def _opt(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


@register("simulate", "simulate a flow's chunked maps on a cluster shape from what was learned (no cluster needed)")
@arguments(_simulate_arguments)
def _simulate(args: argparse.Namespace) -> int:
    from memchunk_prefect.core.units import parse_seconds
    from memchunk_prefect.sim.simulate import simulate

    models = _sim_models(args)
    steps, shape, recorded = _flow_inputs(args, models)
    work = models.map_work()
    cluster = _sim_cluster(args, recorded, work)
    deadline = parse_seconds(args.deadline) if args.deadline is not None else None
    window = parse_seconds(args.window) if args.window is not None else deadline
    if args.utilisation is not None and window is None:
        raise SimulationInputError(f"--utilisation {args.utilisation:g} needs a window: give --window (or "
                                   "--deadline), e.g. --window 6h")
    summaries = simulate(args.strategies, steps, shape, cluster, models.knowledge, runs=args.runs,
                         seed=args.seed, deadline=deadline, truth_for=models.truth,
                         window=window if args.utilisation is not None else None,
                         target_utilisation=args.utilisation)
    note = _prior_note(models, args)
    traced = _simulated_trace(args, steps, shape, cluster, models) if args.trace else None
    recorded_notes = _recorded_note(recorded, shape)
    record = None
    if args.track_record is not None:
        from memchunk_prefect.sim.track import track_record

        record = track_record(models.bank.store, last=args.track_record, runs=min(args.runs, 10), seed=args.seed,
                              flow_run=recorded.flow_run_id if recorded is not None else None)
    if args.json:
        emit(json.dumps({"shape": list(shape), "cluster": dataclasses.asdict(cluster),
                          "steps": [dataclasses.asdict(s) for s in steps], "runs": args.runs,
                          "flow_run": recorded.flow_run_id if recorded is not None else None,
                          "params": recorded.params if recorded is not None else None, "notes": recorded_notes,
                          "deadline": deadline, "from_prior": sorted(models.from_prior), "prior_note": note,
                          "trace": traced, "strategies": [s.to_dict() for s in summaries],
                          "run_spread": _run_spread(models, steps),
                          "track_record": record.to_dict() if record is not None else None}, indent=1))
        return EXIT_OK
    for line in recorded_notes:
        emit(line)
    _emit_summaries(args, steps, shape, cluster, summaries)
    emit(_map_work_note(work))
    emit(_run_spread_note(_run_spread(models, steps)))
    allocation = _allocation_note(cluster, summaries)
    if allocation:
        emit(allocation)
    for s in summaries:
        if s.allocation is not None:
            emit(_utilisation_line(s))
    if note:
        emit(note)
    if traced:
        emit(f"wrote {traced}: the first simulated memchunk run (seed {args.seed}) as a WfFormat trace, validated")
    if record is not None:
        _emit_track_record(record)
    return EXIT_OK


def _emit_track_record(record: Any) -> None:
    """The store's past flow runs beside their predictions, and the record in one line."""
    if record.rows:
        rows = [[r.flow_run_id[:8], "cold" if r.cold else "warm", str(r.maps), f"{r.real_seconds:.1f}",
                 _opt(r.p50_seconds, ".1f"), _opt(r.p90_seconds, ".1f"),
                 "-" if r.error is None else f"{r.error:+.0%}", "yes" if r.held_by_p90 else "no"]
                for r in record.rows]
        runs = "flow runs of this flow" if record.same_flow else "flow runs"
        emit(f"track record (the store's latest completed {runs}, each predicted on its own survey and cluster from "
             "what the store knew when it started; a first run cold):")
        emit(table(["flow run", "planned", "maps", "real s", "p50 s", "p90 s", "p50 error", "held by p90"], rows))
    for why in record.skipped:
        emit(f"left out of the track record: {why}")
    emit(record.summary_line())


def _emit_summaries(args: argparse.Namespace, steps: list[Any], shape: Any, cluster: Any, summaries: list[Any]) -> None:
    """The table of strategies, its failures and what its energy rests on."""
    header = ["strategy", "completed", "makespan p50 s", "p90 s", "P(deadline)", "OOM/run", "lost worker-s",
              "utilisation", "core-hours", "energy p50", "peak/worker", "chunks per map"]
    rows = [[s.strategy, f"{s.completed}/{s.runs}", _opt(s.makespan_p50, ".1f"), _opt(s.makespan_p90, ".1f"),
             _opt(s.p_deadline, ".2f"), f"{s.out_of_memory_mean:.2f}", f"{s.lost_worker_seconds_mean:.1f}",
             _opt(s.slot_utilisation_p50, ".2f"), _opt(s.core_hours_p50, ".3f"), _joules(s.energy_joules_p50),
             format_bytes(s.peak_bytes_max), " ".join(f"{c:g}" for c in s.chunks_per_map) or "-"] for s in summaries]
    emit(f"{' -> '.join(s.operator for s in steps)} on {' x '.join(map(str, shape))}: {cluster.workers} workers x "
         f"{cluster.threads_per_worker} thread(s), {format_bytes(cluster.memory_limit_bytes)} each (kill line less "
         f"resting: {format_bytes(cluster.headroom_bytes)}); {args.runs} simulated runs per strategy"
         + ("; planned as on an empty store (--cold)" if getattr(args, "cold", False) else ""))
    emit(table(header, rows))
    for s in summaries:
        if s.failure and s.completed < s.runs:
            emit(f"{s.strategy} failed {s.runs - s.completed} of {s.runs} runs: {s.failure}")
    basis = next((s.energy_basis for s in summaries if s.energy_basis), "")
    if basis:
        emit(_energy_note(basis))


def _simulated_trace(args: argparse.Namespace, steps: list[Any], shape: Any, cluster: Any, models: Any) -> str:
    """Write the memchunk strategy's run of seed ``args.seed`` (the summaries' first) as a validated trace."""
    import numpy as np

    from memchunk_prefect.sim.runs import run_strategy
    from memchunk_prefect.sim.trace import simulated_instance, write_instance

    result = run_strategy("memchunk", steps, shape, cluster, models.knowledge,
                          np.random.default_rng(args.seed), truth_for=models.truth)
    return str(write_instance(simulated_instance(result, steps, shape, cluster), args.trace))


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", metavar="TRACE_A", help="a WfFormat trace (e.g. a real run's: memchunk export --format "
                                                "wfcommons)")
    p.add_argument("b", metavar="TRACE_B", help="another trace of the same work (e.g. memchunk simulate --trace)")
    p.add_argument("--schema", metavar="FILE", help="validate both against this WfFormat schema (default: the "
                                                    "bundled 1.5 one)")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("compare-traces", "two WfCommons traces of the same work side by side, per operator (a real run and its "
                            "simulation)")
@arguments(_compare_arguments)
def _compare_traces(args: argparse.Namespace) -> int:
    from memchunk_prefect.core.errors import TraceExportError
    from memchunk_prefect.sim.trace import validate
    from memchunk_prefect.sim.trace_compare import compare

    docs = []
    for path in (args.a, args.b):
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            raise TraceExportError(f"cannot read the trace {path}: {exc}; give a WfFormat JSON file (memchunk "
                                   "export --format wfcommons, memchunk simulate --trace)") from exc
        validate(doc, args.schema)
        docs.append(doc)
    c = compare(*docs)
    if args.json:
        emit(json.dumps(c, indent=1))
        return EXIT_OK

    def pair(v: tuple, fmt: str) -> str:
        x, y, r = v
        cell = f"{_opt(x, fmt)} / {_opt(y, fmt)}"
        return cell + ("" if r is None else f" ({100 * r:+.0f}%)")

    header = ["operator", "tasks", "failed", "task seconds", "mean s", "span s", "energy J"]
    rows = [[r["category"], pair(r["tasks"], "d"), pair(r["failed"], "d"), pair(r["runtime_seconds"], ".1f"),
             pair(r["mean_runtime_seconds"], ".2f"), pair(r["span_seconds"], ".1f"), pair(r["energy_joules"], ".0f")]
            for r in c["operators"]]
    emit(f"A: {c['a']}\nB: {c['b']}\nmakespan: {pair(c['makespan_seconds'], '.1f')} s (B against A in brackets)")
    emit(table(header, rows))
    return EXIT_OK


def _map_work_kwargs(work: Any) -> dict[str, Any]:
    """ClusterShape's per-map work from what the store measured (none: nothing added)."""
    return {} if work is None else work.cluster_kwargs()


def _map_work_note(work: Any) -> str:
    if work is None:
        return ("the runner's own work per map is not simulated: the store holds no map of a run recorded by this "
                "version (run a flow once with it to measure it)")
    task = (f"; per chunk task, {work.task_seconds:.2f} s beyond its block (median of {work.gaps} hand-overs)"
            if work.task_seconds is not None else
            f"; per chunk task, the stated {DEFAULT_SETTINGS.per_task_overhead_seconds:g} s (only {work.gaps} "
            "hand-overs between tasks recorded)")
    chained = (f" (a map over another map's output starts {work.chained_offset_seconds:.2f} s after that map)"
               if work.chained_offset_seconds is not None else "")
    return (f"the runner's own work per map: {work.start_seconds:.2f} s before its first task{chained} and "
            f"{work.end_seconds:.2f} s after its last (medians of {work.maps} maps in the store){task}, in the "
            "memchunk strategy's makespan")


def _run_spread(models: Any, steps: Any) -> dict[str, Any]:
    """The simulated runs' shared time factor (:func:`memchunk_prefect.sim.inputs.run_factor`): its sigma, what the
    store's flow runs taught (None: too few pairs) and from how many pairs of them."""
    from memchunk_prefect.sim.inputs import run_spread

    return {"sigma": run_spread([models.truth(s.key) for s in steps]), "learned": models.bank.run_spread(),
            "learned_from_pairs": len(models.bank.run_pairs())}


def _run_spread_note(spread: dict[str, Any]) -> str:
    """A line saying :func:`_run_spread`'s sigma, and whether the store's flow runs taught it or it is the stated
    least."""
    from memchunk_prefect.learn.bank import MIN_RUN_PAIRS
    from memchunk_prefect.sim.inputs import RUN_SPREAD

    sigma, learned, pairs = spread["sigma"], spread["learned"], spread["learned_from_pairs"]
    if learned is not None and sigma == learned:
        source = f"how far {pairs} pairs of flow runs of one operator in the store strayed from the models"
    elif learned is None:
        source = (f"the stated least: the store has {pairs} pair(s) of flow runs of one operator with timed "
                  f"blocks, fewer than {MIN_RUN_PAIRS}, to learn its own from")
    elif learned < RUN_SPREAD:
        source = f"the stated least: {pairs} pairs of flow runs in the store strayed by {learned:.2f}, less"
    else:
        source = "the stated least: the steps' operators were simulated from a prior"
    return (f"every block of a simulated run shares one time factor, as a real run's blocks share its machine's "
            f"state: sigma {sigma:.2f} ({source}), the runs taking its quantiles evenly")


def _joules(j: float | None) -> str:
    """Joules for a table cell: ``812 J``, ``3.4 kJ``, ``1.2 MJ``."""
    if j is None:
        return "-"
    for unit, scale in (("MJ", 1e6), ("kJ", 1e3)):
        if j >= scale:
            return f"{j / scale:.1f} {unit}"
    return f"{j:.0f} J"


def _energy_note(basis: str) -> str:
    """What the simulated energy rests on, in words."""
    how = {"learned": "each operator's learned joules per element",
           "estimated from seconds": "compute seconds x watts_per_core (no energy learned for these operators)",
           "mixed": "learned joules per element where learned, else compute seconds x watts_per_core"}.get(basis, basis)
    return (f"energy: tasks from {how}, plus the slots held idle at idle_watts_per_core; an estimate unless the "
            "store learned it from a counter (`memchunk models` shows each operator's source)")


def _recommend_arguments(p: argparse.ArgumentParser) -> None:
    _flow_arguments(p)
    p.add_argument("--deadline", required=True, help="finish within: seconds, 45min, 6h or HH:MM[:SS]")
    p.add_argument("--memory", nargs="+", default=["2GiB", "4GiB", "8GiB", "16GiB", "32GiB"],
                   help="memory sizes per worker to try (default 2GiB 4GiB 8GiB 16GiB 32GiB)")
    p.add_argument("--max-workers", type=int, default=256, help="most workers to consider (default 256)")
    p.add_argument("--confidence", type=float, default=0.9, help="chance of meeting the deadline (default 0.9)")
    p.add_argument("--runs", type=int, default=20,
                   help="simulated runs that confirm the answer (default 20: with 5, a shape that meets the deadline "
                        "7 times in 10 passes one time in 6; the search itself uses one run per shape)")
    p.add_argument("--objective", choices=("time", "energy"), default="time",
                   help="among the shapes that meet the deadline: the fewest core-hours (time, default) or the "
                        "least energy (energy)")
    p.add_argument("--plot", metavar="PNG",
                   help="also plot makespan, core-hours and energy against memory per worker (needs matplotlib: "
                        "pip install 'memchunk-prefect[plot]')")
    p.add_argument("--track-record", type=int, metavar="N",
                   help="book with the store's track record: its N latest completed flow runs (of the same flow, "
                        "with --flow-run) predicted again, and "
                        "the simulated runs held to the deadline divided by the multiple of the p90 those runs "
                        "needed (from 5 runs; the jobs' walltime stays the deadline)")


@register("recommend", "the cluster to ask for: fewest core-hours (or least energy) that meet a deadline, from what "
                       "was learned")
@arguments(_recommend_arguments)
def _recommend(args: argparse.Namespace) -> int:
    from memchunk_prefect.core.units import parse_seconds
    from memchunk_prefect.sim.recommend import recommend

    deadline = parse_seconds(args.deadline)
    models = _sim_models(args)
    steps, shape, recorded = _flow_inputs(args, models)
    work = models.map_work()
    c = recorded.cluster if recorded is not None else None
    threads = args.threads or (c.threads_per_worker if c is not None else 1)
    resting = (parse_bytes(args.resting) if args.resting is not None else
               c.resting_bytes if c is not None and c.resting_bytes is not None else parse_bytes("256MiB"))
    extra = {"kill_fraction": c.kill_fraction} if c is not None and c.kill_fraction is not None else {}
    record, planned = None, deadline
    if args.track_record is not None:
        from memchunk_prefect.sim.track import track_record

        record = track_record(models.bank.store, last=args.track_record, runs=min(args.runs, 10),
                              flow_run=recorded.flow_run_id if recorded is not None else None)
        planned = deadline / (record.deadline_factor or 1.0)
    rec = recommend(steps, shape, models.knowledge, deadline_seconds=planned,
                    memory_options=[parse_bytes(m) for m in args.memory], max_workers=args.max_workers,
                    threads_per_worker=threads, confidence=args.confidence, runs=args.runs,
                    truth_for=models.truth, resting_bytes=resting, objective=args.objective,
                    **_map_work_kwargs(work), **_allocation_kwargs(args), **extra)
    rec = dataclasses.replace(rec, deadline_seconds=deadline)  # the jobs' walltime: the deadline booked
    note = _prior_note(models, args)
    if args.json:
        emit(json.dumps({"best": rec.best.to_dict() if rec.best else None, "jobqueue": rec.jobqueue_kwargs(),
                          "deadline_seconds": deadline, "planned_deadline_seconds": planned,
                          "track_record": record.to_dict() if record is not None else None,
                          "confidence": args.confidence, "shape": list(shape),
                          "flow_run": recorded.flow_run_id if recorded is not None else None,
                          "notes": _recorded_note(recorded, shape),
                          "from_prior": sorted(models.from_prior), "prior_note": note,
                          "run_spread": _run_spread(models, steps),
                          "tried": [c.to_dict() for c in rec.tried]}, indent=1))
        return EXIT_OK if rec.best else EXIT_FAILURE
    for line in [*_recorded_note(recorded, shape), *([note] if note else [])]:
        emit(line)
    if record is not None:
        emit(record.summary_line())
        if record.deadline_factor is None:
            emit("booked for the deadline as given: the track record is too short for a margin")
        else:
            emit(f"booked with it: the simulated runs held to {planned:.0f} s of the {deadline:.0f} s deadline"
                 if planned < deadline else "booked for the deadline as given: every past run ended by its p90")
    emit(_run_spread_note(_run_spread(models, steps)))
    return _emit_recommendation(args, rec, steps, shape, planned)


def _emit_recommendation(args: argparse.Namespace, rec: Any, steps: list[Any], shape: Any, deadline: float) -> int:
    """The recommended cluster in words, its dask-jobqueue arguments, and what was tried."""
    survey = " x ".join(map(str, shape))
    if rec.best is None:
        emit(f"no cluster of up to {args.max_workers} workers with {', '.join(args.memory)} each finishes "
              f"{' -> '.join(s.operator for s in steps)} on {survey} within {deadline:.0f} s with probability "
              f"{args.confidence:g} (tried {len(rec.tried)} shapes): allow more workers (--max-workers) or a later "
              "deadline")
        return EXIT_FAILURE
    b, s, jq = rec.best, rec.best.summary, rec.jobqueue_kwargs()
    assert jq is not None
    emit(f"{' -> '.join(st.operator for st in steps)} on {survey}, deadline {deadline:.0f} s "
          f"(probability >= {args.confidence:g}):")
    emit(f"  {b.workers} workers x {b.threads_per_worker} thread(s), {format_bytes(b.memory_limit_bytes)} each: "
          f"makespan p50 {s.makespan_p50:.0f} s, p90 {s.makespan_p90:.0f} s, P(deadline) {s.p_deadline:.2f}, "
          f"{s.core_hours_p50:.2f} core-hours, slot utilisation {s.slot_utilisation_p50:.2f}, "
          f"{s.out_of_memory_mean:.2f} out-of-memory events per run, energy p50 {_joules(s.energy_joules_p50)}"
          + (" (the least energy that meets it)" if args.objective == "energy" else ""))
    emit(f"  dask-jobqueue: SLURMCluster(cores={jq['cores']}, processes={jq['processes']}, memory=\"{jq['memory']}\", "
          f"walltime=\"{jq['walltime']}\"); cluster.scale(jobs={jq['jobs']})")
    screened = sum(c.screened for c in rec.tried)
    emit(f"  ({len(rec.tried)} cluster shapes simulated: {screened} searched with one run each, "
          f"{len(rec.tried) - screened} confirmed with up to {args.runs}; `--json` lists them)")
    if args.queue_wait is not None or args.walltime is not None:
        from memchunk_prefect.sim.inputs import ClusterShape

        jobs = ClusterShape(workers=b.workers, memory_limit_bytes=b.memory_limit_bytes, **_allocation_kwargs(args))
        emit("  " + str(_allocation_note(jobs, [s])))
    if args.plot:
        from memchunk_prefect.sim.recommend import plot_recommendation

        emit(f"  plot: {plot_recommendation(rec, args.plot)}")
    if s.energy_basis:
        emit("  " + _energy_note(s.energy_basis))
    return EXIT_OK

