"""The ``memchunk`` command: inspect what was learned, plan without running, forget, export.

::

    memchunk models [--json] [--store PATH]
    memchunk plan --operator NAME --shape IL XL T --budget 2GiB [--halo N | --halo A B C]
                  [--slots N] [--whole-traces | --cut-traces] [--json]
    memchunk forget KEY
    memchunk export [--format csv|json] [--output FILE]
    memchunk export --format wfcommons --flow-run ID|latest [-o FILE] [--schema FILE]
    memchunk compare-traces TRACE_A TRACE_B [--json]
    memchunk demo [--dir DIR] [--shape IL XL T] [--workers N] [--memory-limit 1.5GiB]
    memchunk ui [--port 4200]
    memchunk doctor [--address tcp://HOST:8786] [--json]
    memchunk simulate --shape IL XL T --workers N --memory-limit 8GiB [--steps OP ...] [--runs 20] [--deadline S]
                      [--trace FILE]
    memchunk recommend --shape IL XL T --deadline 6h [--memory 4GiB 8GiB ...] [--max-workers 256]
                       [--objective time|energy]

Watch runs in the Prefect UI: ``memchunk ui`` (or ``prefect server start``), then
open http://127.0.0.1:4200; flows started with ``PREFECT_API_URL`` pointing at it
show up live.

Every subcommand takes ``--store PATH`` (default: ``$MEMCHUNK_STORE``, else
under the Prefect home; see :mod:`memchunk_prefect.learn.store`). Exit codes: 0 ok,
1 a store or planning problem, 2 bad input (bad budget, unknown or ambiguous
operator, argparse errors).

Subcommands live in :data:`SUBCOMMANDS` (name -> (add_arguments, run)); add one
with :func:`register`.

>>> parse_bytes("2GiB"), parse_bytes("512 MiB"), parse_bytes("2GB"), parse_bytes("1000")
(2147483648, 536870912, 2000000000, 1000)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import warnings
from typing import Any, Callable, Sequence

from memchunk_prefect.cli.format import models_table, table
from memchunk_prefect.core.errors import (
    BudgetError,
    BudgetTooSmallError,
    MemchunkError,
    SimulationInputError,
    UnknownOperatorError,
    VolumeError,
    format_bytes,
)
from memchunk_prefect.core.units import parse_bytes

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

# --------------------------------------------------------------------------- subcommand registry

AddArguments = Callable[[argparse.ArgumentParser], Any]
Run = Callable[[argparse.Namespace], int]
SUBCOMMANDS: dict[str, tuple[str, AddArguments, Run]] = {}


def register(name: str, help: str) -> Callable[[Run], Run]:  # noqa: A002 - argparse's word
    """Register a subcommand: decorate ``run(args) -> exit code`` whose ``add_arguments`` is ``run.arguments``.

    >>> @register("hello", "say hello")
    ... def _hello(args):
    ...     return 0
    >>> "hello" in SUBCOMMANDS
    True
    >>> del SUBCOMMANDS["hello"]
    """

    def decorate(run: Run) -> Run:
        SUBCOMMANDS[name] = (help, getattr(run, "arguments", lambda p: None), run)
        return run

    return decorate


def arguments(add: AddArguments) -> Callable[[Run], Run]:
    """Attach an ``add_arguments(parser)`` to a subcommand function (apply below :func:`register`)."""

    def decorate(run: Run) -> Run:
        run.arguments = add  # type: ignore[attr-defined]
        return run

    return decorate


def _open_store(args: argparse.Namespace):
    from memchunk_prefect.learn.store import Store

    return Store(args.store)


def _emit(text: str, args: argparse.Namespace | None = None) -> None:
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


# --------------------------------------------------------------------------- models


@register("models", "per operator key: observations, bytes per element, fixed overhead, recent error, coverage, "
                    "energy per element")
@arguments(lambda p: p.add_argument("--json", action="store_true", help="print JSON instead of a table"))
def _models(args: argparse.Namespace) -> int:
    from memchunk_prefect.learn.model import ModelBank

    with _open_store(args) as store:
        bank = ModelBank(store)
        rows = [{**bank.model(k).summary(), "policy": bank.learner(k).summary()} for k in store.keys()]
        path = str(store.path)
    if args.json:
        _emit(json.dumps({"store": path, "models": rows}, indent=1))
    elif not rows:
        _emit(f"no observations yet in {path}; run a flow with MemoryAwareRunner (or `memchunk demo`)")
    else:
        _emit(models_table(rows))
        _emit("recent error: mean absolute % error of the mean prediction on each next observation; "
              "coverage: share of next observations within the upper bound; fixed overhead: per chunk, "
              "+ once: the most a library's first use in a chunk left held in its worker (a CUDA context), paid "
              "once per worker process; policy: the learned policy's arms "
              "(risk levels of the bound: bold, mid, safe) with their mean reward (slot efficiency less 1 per "
              "out-of-memory chunk) x plans taught, !n out-of-memory events; time: the form of compute seconds "
              "against block size, runs learned (+ set aside for a first touch of memory), the kernel "
              "seconds per GiB runs paid to grow their worker past the most it had held (s/GiB: what a plan "
              "counts for growing fresh workers), and seconds per "
              "element of the largest blocks over the smallest; energy/element: learned joules per "
              "element (halo included), measured by a counter (rapl, nvml) or est(imated: CPU seconds x "
              "watts_per_core where no counter can be read)")
    return EXIT_OK


# --------------------------------------------------------------------------- forget / export


@register("forget", "delete every observation of one operator key")
@arguments(lambda p: p.add_argument("key", help="the exact operator key, as `memchunk models` lists it"))
def _forget(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        keys = store.keys()
        if args.key not in keys:
            raise UnknownOperatorError(f"no observations under {args.key!r} in {store.path}; "
                                       f"known keys: {', '.join(keys) or 'none'}")
        n = store.forget(args.key)
    _emit(f"forgot {n} observation{'s' if n != 1 else ''} of {args.key}")
    return EXIT_OK


def _compact_arguments(p: argparse.ArgumentParser) -> None:
    from memchunk_prefect.core.settings import RUNNER_SETTINGS

    p.add_argument("--keep", type=int, default=RUNNER_SETTINGS.store_keep_per_key,
                   help="observations (and policy rewards) to keep per operator key, the newest "
                        f"(default {RUNNER_SETTINGS.store_keep_per_key}, what each map's end keeps)")
    p.add_argument("--key", help="one operator key, as `memchunk models` lists it (default: every key)")


@register("compact", "keep the newest observations of each operator key and delete the older ones")
@arguments(_compact_arguments)
def _compact(args: argparse.Namespace) -> int:
    with _open_store(args) as store:
        if args.key is not None and args.key not in store.keys():
            raise UnknownOperatorError(f"no observations under {args.key!r} in {store.path}; "
                                       f"known keys: {', '.join(store.keys()) or 'none'}")
        deleted = store.compact(args.keep, args.key)
        left = store.count()
    _emit(f"deleted {deleted['observations']} observations, {deleted['rewards']} policy rewards and "
          f"{deleted['maps']} map records; {left} observations kept")
    return EXIT_OK


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("csv", "json", "wfcommons"), default="csv",
                   help="csv or json: every observation in the store (default csv); wfcommons: a WfFormat trace of "
                        "one flow run (--flow-run), validated before it is written (needs `pip install "
                        "'memchunk-prefect[trace]'`; docs/traces.md)")
    p.add_argument("--output", "-o",
                   help="write to this file (replaced atomically: never half-written) instead of standard output; "
                        "for wfcommons the default is ./<flow run id>.wfcommons.json")
    p.add_argument("--flow-run", metavar="ID",
                   help="wfcommons: the finished flow run to trace, by id, or `latest` (the flow run of the most "
                        "recently ended chunked map in the store); Prefect's API (PREFECT_API_URL, else a temporary "
                        "server on PREFECT_HOME's database) must know it")
    p.add_argument("--schema", metavar="FILE",
                   help="wfcommons: validate against this WfFormat schema instead of the bundled WfFormat 1.5 one "
                        "(the trace's schemaVersion follows it)")
    p.add_argument("--author", help="wfcommons: the trace's author name (with --email; default: no author)")
    p.add_argument("--email", help="wfcommons: the author's email (with --author)")


@register("export", "every observation as CSV or JSON, or one flow run as a WfCommons (WfFormat) trace")
@arguments(_export_arguments)
def _export(args: argparse.Namespace) -> int:
    if args.format == "wfcommons":
        return _export_wfcommons(args)
    unused = [f"--{n.replace('_', '-')}" for n in ("flow_run", "schema", "author", "email") if getattr(args, n)]
    if unused:
        sys.stderr.write(f"memchunk export: {', '.join(unused)} only apply to --format wfcommons\n")
        return EXIT_USAGE
    with _open_store(args) as store:
        text = store.export(args.format)
    if args.output:
        from memchunk_prefect.io.files import atomic_write_text

        try:
            atomic_write_text(args.output, text)
        except OSError as exc:
            sys.stderr.write(f"memchunk export: cannot write {args.output}: {exc}; nothing was written\n")
            return EXIT_FAILURE
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _export_wfcommons(args: argparse.Namespace) -> int:
    from memchunk_prefect.sim.trace import export_wfcommons, summary

    if not args.flow_run:
        sys.stderr.write("memchunk export: --format wfcommons needs --flow-run ID (or --flow-run latest)\n")
        return EXIT_USAGE
    with _open_store(args) as store:
        path = export_wfcommons(args.flow_run, store, args.output, schema=args.schema, author=args.author,
                                email=args.email)
    s = summary(json.loads(path.read_text(encoding="utf-8")))
    energy = (f"{s['energy_kwh'] * 3.6e6:.1f} J ({', '.join(s['energy_sources'])})" if s["energy_sources"]
              else "no energy recorded")
    _emit(f"wrote {path}: WfFormat {s['schema_version']}, validated; {s['tasks']} tasks ({s['failed']} failed "
          f"attempts), {s['files']} files, {s['edges']} dependencies, energy {energy}")
    return EXIT_OK


# --------------------------------------------------------------------------- plan


def _operator_name(key: str) -> str:
    return re.split(r"[\[|]", key, maxsplit=1)[0]


def match_operator(name: str, keys: Sequence[str]) -> str | None:
    """The one key ``name`` means: the exact key, else the keys of operator ``name``, else keys starting with it.

    None when nothing matches (no history yet); :class:`UnknownOperatorError` when several do.
    """
    if name in keys:
        return name
    for candidates in ([k for k in keys if _operator_name(k) == name], [k for k in keys if k.startswith(name)]):
        if len(candidates) == 1:
            return candidates[0]
        if candidates:
            raise UnknownOperatorError(
                f"{name!r} matches {len(candidates)} operator keys: {', '.join(candidates)}; "
                "pass the exact key with --operator")
    return None


def _operator_spec(name: str):
    """The built-in operator's spec (halo, whole traces), or None for an unknown one."""
    try:
        from memchunk_prefect.operators import OPERATORS
    except Exception:  # pragma: no cover - tasks not importable
        return None
    task = OPERATORS.get(_operator_name(name))
    if task is None:
        return None
    from memchunk_prefect.operators.spec import spec_of

    return spec_of(task)


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--operator", required=True, help="operator key (exact) or operator name, e.g. envelope")
    p.add_argument("--shape", required=True, nargs=3, type=int, metavar=("IL", "XL", "T"),
                   help="volume shape: ilines, xlines, samples")
    p.add_argument("--budget", required=True, help="memory per task, e.g. 2GiB, 512MiB, 2GB or bytes")
    p.add_argument("--halo", nargs="+", type=int, metavar="N",
                   help="halo in samples: one int for every axis or three (default: the operator's own)")
    p.add_argument("--slots", type=int, default=1, help="worker slots (workers x threads) to keep busy")
    p.add_argument("--held",
                   help="what each worker has already held above its resting memory, per thread, e.g. 300MiB "
                        "(default: nothing, fresh workers, as a flow's own local cluster starts): a plan taking them "
                        "higher counts the kernel time the store's runs paid to grow theirs")
    traces = p.add_mutually_exclusive_group()
    traces.add_argument("--whole-traces", dest="whole_traces", action="store_true", default=None,
                        help="never cut the time axis")
    traces.add_argument("--cut-traces", dest="whole_traces", action="store_false",
                        help="allow cutting the time axis")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("plan", "the chunking the runner would choose, without running anything")
