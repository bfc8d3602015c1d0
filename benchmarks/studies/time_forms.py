"""The time form each operator's model read after each flow run, replayed from observation stores.

    python -m benchmarks.studies.time_forms STORE [STORE ...] [--time-gap-ratio R] [--time-curve-margin M]
        [--time-rising-gain G] [--fits] [--plans] [--json PATH]

A curved time form (``superlinear``, ``quadratic``) makes the planner cut smaller
chunks for speed; a line leaves it to the median seconds per element
(:meth:`memchunk_prefect.learn.time.TimeModel.time_form`). Each store's keys are
replayed in the order their observations were stored, and after each flow run's
rows the form is read, with the measured ratio of the largest blocks' seconds per
element to the smallest blocks' (:meth:`~memchunk_prefect.learn.time.TimeModel.rate_ratio`; above
``1 + time_curve_margin`` it supports a curve). Per operator (the key's name before its
parameters), over all the stores: how many flow runs left a curve, after the first
flow run (a cold start) and after later ones, and how many left the line named while a curve still
counted in part (its leave-one-out weight, where the rates rise). ``--time-gap-ratio inf`` replays as if
every curve were supported by the sizes measured (the model before the support test).

The benchmarks keep their stores with ``--workdir`` (``python -m benchmarks --workdir DIR``:
``DIR/memchunk-store*.sqlite`` and ``DIR/heuristic-store*.sqlite``;
``python -m benchmarks.heterogeneous --workdir DIR``: one per survey and round).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.studies.store_quality import operator_name, stored_keys


def forms(stores: list[str], **options: Any) -> dict[str, dict[str, Any]]:
    """Per operator name: ``cold`` / ``later`` (flow runs replayed, first in their store / after it),
    ``cold_curved`` / ``later_curved`` (of those, runs after which the form was curved), ``cold_partial`` /
    ``later_partial`` (runs after which the line was named yet a curve counted in part,
    :meth:`~memchunk_prefect.learn.time.TimeModel.time_curve_weight`), ``weights`` (that weight after each such
    run, in store order) and ``ratios`` (the largest blocks' rate over the smallest's after each flow run, in
    store order)."""
    from memchunk_prefect.learn.operator import OperatorModel

    out: dict[str, dict[str, Any]] = {}
    for _, key, history in stored_keys(stores):
        row = out.setdefault(operator_name(key),
                             {"cold": 0, "cold_curved": 0, "cold_partial": 0, "later": 0, "later_curved": 0,
                              "later_partial": 0, "weights": [], "ratios": []})
        model = OperatorModel(key, **options)
        runs: list[str] = []
        for obs in history:
            if runs and obs.flow_run_id != runs[-1]:
                _read(model, row, first=len(runs) == 1)
            if not runs or obs.flow_run_id != runs[-1]:
                runs.append(obs.flow_run_id)
            model.learn(obs)
        if runs:
            _read(model, row, first=len(runs) == 1)
    return out


def _read(model: Any, row: dict[str, Any], first: bool) -> None:
    kind = "cold" if first else "later"
    row[kind] += 1
    row[f"{kind}_curved"] += model.time_form() != "linear"
    weight, curve = model.time_curve_weight()
    if model.time_form() == "linear" and curve is not None and weight > 0:
        row[f"{kind}_partial"] += 1
        row["weights"].append(round(weight, 3))
    ratio = model.rate_ratio()
    if ratio is not None:
        row["ratios"].append(round(ratio, 3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.time_forms", description=__doc__.split("\n\n")[0])
    p.add_argument("stores", nargs="+", metavar="STORE")
    p.add_argument("--time-gap-ratio", type=float, default=None,
                   help="widest gap between consecutive sizes for a curve to stand on leave-one-out alone "
                        "(default the model's; inf: every curve supported)")
    p.add_argument("--time-curve-margin", type=float, default=None,
                   help="rise in seconds per element, largest blocks over smallest, that supports a curve otherwise")
    p.add_argument("--time-rising-gain", type=float, default=None,
                   help="where the measured rates rise, the leave-one-out error a curve must reach as a fraction of "
                        "the line's (default the model's; 0.9: the bar of a curve without that evidence)")
    p.add_argument("--fits", action="store_true",
                   help="also print, per stored key, each time form's leave-one-out error and coefficients after "
                        "all its runs (OperatorModel.time_fits), with the rate the planner uses for a line")
    p.add_argument("--plans", action="store_true",
                   help="also print, per operator and chunk count of the flow runs after each store's first, the "
                        "median task seconds of the map, kernel seconds of its first touches and MiB grown "
                        "(plan_costs)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    options = {k: v for k, v in (("time_gap_ratio", args.time_gap_ratio),
                                 ("time_curve_margin", args.time_curve_margin),
                                 ("time_rising_gain", args.time_rising_gain)) if v is not None}
    try:
        result = forms(args.stores, **options)
    except (FileNotFoundError, ValueError) as exc:
        p.error(str(exc))
    print(f"{'operator':<20} {'curved after a cold run':>24} {'curved after a later run':>25}  "
          f"{'line named, curve counted (cold / later, weights)':<52} rate ratio (largest/smallest)")
    for op, r in sorted(result.items()):
        ratios, weights = r["ratios"], r["weights"]
        span = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        part = f"{r['cold_partial']} / {r['later_partial']}" + (f" ({min(weights):.2f}-{max(weights):.2f})"
                                                                 if weights else "")
        print(f"{op:<20} {r['cold_curved']:>15} of {r['cold']:<6} {r['later_curved']:>16} of {r['later']:<6}  "
              f"{part:<52} {span}")
    if args.fits:
        for line in fit_lines(args.stores, **options):
            print(line)
    if args.plans:
        for line in plan_lines(args.stores, **options):
            print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"options": options, "operators": result}, indent=1))
    return 0


def plan_costs(stores: list[str], **options: Any) -> dict[str, dict[int, dict[str, Any]]]:
    """Per operator name and chunk count, over the flow runs after each store's first (the warm plans): how
    many maps ran that many chunks (``maps``; the count is the runs a flow run recorded for the key, one per
    chunk where the benchmarks map each operator once and nothing was retried or split), and the medians
    over them of the map's task seconds summed
    (``task_seconds``: slot-seconds), of the kernel CPU seconds of its first touches (``first_touch_seconds``:
    runs that grew their worker, :meth:`~memchunk_prefect.learn.time.TimeModel.first_touch`, whose time the model
    learns less their kernel time) and of the MiB its runs grew their workers by (``grew_mib``).

    What a plan cost, beside what the planner counts: compute by the learned time, per-task overhead, and no
    first touch, though a plan of larger chunks takes each fresh worker higher."""
    import statistics

    from memchunk_prefect.learn.operator import OperatorModel

    maps: dict[str, dict[int, list[tuple[float, float, float]]]] = {}
    for _, key, history in stored_keys(stores):
        model = OperatorModel(key, **options)
        runs: dict[str, list[Any]] = {}
        for obs in history:
            runs.setdefault(obs.flow_run_id, []).append(obs)
        for rows in list(runs.values())[1:]:
            touched = [o for o in rows if model.first_touch(o)]
            maps.setdefault(operator_name(key), {}).setdefault(len(rows), []).append(
                (sum(float(o.seconds) for o in rows), sum(float(o.sys_seconds or 0.0) for o in touched),
                 sum(int(o.grew_bytes or 0) for o in touched) / 2**20))
    return {op: {n: {"maps": len(v), "task_seconds": statistics.median(x[0] for x in v),
                     "first_touch_seconds": statistics.median(x[1] for x in v),
                     "grew_mib": statistics.median(x[2] for x in v)} for n, v in sorted(by_n.items())}
            for op, by_n in sorted(maps.items())}


def plan_lines(stores: list[str], **options: Any) -> list[str]:
    """:func:`plan_costs` as a table."""
    lines = [f"{'operator':<20} {'chunks':>6} {'maps':>5} {'task s (median)':>16} {'first-touch kernel s':>21} "
             f"{'MiB grown':>10}"]
    for op, by_n in plan_costs(stores, **options).items():
        for n, r in by_n.items():
            lines.append(f"{op:<20} {n:>6} {r['maps']:>5} {r['task_seconds']:>16.2f} "
                         f"{r['first_touch_seconds']:>21.2f} {r['grew_mib']:>10.0f}")
    return lines


def fit_lines(stores: list[str], **options: Any) -> list[str]:
    """Per stored key, after all its runs: the form chosen, and at up to six block sizes timed (smallest to
    largest), the median measured seconds, what each form predicts (with its leave-one-out error) and
    what the planner counts for a line (elements x the median seconds per element)."""
    import statistics

    from memchunk_prefect.learn.operator import OperatorModel

    lines = []
    for store, key, history in stored_keys(stores):
        model = OperatorModel(key, **options)
        for obs in history:
            model.learn(obs)
        runs = sorted(model.time._runs)  # (elements, compute seconds) the time forms were fitted on
        if not runs:
            continue
        sizes = sorted({e for e, _ in runs})
        picks = sorted({sizes[round(i * (len(sizes) - 1) / 5)] for i in range(6)})  # up to 6, smallest to largest
        measured = [statistics.median(s for e, s in runs if e == size) for size in picks]
        spe = model.seconds_per_element()
        lines.append(f"{Path(store).name} {key}: {model.time_form()}; blocks of "
                     + ", ".join(f"{e:,}" for e in picks) + " elements")
        lines.append(f"  {'measured':<12} {'':>24}  " + "  ".join(f"{m:7.3f} s" for m in measured))
        if spe is not None:
            lines.append(f"  {'line planned':<12} {'':>24}  " + "  ".join(f"{e * spe:7.3f} s" for e in picks))
        for name, fit in model.time_fits(picks).items():
            lines.append(f"  {name:<12} leave-one-out {fit['press']:.4f}  "
                         + "  ".join(f"{v:7.3f} s" for v in fit["seconds"]))
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
