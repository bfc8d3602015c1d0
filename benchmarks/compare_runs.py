"""Several full runs of ``python -m benchmarks`` side by side: one markdown row per result JSON.

    python -m benchmarks.compare_runs benchmarks/runs/side_by_side-*.json

One run's ratios move with its baseline: static-2 read 8.9 s in one run and 7.9-8.0 s in the
three after it, with memchunk's walls unchanged. A target is judged on the spread these rows show,
not on one of them. Columns: the fastest static-N that completed; memchunk-warm and -cold (wall and
ratio to that); learned over heuristic walls (warm / cold); the overhead ratio; per operator the
share of next runs within the bound, the mean error after 5 runs and the bound over the peak at
memchunk-warm's chunks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row(result: dict) -> str:
    """The markdown row of one result JSON (as written by ``python -m benchmarks --json``)."""
    by_name = {s["name"]: s for s in result["strategies"]}
    statics = [s for s in result["strategies"]
               if s["name"].startswith("static-") and s["name"] != "static-best" and s["completed"]]
    if not statics:
        raise ValueError("no static-N completed in this run: there is no baseline to compare against")
    best = min(statics, key=lambda s: s["wall_seconds"])
    base = best["wall_seconds"]

    def wall(name: str) -> float:
        return float(by_name[name]["wall_seconds"])

    warm, cold = wall("memchunk-warm"), wall("memchunk-cold")
    quality = "; ".join(
        f"{q['operator']} {q['coverage'] * 100:.0f}% / {q['mape'] * 100:.1f}% / {q['bound_at_chosen']:.2f}x"
        for q in result.get("learning_quality", []) if q.get("coverage") is not None)
    return (f"| {result['machine']['date'][:16]} | {best['name']} {base:.1f} s | {warm:.1f} s ({warm / base:.2f}x) | "
            f"{cold:.1f} s ({cold / base:.2f}x) | {warm / wall('heuristic-warm'):.2f}x / "
            f"{cold / wall('heuristic-cold'):.2f}x | {result['overhead_ratio']:.3f} | {quality} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", metavar="JSON", help="result files of python -m benchmarks --json")
    args = p.parse_args(argv)
    print("| run (UTC) | static-best | memchunk-warm | memchunk-cold | learned vs heuristic (warm / cold) | overhead "
          "| learning quality (within bound / MAPE / bound at chosen) |")
    print("|---|---|---|---|---|---|---|")
    for path in args.results:
        print(row(json.loads(Path(path).read_text())))


if __name__ == "__main__":
    main()