@arguments(_plan_arguments)
def _plan(args: argparse.Namespace) -> int:
    from memchunk_prefect.core.estimates import Estimates, FirstTouch
    from memchunk_prefect.core.policy import plan
    from memchunk_prefect.learn.model import ModelBank

    budget = parse_bytes(args.budget)
    held = parse_bytes(args.held) if args.held is not None else 0
    if args.halo is not None and len(args.halo) not in (1, 3):
        raise VolumeError(f"--halo takes one int (every axis) or three (iline xline twt), got {args.halo}")
    if args.slots < 1:
        raise VolumeError(f"--slots must be at least 1, got {args.slots}")
    with _open_store(args) as store:
        key = match_operator(args.operator, store.keys())
        bank = ModelBank(store)
        model_key = key or args.operator
        model = bank.model(model_key)
        for other in store.keys():  # loaded, so the bank may pool what growing costs where this one's runs grew little
            bank.model(other)
        spb = bank.touch_seconds_per_byte(model_key)
    spec = _operator_spec(model_key)
    halo: Any = args.halo[0] if args.halo and len(args.halo) == 1 else args.halo
    if halo is None:
        halo = spec.halo_for({}) if spec is not None else 0
    whole = args.whole_traces if args.whole_traces is not None else (spec.whole_traces if spec else True)
    # The learned time, as the runner plans with it (BankKnowledge): per element, and a curve where one is learned.
    estimates = Estimates(predict=lambda ext: model.predict(ext), seconds_per_element=model.seconds_per_element(),
                          seconds_for=model.seconds_for, first_touch=None if spb is None else FirstTouch(held, spb))
    p = plan(tuple(args.shape), budget_bytes=budget, estimates=estimates, halo=halo, slots=args.slots,
             whole_traces=whole)
    summary = model.summary()
    out = p.to_dict()
    out.update({
        "operator_key": model_key,
        "shape": list(args.shape),
        "halo": list(halo) if isinstance(halo, (list, tuple)) else [int(halo)] * 3,
        "slots": args.slots,
        "held_bytes": held,
        "touch_seconds_per_byte": spb,
        "whole_traces": whole,
        "n_observations": summary["n_observations"],
        "too_little_history": bool(p.probe),
    })
    if p.probe:
        out["history"] = (f"too little history for {model_key!r} ({summary['n_observations']} usable "
                          "observations): the runner would probe with small chunks first")
    if args.json:
        _emit(json.dumps(out, indent=1))
        return EXIT_OK
    lines = [f"operator      {model_key}  ({summary['n_observations']} observations)",
             f"volume        {tuple(args.shape)}, halo {out['halo']}, {args.slots} slot(s), "
             f"budget {format_bytes(budget)}"]
    if p.probe:
        lines.append(f"too little history: probe with {p.n_chunks} small chunks of up to {p.chunk_shape}, "
                     "then plan the rest")
    else:
        lines += [f"chunks        {p.n_chunks} of up to {tuple(p.chunk_shape)}",
                  f"peak memory   {format_bytes(p.predicted_peak_bytes)} predicted, "
                  f"{format_bytes(p.upper_bound_bytes)} upper bound"]
    lines.append(f"why           {p.reason}")
    _emit("\n".join(lines))
    return EXIT_OK


