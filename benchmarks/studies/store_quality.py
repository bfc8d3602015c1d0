"""How well the memory model predicted the runs in observation stores, replayed: per operator, over every store given.

    python -m benchmarks.studies.store_quality STORE [STORE ...] [--after 5] [--superlinear-gain G] \
        [--noise-floor-mib M]
                                      [--size-weight W] [--memory-gap-ratio R]
                                      [--memory-gap-gain G] [--explain OPERATOR | --tight | --gap] [--json PATH]

Each store's keys are replayed in the order their observations were stored
(:func:`benchmarks.quality.replay_quality`): every ``ok`` run is predicted before
it is learned, once the model is ready and has ``--after`` runs. Per operator (the
key's name before its parameters), over all the stores: runs scored, the share
within the upper bound (the worst store's share beside it), the mean absolute error
of the predicted mean, and the mean bound over the measured peak; beside them the
floor of blocks of one shape run again (:func:`benchmarks.quality.repeatability`:
what no model predicting from the block's shape beats on these runs). The stores of the
benchmarks are kept with ``--workdir`` (``python -m benchmarks --workdir DIR``:
``DIR/memchunk-store.sqlite``; ``python -m benchmarks.heterogeneous --workdir DIR``:
one per survey). ``--superlinear-gain`` replays with another threshold for choosing a
curved memory form, ``--noise-floor-mib`` with another noise floor added to each peak
when scaling rows, ``--size-weight`` with another weight of small blocks against the
largest, ``--memory-gap-ratio`` with another widest step in size that supports a curved memory form (``inf``:
any step, as before that test) (:class:`memchunk_prefect.learn.operator.OperatorModel`), to compare.

Below that table, per operator: how much more a worker's first run of a key needed than its later
runs of a block of the same size (:func:`first_run_excess`), over the sizes where both kinds ran.

``--explain OPERATOR`` prints instead, for each of that operator's runs in each store, what its upper
bound was made of before the run was learned (:func:`explain_runs`): why a bound was what it was.

``--tight`` prints instead, per operator, the tight bound (what the learned policy's ``bold`` arm plans to)
over the measured peak for every run of a block larger than any measured before it (:func:`tight_beyond`).

``--gap`` prints instead, per operator, the runs predicted while a curved memory form the sizes measured do not
support was chosen (on leave-one-out alone, ``memory_gap_gain``): the curve's mean beside the line's, within the
sizes measured and beyond the largest (:func:`gap_curves`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Iterable, Iterator

MIB = 2**20


def operator_name(key: str) -> str:
    """The operator of a key, before its parameters: ``gaussian_smooth[sigma=2,2,2]|float32|cpu`` ->
    ``gaussian_smooth``."""
    return key.split("|")[0].split("[")[0]


def stored_keys(stores: Iterable[str]) -> Iterator[tuple[str, str, list[Any]]]:
    """``(store path, key, the key's observations in stored order)`` for every key of every store; a path
    that is not a file raises :class:`FileNotFoundError` before anything is read from it (opening a missing
    path would create an empty store)."""
    from memchunk_prefect.learn.store import Store

    for path in stores:
        if not Path(path).is_file():
            raise FileNotFoundError(f"no observation store at {path!r}: give the .sqlite files a benchmark's "
                                    "--workdir kept (or a Prefect home's memchunk/observations.sqlite)")
        with Store(path) as store:
            for key in store.keys():
                yield path, key, list(store.observations(key))


def first_run_excess(rows: Iterable[Any]) -> list[float]:
    """Per block size (elements) where a worker's first run of the key and later runs of it were both
    measured (``ok``, usable, worker known): the median peak of the first runs less the median peak of the
    later ones, MiB. ``rows``: one key's observations in the order they were stored.

    A worker's first run of an operator needs memory once that its later runs find already held (the pages
    of the libraries and caches it loads stay in the worker's resting memory); the memory model cannot tell
    it from the fixed overhead, and a cold start's probes are all first runs.
    """
    seen: set[str] = set()
    first: dict[int, list[float]] = {}
    later: dict[int, list[float]] = {}
    for o in rows:
        if o.outcome != "ok" or not o.usable or not o.worker or o.peak_bytes <= 0:
            continue
        (later if o.worker in seen else first).setdefault(int(o.elements), []).append(o.peak_bytes / MIB)
        seen.add(o.worker)
    return [statistics.median(first[e]) - statistics.median(later[e]) for e in sorted(first) if e in later]


def explain_runs(rows: Iterable[Any], key: str, **options: Any) -> list[dict[str, Any]]:
    """Per ``ok`` run of ``key`` in ``rows`` (stored order), once the model is ready: the run's block and
    peak (bytes) beside :meth:`memchunk_prefect.learn.memory.MemoryModel.explain` of its block, read before the
    run is learned."""
    from memchunk_prefect.learn.operator import OperatorModel

    m = OperatorModel(key, **options)
    out = []
    for o in rows:
        if o.operator_key != key:
            continue
        if o.outcome == "ok" and o.usable and o.peak_bytes > 0 and m.predict(o.extents).ready:
            out.append({"extents": tuple(o.extents), "peak_bytes": o.peak_bytes, **m.explain(o.extents)})
        m.learn(o)
    return out


def _explain(stores: list[str], operator: str, **options: Any) -> None:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v / MIB:.1f}"

    for path, key, history in stored_keys(stores):
        if operator_name(key) != operator:
            continue
        print(f"{path}: {key}")
        print(f"  {'block':>16s} {'x largest':>9s} {'peak':>7s} {'mean':>7s} {'upper':>7s} {'tight':>7s} "
              f"{'form':>11s} {'its bound':>9s}  curved form blended in (bound, weight)")
        for r in explain_runs(history, key, **options):
            curved = (f"{r['curved_form']} {mib(r['curved_upper_bytes'])}, {r['curved_weight']:.2f}"
                      if r["curved_form"] else "-")
            print(f"  {str(r['extents']):>16s} {r['times_largest']:9.2f} {mib(r['peak_bytes']):>7s} "
                  f"{mib(r['mean_bytes']):>7s} {mib(r['upper_bytes']):>7s} {mib(r['tight_bytes']):>7s} "
                  f"{r['form']:>11s} {mib(r['form_upper_bytes']):>9s}  {curved}")


def tight_beyond(stores: list[str], **options: Any) -> dict[str, dict[str, Any]]:
    """Per operator name, over every ``ok`` run of a block larger than any its model had measured (replayed in
    stored order, each read before it is learned): ``runs``, ``under`` (runs whose tight bound, what the
    learned policy's ``bold`` arm plans to, was below the measured peak), and tight / peak's ``median``,
    ``p10`` and ``over_1_25`` (runs above the 1.25x goal). Beyond the largest block is where the bold bet
    is taken and where the forms part."""
    ratios: dict[str, list[float]] = {}
    for _, key, history in stored_keys(stores):
        for r in explain_runs(history, key, **options):
            if r["times_largest"] is not None and r["times_largest"] > 1.0 and r["tight_bytes"]:
                ratios.setdefault(operator_name(key), []).append(r["tight_bytes"] / r["peak_bytes"])
    out = {}
    for op, v in sorted(ratios.items()):
        v.sort()
        out[op] = {"runs": len(v), "under": sum(x < 1.0 for x in v), "median": statistics.median(v),
                   "p10": v[len(v) // 10], "over_1_25": sum(x > 1.25 for x in v)}
    return out


def gap_curves(stores: list[str], **options: Any) -> dict[str, dict[str, Any]]:
    """Per operator name, over every ``ok`` run predicted while the chosen memory form was a curve the sizes
    measured do not support (taken on leave-one-out alone: ``OperatorModel.memory_gap_gain``), replayed in
    stored order, each read before it is learned: ``within`` (runs of a block no larger than the largest
    measured) with the chosen form's and the line's mean absolute error there (``mape_curve``,
    ``mape_line``); ``beyond`` (larger blocks) with the chosen mean over the peak and the line's mean over the
    peak (``curve_over_peak``, ``line_over_peak``: sorted lists). Whether the exception's curve reads the next,
    larger block better than the line would have."""
    within: dict[str, list[tuple[float, float]]] = {}
    beyond: dict[str, list[tuple[float, float]]] = {}
    for _, key, history in stored_keys(stores):
        for r in explain_runs(history, key, **options):
            if r["form"] == "linear" or r["curve_supported"] is not False:
                continue
            pair = (r["mean_bytes"] / r["peak_bytes"], r["line_mean_bytes"] / r["peak_bytes"])
            (beyond if r["times_largest"] > 1.0 else within).setdefault(operator_name(key), []).append(pair)
    out = {}
    for op in sorted(set(within) | set(beyond)):
        w, b = within.get(op, []), beyond.get(op, [])
        out[op] = {"within": len(w), "beyond": len(b),
                   "mape_curve": statistics.mean(abs(c - 1) for c, _ in w) if w else None,
                   "mape_line": statistics.mean(abs(line - 1) for _, line in w) if w else None,
                   "curve_over_peak": sorted(c for c, _ in b), "line_over_peak": sorted(line for _, line in b)}
    return out


def quality(stores: list[str], after: int = 5, **options: Any) -> dict[str, dict[str, Any]]:
    """Per operator name: ``scored``, ``coverage``, ``worst_coverage``, ``mape``, ``bound_over_peak``, ``stores``,
    ``mape_within`` / ``mape_beyond`` (runs inside the sizes learned / beyond them, ``scored_beyond`` of them),
    and the repeated blocks' ``floor_mape`` / ``floor_bound_over_peak`` over ``repeated_runs`` (None if none)."""
    from benchmarks.quality import repeatability, replay_quality

    per_op: dict[str, list[dict]] = {}
    excess: dict[str, list[float]] = {}
    for _, key, history in stored_keys(stores):
        q = replay_quality(history, key, after=after, **options)
        q["floor"] = repeatability(history, key)
        op = operator_name(key)
        excess.setdefault(op, []).extend(first_run_excess(history))
        if q["scored"]:
            per_op.setdefault(op, []).append(q)
    out = {}
    for op, qs in sorted(per_op.items()):
        n = sum(q["scored"] for q in qs)
        out[op] = {"scored": n, "stores": len(qs),
                   "coverage": sum(q["coverage"] * q["scored"] for q in qs) / n,
                   "worst_coverage": min(q["coverage"] for q in qs),
                   "mape": sum(q["mape"] * q["scored"] for q in qs) / n,
                   "bound_over_peak": sum(q["bound_over_peak"] * q["scored"] for q in qs) / n}
        far = sum(q["scored_beyond"] for q in qs)
        near = n - far
        out[op].update(scored_beyond=far,
                       mape_beyond=sum((q["mape_beyond"] or 0) * q["scored_beyond"] for q in qs) / far if far else None,
                       mape_within=(sum((q["mape_within"] or 0) * (q["scored"] - q["scored_beyond"]) for q in qs) / near
                                    if near else None))
        floors = [q["floor"] for q in qs if q["floor"]["runs"]]
        runs = sum(f["runs"] for f in floors)
        out[op].update(repeated_runs=runs,
                       floor_mape=sum(f["floor_mape"] * f["runs"] for f in floors) / runs if runs else None,
                       floor_bound_over_peak=(sum(f["floor_bound_over_peak"] * f["runs"] for f in floors) / runs
                                              if runs else None))
        ex = sorted(excess.get(op, []))
        out[op].update(first_run_sizes=len(ex), first_run_excess_mib=statistics.median(ex) if ex else None,
                       first_run_excess_range_mib=(ex[0], ex[-1]) if ex else None)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.store_quality", description=__doc__.splitlines()[0])
    p.add_argument("stores", nargs="+", metavar="STORE")
    p.add_argument("--after", type=int, default=5, help="runs learned before one is scored (default 5)")
    p.add_argument("--superlinear-gain", type=float, default=None)
    p.add_argument("--memory-gap-ratio", type=float, default=None,
                   help="the widest step between consecutive sizes that supports a curved memory form "
                        "(OperatorModel.memory_gap_ratio; inf: any, as before the support test)")
    p.add_argument("--memory-gap-gain", type=float, default=None,
                   help="the leave-one-out error, as a fraction of the line's, that a curved memory form the sizes "
                        "do not support must reach (OperatorModel.memory_gap_gain)")
    p.add_argument("--size-weight", type=float, default=None,
                   help="the model's size weight (a block counts (size / largest) ** this in the fit; default: "
                        "the model's)")
    p.add_argument("--noise-floor-mib", type=float, default=None,
                   help="the model's noise floor in MiB (default: the model's, 4)")
    p.add_argument("--explain", metavar="OPERATOR",
                   help="for each of OPERATOR's runs (e.g. envelope), what its bound was made of before it ran")
    p.add_argument("--tight", action="store_true",
                   help="the tight bound (the bold arm's) over the peak, for runs beyond the largest block measured")
    p.add_argument("--gap", action="store_true",
                   help="runs predicted by a curved memory form the sizes do not support: its mean and the line's")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    options: dict[str, float] = {}
    if args.superlinear_gain is not None:
        options["superlinear_gain"] = args.superlinear_gain
    if args.size_weight is not None:
        options["size_weight"] = args.size_weight
    if args.memory_gap_ratio is not None:
        options["memory_gap_ratio"] = args.memory_gap_ratio
    if args.memory_gap_gain is not None:
        options["memory_gap_gain"] = args.memory_gap_gain
    if args.noise_floor_mib is not None:
        options["noise_floor_bytes"] = args.noise_floor_mib * 2**20
    if args.explain:
        _explain(args.stores, args.explain, **options)
        return 0
    if args.gap:
        gap = gap_curves(args.stores, **options)

        def span(v: list[float]) -> str:
            return f"{statistics.median(v):.2f}x ({v[0]:.2f}-{v[-1]:.2f})" if v else "-"

        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v * 100:.1f}%"

        print(f"{'operator':20s} {'within':>6s} {'MAPE curve':>10s} {'line':>6s} {'beyond':>6s} "
              f"{'curve mean / peak':>22s} {'line mean / peak':>22s}")
        for op, r in gap.items():
            print(f"{op:20s} {r['within']:6d} {pct(r['mape_curve']):>10s} {pct(r['mape_line']):>6s} {r['beyond']:6d} "
                  f"{span(r['curve_over_peak']):>22s} {span(r['line_over_peak']):>22s}")
        if args.json:
            Path(args.json).write_text(json.dumps(gap, indent=2))
        return 0
    if args.tight:
        tight = tight_beyond(args.stores, **options)
        print(f"{'operator':20s} {'runs beyond':>11s} {'tight < peak':>12s} {'median':>7s} {'p10':>6s} {'> 1.25x':>7s}")
        for op, r in tight.items():
            print(f"{op:20s} {r['runs']:11d} {r['under']:12d} {r['median']:6.3f}x {r['p10']:5.3f}x {r['over_1_25']:7d}")
        if args.json:
            Path(args.json).write_text(json.dumps(tight, indent=2))
        return 0
    rows = quality(args.stores, args.after, **options)
    print(f"{'operator':20s} {'scored':>6s} {'stores':>6s} {'within bound':>12s} {'(worst store)':>13s} "
          f"{'MAPE':>6s} {'bound/peak':>10s} {'MAPE within / beyond (runs)':>28s}  "
          "floor of repeated blocks (MAPE, bound/peak, runs)")
    for op, r in rows.items():
        floor = (f"{r['floor_mape'] * 100:.1f}%, {r['floor_bound_over_peak']:.2f}x, {r['repeated_runs']}"
                 if r["repeated_runs"] else "-")
        def pct(v: float | None) -> str:
            return "-" if v is None else f"{v * 100:.1f}%"

        split = f"{pct(r['mape_within'])} / {pct(r['mape_beyond'])} ({r['scored_beyond']})"
        print(f"{op:20s} {r['scored']:6d} {r['stores']:6d} {r['coverage'] * 100:11.1f}% "
              f"{r['worst_coverage'] * 100:12.0f}% {r['mape'] * 100:5.1f}% {r['bound_over_peak']:9.2f}x "
              f"{split:>28s}  {floor}")
    print("\na worker's first run of a key above its later runs of a block of the same size (MiB; over the sizes, "
          "in every store, where both ran):")
    for op, r in rows.items():
        if r["first_run_sizes"]:
            lo, hi = r["first_run_excess_range_mib"]
            print(f"{op:20s} median {r['first_run_excess_mib']:5.1f}  range {lo:5.1f} to {hi:5.1f}  "
                  f"over {r['first_run_sizes']} sizes")
        else:
            print(f"{op:20s} -")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
