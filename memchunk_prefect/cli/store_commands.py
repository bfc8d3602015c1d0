"""The ``memchunk`` subcommands on the observation store: ``models``, ``forget``, ``compact``, ``export``, ``plan``.

What was learned per operator key, deleting or thinning it, exporting it (CSV, JSON, or one
flow run as a WfCommons trace), and the chunking the runner would choose from it, without
running anything. Memory in bytes (``--budget`` and ``--held`` accept ``2GiB``, ``512MiB``...).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Sequence

from memchunk_prefect.cli.format import models_table
from memchunk_prefect.cli.registry import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    arguments,
    emit,
    open_store,
    register,
)
from memchunk_prefect.core.errors import UnknownOperatorError, VolumeError, format_bytes
from memchunk_prefect.core.units import parse_bytes

# --------------------------------------------------------------------------- models


@register("models", "per operator key: observations, bytes per element, fixed overhead, when its memory peaks, "
                    "recent error, coverage, energy per element")
@arguments(lambda p: p.add_argument("--json", action="store_true", help="print JSON instead of a table"))
def _models(args: argparse.Namespace) -> int:
    from memchunk_prefect.learn.bank import ModelBank

    with open_store(args) as store:
        bank = ModelBank(store)
        rows = [{**bank.model(k).summary(), "policy": bank.learner(k).summary()} for k in store.keys()]
        path = str(store.path)
    if args.json:
        emit(json.dumps({"store": path, "models": rows}, indent=1))
    elif not rows:
        emit(f"no observations yet in {path}; run a flow with MemoryAwareRunner (or `memchunk demo`)")
    else:
        emit(models_table(rows))
        emit("recent error: mean absolute % error of the mean prediction on each next observation; "
              "coverage: share of next observations within the upper bound; fixed overhead: per chunk, "
              "+ once: the most a library's first use in a chunk left held in its worker (a CUDA context), paid "
              "once per worker process; peak at: when in its runs a block's memory first reached half/90% of its "
              "peak, as shares of the run (what a block that does not fit gets through before its worker dies); "
              "policy: the learned policy's arms "
              "(risk levels of the bound: bold, mid, safe) with their mean reward (slot efficiency less 1 per "
              "out-of-memory chunk) x plans taught, !n out-of-memory events; time: the form of compute seconds "
              "against block size, runs learned (+ set aside for a first touch of memory), the kernel "
              "seconds per GiB runs paid to grow their worker past the most it had held (s/GiB: what a plan "
              "counts for growing fresh workers), seconds per element of the largest blocks over the "
              "smallest, how far runs strayed from it (~: the spread the simulator draws a block's seconds "
              "with), and what a worker process's first call of the operator took beyond a later one (paid "
              "once per worker process); energy/element: learned joules per "
              "element (halo included), measured by a counter (rapl, nvml) or est(imated: CPU seconds x "
              "watts_per_core where no counter can be read)")
    return EXIT_OK


# --------------------------------------------------------------------------- forget / export


@register("forget", "delete every observation of one operator key")
@arguments(lambda p: p.add_argument("key", help="the exact operator key, as `memchunk models` lists it"))
def _forget(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        keys = store.keys()
        if args.key not in keys:
            raise UnknownOperatorError(f"no observations under {args.key!r} in {store.path}; "
                                       f"known keys: {', '.join(keys) or 'none'}")
        n = store.forget(args.key)
    emit(f"forgot {n} observation{'s' if n != 1 else ''} of {args.key}")
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
    with open_store(args) as store:
        if args.key is not None and args.key not in store.keys():
            raise UnknownOperatorError(f"no observations under {args.key!r} in {store.path}; "
                                       f"known keys: {', '.join(store.keys()) or 'none'}")
        deleted = store.compact(args.keep, args.key)
        left = store.count()
    emit(f"deleted {deleted['observations']} observations, {deleted['rewards']} policy rewards and "
          f"{deleted['maps']} map records; {left} observations kept")
    return EXIT_OK


def _export_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("csv", "json", "wfcommons"), default="csv",
                   help="csv or json: every observation in the store (default csv); wfcommons: a WfFormat trace of "
                        "one flow run (--flow-run), validated before it is written (needs `pip install "
                        "'memchunk-prefect[trace]'`; docs/how-to/traces.md)")
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
    with open_store(args) as store:
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
    with open_store(args) as store:
        path = export_wfcommons(args.flow_run, store, args.output, schema=args.schema, author=args.author,
                                email=args.email)
    s = summary(json.loads(path.read_text(encoding="utf-8")))
    energy = (f"{s['energy_kwh'] * 3.6e6:.1f} J ({', '.join(s['energy_sources'])})" if s["energy_sources"]
              else "no energy recorded")
    emit(f"wrote {path}: WfFormat {s['schema_version']}, validated; {s['tasks']} tasks ({s['failed']} failed "
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
    from memchunk_prefect.learn.bank import ModelBank

    budget = parse_bytes(args.budget)
    held = parse_bytes(args.held) if args.held is not None else 0
    if args.halo is not None and len(args.halo) not in (1, 3):
        raise VolumeError(f"--halo takes one int (every axis) or three (iline xline twt), got {args.halo}")
    if args.slots < 1:
        raise VolumeError(f"--slots must be at least 1, got {args.slots}")
    with open_store(args) as store:
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
        emit(json.dumps(out, indent=1))
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
    emit("\n".join(lines))
    return EXIT_OK