# --------------------------------------------------------------------------- demo and ui


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from memchunk_prefect.cli.demo import add_arguments

    add_arguments(p)


@register("demo", "run the demo flow (envelope -> gaussian_smooth -> gst3d_dip) on a synthetic survey, locally")
@arguments(_demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from memchunk_prefect.cli.demo import run

    return run(args)


def _ui_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=4200, help="port of the Prefect server (default 4200)")


@register("ui", "start the Prefect server and UI on 127.0.0.1 (prefect server start); Ctrl-C stops it")
@arguments(_ui_arguments)
def _ui(args: argparse.Namespace) -> int:
    import subprocess

    url = f"http://127.0.0.1:{args.port}"
    _emit(f"Prefect UI at {url}; to send flow runs to it: export PREFECT_API_URL={url}/api")
    # `python -m prefect`: this interpreter's Prefect, wherever its console scripts were installed.
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
           "--port", str(args.port)]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return EXIT_OK


# --------------------------------------------------------------------------- simulate


def _flow_arguments(p: argparse.ArgumentParser) -> None:
    """What `simulate` and `recommend` both take: the flow's steps, the survey, the workers' threads and rest."""
    p.add_argument("--steps", nargs="+", metavar="OPERATOR",
                   help="operators in the flow's order, default parameters (default: the demo pipeline)")
    p.add_argument("--steps-json", help='steps with parameters, as the flows take them: \'[{"name": "gst3d_dip"}]\'')
    p.add_argument("--shape", required=True, nargs=3, type=int, metavar=("IL", "XL", "T"), help="survey shape")
    p.add_argument("--threads", type=int, default=1, help="threads per worker (default 1)")
    p.add_argument("--resting", default="256MiB", help="a worker's memory before any task (default 256MiB)")
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
    p.add_argument("--workers", required=True, type=int, help="worker processes")
    p.add_argument("--memory-limit", required=True, help="memory limit per worker, e.g. 8GiB")
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
    return store_models(args.store, prior=prior)


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
    from memchunk_prefect.sim.inputs import ClusterShape, Step
    from memchunk_prefect.sim.simulate import simulate

    steps = [Step.of(s) for s in _steps_of(args)]
    models = _sim_models(args)
    work = models.map_work()
    cluster = ClusterShape(workers=args.workers, memory_limit_bytes=parse_bytes(args.memory_limit),
                           threads_per_worker=args.threads, resting_bytes=parse_bytes(args.resting),
                           **_map_work_kwargs(work), **_allocation_kwargs(args))
    deadline = parse_seconds(args.deadline) if args.deadline is not None else None
    window = parse_seconds(args.window) if args.window is not None else deadline
    if args.utilisation is not None and window is None:
        raise SimulationInputError(f"--utilisation {args.utilisation:g} needs a window: give --window (or "
                                   "--deadline), e.g. --window 6h")
    summaries = simulate(args.strategies, steps, tuple(args.shape), cluster, models.knowledge, runs=args.runs,
                         seed=args.seed, deadline=deadline, truth_for=models.truth,
                         window=window if args.utilisation is not None else None,
                         target_utilisation=args.utilisation)
    note = _prior_note(models, args)
    traced = _simulated_trace(args, steps, cluster, models) if args.trace else None
    if args.json:
        _emit(json.dumps({"shape": list(args.shape), "cluster": dataclasses.asdict(cluster),
                          "steps": [dataclasses.asdict(s) for s in steps], "runs": args.runs,
                          "deadline": deadline, "from_prior": sorted(models.from_prior), "prior_note": note,
                          "trace": traced, "strategies": [s.to_dict() for s in summaries]}, indent=1))
        return EXIT_OK
    header = ["strategy", "completed", "makespan p50 s", "p90 s", "P(deadline)", "OOM/run", "lost worker-s",
              "utilisation", "core-hours", "energy p50", "peak/worker"]
    rows = [[s.strategy, f"{s.completed}/{s.runs}", _opt(s.makespan_p50, ".1f"), _opt(s.makespan_p90, ".1f"),
             _opt(s.p_deadline, ".2f"), f"{s.out_of_memory_mean:.2f}", f"{s.lost_worker_seconds_mean:.1f}",
             _opt(s.slot_utilisation_p50, ".2f"), _opt(s.core_hours_p50, ".3f"), _joules(s.energy_joules_p50),
             format_bytes(s.peak_bytes_max)] for s in summaries]
    _emit(f"{' -> '.join(s.operator for s in steps)} on {' x '.join(map(str, args.shape))}: {args.workers} workers x "
          f"{args.threads} thread(s), {format_bytes(cluster.memory_limit_bytes)} each (kill line less resting: "
          f"{format_bytes(cluster.headroom_bytes)}); {args.runs} simulated runs per strategy")
    _emit(table(header, rows))
    for s in summaries:
        if s.failure and s.completed < s.runs:
            _emit(f"{s.strategy} failed {s.runs - s.completed} of {s.runs} runs: {s.failure}")
    basis = next((s.energy_basis for s in summaries if s.energy_basis), "")
    if basis:
        _emit(_energy_note(basis))
    _emit(_map_work_note(work))
    allocation = _allocation_note(cluster, summaries)
    if allocation:
        _emit(allocation)
    for s in summaries:
        if s.allocation is not None:
            _emit(_utilisation_line(s))
    if note:
        _emit(note)
    if traced:
        _emit(f"wrote {traced}: the first simulated memchunk run (seed {args.seed}) as a WfFormat trace, validated")
    return EXIT_OK


