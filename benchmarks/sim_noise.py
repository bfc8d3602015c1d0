"""``python -m benchmarks.sim_noise A.json B.json [...]``: how much of the simulator's validation error repeats.

A validation run (:mod:`benchmarks.sim_validation`) runs the workload family for real and predicts each real run
from stores that the run's own cold flow runs taught. Its error on one row is three things at once: what the
simulator misses on that flow every time (a bias: a mechanism it lacks or gets wrong), how the models it read
were learned (a few runs of noisy tasks: another cold run teaches other figures), and how that one real run
strayed (the machine). Two validation runs of the same family, each with its own cold runs and real runs, tell
the first apart from the other two:

- ``noise_sigma``: for each flow both runs predicted (workload, strategy, and for warm runs which one), the
  log error of every real run of one validation run less that of every real run of the other
  (``ln(1 + e_a) - ln(1 + e_b)``): a bias cancels there, learning and run noise do not. Its spread (1.4826 x the
  median absolute difference, over the square root of 2: each side carries its own noise) is the noise in one
  row's error, log terms;
- ``floor``: what a simulator with no bias at all would score against such runs, with that noise: the median
  and the worst absolute error over as many rows as a validation run has, the medians of ``draws`` seeded draws
  (``|exp(x) - 1|``, ``x`` normal with ``noise_sigma``). Under the targets, the noise leaves room for a bias;
  over them, no simulator reading stores learned this way meets them on this machine;
- ``repeated``: the flows whose error had the same sign in both runs, beyond ``repeat_share`` in each: a bias
  to fix, not noise (the mean of the two runs' median log errors, as a share);
- ``predictions_apart`` and ``real_apart``: how far the two runs' predictions of one flow, and their real runs,
  fall apart (the larger over the smaller; the machine's speed on the two days moves both).

Replay the runs at one commit first (``python -m benchmarks.sim_validation --replay R.json --work DIR --json
R2.json``), so their predictions differ only by the stores they read.

    python -m benchmarks.sim_noise run-a.json run-b.json --json sim-noise.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: A flow's error counts as repeated when it lies beyond this share, the same way, in both runs.
REPEAT_SHARE = 0.10


def flows(doc: dict[str, Any]) -> dict[tuple[str, str, int], dict[str, Any]]:
    """A validation run's completed rows by flow: (workload, strategy, n), where ``n`` counts the warm runs of
    ``memchunk`` (each predicted from its own store) and is 0 for a plain flow run ``--repeats`` times (its runs
    share one prediction). Each flow: its prediction's p50 and its real runs' makespans and log errors."""
    out: dict[tuple[str, str, int], dict[str, Any]] = {}
    warm: dict[str, int] = {}
    for r in doc["rows"]:
        if r.get("error") is None or not r.get("predicted"):
            continue
        n = 0
        if r["kind"].startswith("memchunk"):
            n = warm[r["workload"]] = warm.get(r["workload"], -1) + 1
        f = out.setdefault((r["workload"], r["kind"] if r["kind"].startswith("memchunk") else r["strategy"], n),
                           {"predicted": float(r["predicted"]["makespan_p50"]), "real": [], "log_errors": []})
        f["real"].append(float(r["real"]["makespan_seconds"]))
        f["log_errors"].append(math.log1p(float(r["error"])))
    return out


def _apart(a: float, b: float) -> float:
    """How far two positive figures lie apart, the same either way round: the larger over the smaller, less 1."""
    return max(a, b) / min(a, b) - 1.0


def noise(docs: list[dict[str, Any]], *, draws: int = 1000, seed: int = 0,
          repeat_share: float = REPEAT_SHARE) -> dict[str, Any]:
    """The figures of the module docstring over every pair of ``docs`` (validation runs of one family)."""
    if len(docs) < 2:
        raise ValueError(f"the noise needs two validation runs or more, got {len(docs)}")
    per_run = [flows(d) for d in docs]
    diffs: list[float] = []
    preds: list[float] = []
    reals: list[float] = []
    repeated: dict[tuple[str, str, int], list[float]] = {}
    for a, b in itertools.combinations(per_run, 2):
        for key in sorted(set(a) & set(b)):
            fa, fb = a[key], b[key]
            diffs += [x - y for x in fa["log_errors"] for y in fb["log_errors"]]
            preds.append(_apart(fa["predicted"], fb["predicted"]))
            reals += [_apart(x, y) for x in fa["real"] for y in fb["real"]]
            ma, mb = statistics.median(fa["log_errors"]), statistics.median(fb["log_errors"])
            if min(abs(ma), abs(mb)) > math.log1p(repeat_share) and ma * mb > 0:
                repeated.setdefault(key, []).append(math.expm1((ma + mb) / 2))
    if not diffs:
        raise ValueError("the validation runs share no completed flow: run both on the same --seed and workloads")
    sigma = 1.4826 * statistics.median(abs(d) for d in diffs) / math.sqrt(2.0)
    rows = round(statistics.median(sum(len(f["log_errors"]) for f in run.values()) for run in per_run))
    x = np.random.default_rng(seed).normal(0.0, sigma, size=(int(draws), rows))
    errors = np.abs(np.expm1(x))
    return {"runs": len(docs), "flows": len(preds), "pairs": len(diffs), "rows": rows,
            "noise_sigma": sigma,
            "floor": {"median_abs_error": float(np.median(np.median(errors, axis=1))),
                      "worst_abs_error": float(np.median(errors.max(axis=1))), "draws": int(draws)},
            "predictions_apart": {"median": statistics.median(preds), "worst": max(preds)},
            "real_apart": {"median": statistics.median(reals), "worst": max(reals)},
            "repeat_share": repeat_share,
            "repeated": sorted(({"workload": k[0], "run": k[1], "n": k[2], "error": statistics.median(v)}
                                for k, v in repeated.items()), key=lambda r: -abs(r["error"]))}


def lines(result: dict[str, Any]) -> list[str]:
    """The figures as sentences."""
    f, p, r = result["floor"], result["predictions_apart"], result["real_apart"]
    rep = result["repeated"]
    listed = "; ".join(f"{x['workload'].split('-')[0]} {x['run']} {100 * x['error']:+.0f}%" for x in rep) or "none"
    return [f"{result['runs']} validation runs, {result['flows']} flows predicted in two of them "
            f"({result['pairs']} pairs of real runs): the noise in one row's error, {100 * result['noise_sigma']:.0f}% "
            "(log terms; what changes from one validation run to the next)",
            f"a simulator with no bias, with that noise, over {result['rows']} rows: median absolute error "
            f"{100 * f['median_abs_error']:.0f}%, worst {100 * f['worst_abs_error']:.0f}% (medians of "
            f"{f['draws']} draws)",
            f"one flow's predictions from two runs' stores: {100 * p['median']:.0f}% apart at the median, "
            f"{100 * p['worst']:.0f}% at worst; its real runs in those two: {100 * r['median']:.0f}% and "
            f"{100 * r['worst']:.0f}% (the machine's speed on each day moves both)",
            f"errors beyond {100 * result['repeat_share']:.0f}% the same way in two runs (a bias, not noise): "
            + listed]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sim_noise", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="the --json of validation runs of one family")
    p.add_argument("--draws", type=int, default=1000, help="seeded draws of the unbiased simulator's rows")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    docs = []
    for path in args.runs:
        try:
            docs.append(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"cannot read the validation run {path}: {exc}")
    if any(d.get("benchmark") != "sim_validation" for d in docs):
        p.error("every RUN.json is the --json of python -m benchmarks.sim_validation")
    try:
        result = noise(docs, draws=args.draws)
    except ValueError as exc:
        p.error(str(exc))
    print("\n".join(lines(result)))
    if args.json:
        sources = [{"path": path, "commit": d.get("machine", {}).get("commit"),
                    "real_runs_commit": (d.get("replayed_from") or {}).get("commit") or d.get("machine", {}).get(
                        "commit"), "started": d.get("started")} for path, d in zip(args.runs, docs)]
        from benchmarks.__main__ import machine_info

        Path(args.json).write_text(json.dumps({"benchmark": "sim_noise", "machine": machine_info(), "sources": sources,
                                               **result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