def _simulated_trace(args: argparse.Namespace, steps: list[Any], cluster: Any, models: Any) -> str:
    """Write the memchunk strategy's run of seed ``args.seed`` (the summaries' first) as a validated trace."""
    import numpy as np

    from memchunk_prefect.sim.runs import run_strategy
    from memchunk_prefect.sim.trace import simulated_instance, write_instance

    result = run_strategy("memchunk", steps, tuple(args.shape), cluster, models.knowledge,
                          np.random.default_rng(args.seed), truth_for=models.truth)
    return str(write_instance(simulated_instance(result, steps, args.shape, cluster), args.trace))


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
        _emit(json.dumps(c, indent=1))
        return EXIT_OK

    def pair(v: tuple, fmt: str) -> str:
        x, y, r = v
        cell = f"{_opt(x, fmt)} / {_opt(y, fmt)}"
        return cell + ("" if r is None else f" ({100 * r:+.0f}%)")

    header = ["operator", "tasks", "failed", "task seconds", "mean s", "span s", "energy J"]
    rows = [[r["category"], pair(r["tasks"], "d"), pair(r["failed"], "d"), pair(r["runtime_seconds"], ".1f"),
             pair(r["mean_runtime_seconds"], ".2f"), pair(r["span_seconds"], ".1f"), pair(r["energy_joules"], ".0f")]
            for r in c["operators"]]
    _emit(f"A: {c['a']}\nB: {c['b']}\nmakespan: {pair(c['makespan_seconds'], '.1f')} s (B against A in brackets)")
    _emit(table(header, rows))
    return EXIT_OK


def _map_work_kwargs(work: Any) -> dict[str, Any]:
    """ClusterShape's per-map work from what the store measured (none: nothing added)."""
    return {} if work is None else {"map_start_seconds": work.start_seconds, "map_end_seconds": work.end_seconds}


def _map_work_note(work: Any) -> str:
    if work is None:
        return ("the runner's own work per map is not simulated: the store holds no map of a run recorded by this "
                "version (run a flow once with it to measure it)")
    return (f"the runner's own work per map: {work.start_seconds:.2f} s before its first task and "
            f"{work.end_seconds:.2f} s after its last (medians of {work.maps} maps in the store), in the memchunk "
            "strategy's makespan")


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


@register("recommend", "the cluster to ask for: fewest core-hours (or least energy) that meet a deadline, from what "
                       "was learned")
@arguments(_recommend_arguments)
def _recommend(args: argparse.Namespace) -> int:
    from memchunk_prefect.core.units import parse_seconds
    from memchunk_prefect.sim.inputs import Step
    from memchunk_prefect.sim.recommend import recommend

    steps = [Step.of(s) for s in _steps_of(args)]
    deadline = parse_seconds(args.deadline)
    models = _sim_models(args)
    work = models.map_work()
    rec = recommend(steps, tuple(args.shape), models.knowledge, deadline_seconds=deadline,
                    memory_options=[parse_bytes(m) for m in args.memory], max_workers=args.max_workers,
                    threads_per_worker=args.threads, confidence=args.confidence, runs=args.runs,
                    truth_for=models.truth, resting_bytes=parse_bytes(args.resting), objective=args.objective,
                    **_map_work_kwargs(work), **_allocation_kwargs(args))
    note = _prior_note(models, args)
    if args.json:
        _emit(json.dumps({"best": rec.best.to_dict() if rec.best else None, "jobqueue": rec.jobqueue_kwargs(),
                          "deadline_seconds": deadline, "confidence": args.confidence,
                          "from_prior": sorted(models.from_prior), "prior_note": note,
                          "tried": [c.to_dict() for c in rec.tried]}, indent=1))
        return EXIT_OK if rec.best else EXIT_FAILURE
    if note:
        _emit(note)
    survey = " x ".join(map(str, args.shape))
    if rec.best is None:
        _emit(f"no cluster of up to {args.max_workers} workers with {', '.join(args.memory)} each finishes "
              f"{' -> '.join(s.operator for s in steps)} on {survey} within {deadline:.0f} s with probability "
              f"{args.confidence:g} (tried {len(rec.tried)} shapes): allow more workers (--max-workers) or a later "
              "deadline")
        return EXIT_FAILURE
    b, s, jq = rec.best, rec.best.summary, rec.jobqueue_kwargs()
    assert jq is not None
    _emit(f"{' -> '.join(st.operator for st in steps)} on {survey}, deadline {deadline:.0f} s "
          f"(probability >= {args.confidence:g}):")
    _emit(f"  {b.workers} workers x {b.threads_per_worker} thread(s), {format_bytes(b.memory_limit_bytes)} each: "
          f"makespan p50 {s.makespan_p50:.0f} s, p90 {s.makespan_p90:.0f} s, P(deadline) {s.p_deadline:.2f}, "
          f"{s.core_hours_p50:.2f} core-hours, slot utilisation {s.slot_utilisation_p50:.2f}, "
          f"{s.out_of_memory_mean:.2f} out-of-memory events per run, energy p50 {_joules(s.energy_joules_p50)}"
          + (" (the least energy that meets it)" if args.objective == "energy" else ""))
    _emit(f"  dask-jobqueue: SLURMCluster(cores={jq['cores']}, processes={jq['processes']}, memory=\"{jq['memory']}\", "
          f"walltime=\"{jq['walltime']}\"); cluster.scale(jobs={jq['jobs']})")
    screened = sum(c.screened for c in rec.tried)
    _emit(f"  ({len(rec.tried)} cluster shapes simulated: {screened} searched with one run each, "
          f"{len(rec.tried) - screened} confirmed with up to {args.runs}; `--json` lists them)")
    if args.queue_wait is not None or args.walltime is not None:
        from memchunk_prefect.sim.inputs import ClusterShape

        shape = ClusterShape(workers=b.workers, memory_limit_bytes=b.memory_limit_bytes, **_allocation_kwargs(args))
        _emit("  " + str(_allocation_note(shape, [s])))
    if args.plot:
        from memchunk_prefect.sim.recommend import plot_recommendation

        _emit(f"  plot: {plot_recommendation(rec, args.plot)}")
    if s.energy_basis:
        _emit("  " + _energy_note(s.energy_basis))
    return EXIT_OK


# --------------------------------------------------------------------------- doctor


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="a Dask scheduler to check (default: what the runner would start locally)")
    p.add_argument("--output-dir", help="where chunked outputs go (default: $MEMCHUNK_OUTPUT_DIR or a temporary dir)")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("doctor", "check what the runner relies on (versions, Prefect API, store, cluster, GPU, energy counters)")
@arguments(_doctor_arguments)
def _doctor(args: argparse.Namespace) -> int:
    from memchunk_prefect.run.doctor import FAIL, run_checks

    checks = run_checks(address=args.address, store=args.store, output_dir=args.output_dir)
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        _emit(json.dumps({"ok": not failed, "checks": [c.to_dict() for c in checks]}, indent=1))
    else:
        _emit("\n".join(c.line() for c in checks))
        _emit(f"{len(failed)} problem(s) stop a run" if failed else "nothing stops a run")
    return EXIT_FAILURE if failed else EXIT_OK


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memchunk", description="Learned memory and chunking for Prefect flows.",
        epilog="Watch runs in the Prefect UI: `memchunk ui` (or `prefect server start`), then open "
               "http://127.0.0.1:4200 and set PREFECT_API_URL=http://127.0.0.1:4200/api for flows to report there.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add, _run) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--store", default=None,
                       help="the observation store (default: $MEMCHUNK_STORE, else <PREFECT_HOME>/memchunk/)")
        add(p)
        p.set_defaults(_run=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 bad input)."""
    # Prefect warns at import when it cannot create its home; the commands that need it say so with the fix
    # (memchunk_prefect.run.doctor), once.
    warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory", category=UserWarning)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args._run(args)
    except BudgetTooSmallError as exc:
        sys.stderr.write(f"memchunk {args.command}: {exc}\n")
        return EXIT_FAILURE
    except (BudgetError, UnknownOperatorError, VolumeError, SimulationInputError) as exc:
        sys.stderr.write(f"memchunk {args.command}: {exc}\n")
        return EXIT_USAGE
    except MemchunkError as exc:
        sys.stderr.write(f"memchunk {args.command}: {exc}\n")
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
