"""Where a cold start's time goes: the pipeline on an empty store, per operator, from the store's own records.

    python benchmarks/cold_start.py [--runs 3] [--settle 25] [--workload pipeline|heterogeneous]
                                    [--survey IL XL NT] [--json PATH] [--workdir DIR]

The full benchmark's ``memchunk-cold`` row, alone, ``--runs`` times, each on an
empty store of its own and a fresh cluster (the same harness: 2 single-thread
workers of 1 GiB, a local Prefect server, the 128 x 128 x 400 survey and
``flows.pipeline.DEFAULT_STEPS``; ``--workload heterogeneous``: that benchmark's
chain over 192 x 192 x 100, or ``--survey``). Per run and operator, read from the store
(``started_at`` and ``seconds`` of every chunk): the map's seconds from its first
chunk's start to its last chunk's end, its chunks, the traces its chunks read
(halo included; a survey's own traces are 16,384), and the slot-seconds its map left
idle (slots x the map's seconds less its chunks' seconds: the waits between probe
waves and plans), besides the flow's wall.

Run as a file path, it measures whichever ``memchunk_prefect`` Python finds first,
so an earlier commit can be measured with this script beside the current one::

    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python benchmarks/cold_start.py --runs 3

``--settle``: seconds to wait after the Prefect server and the cluster start, so
that the server's own start-up work does not land on the first run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SHAPE = (128, 128, 400)


def per_operator(store: str, slots: int = 2) -> dict[str, dict]:
    """Each operator's map in the store's (one) flow run: seconds first start to last end, chunks, traces read,
    and slot-seconds idle within the map (``slots`` x its seconds less the seconds its chunks ran)."""
    from memchunk_prefect.learn.store import Store

    out: dict[str, dict] = {}
    for obs in Store(store).observations():
        if obs.outcome != "ok" or obs.started_at is None:
            continue
        name = obs.operator_key.split("|")[0].split("[")[0]
        m = out.setdefault(name, {"start": float("inf"), "end": 0.0, "chunks": 0, "traces_read": 0, "busy": 0.0})
        m["start"] = min(m["start"], obs.started_at)
        m["end"] = max(m["end"], obs.started_at + obs.seconds)
        m["chunks"] += 1
        m["busy"] += obs.seconds
        m["traces_read"] += int(obs.extents[0]) * int(obs.extents[1])
    first = min((m["start"] for m in out.values()), default=0.0)
    return {name: {"map_seconds": round(m["end"] - m["start"], 3), "starts_at": round(m["start"] - first, 3),
                   "chunks": m["chunks"], "traces_read": m["traces_read"],
                   "idle_slot_seconds": round(max(0.0, slots * (m["end"] - m["start"]) - m["busy"]), 3)}
            for name, m in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/cold_start.py", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3, help="cold runs, each on an empty store (default 3)")
    p.add_argument("--settle", type=float, default=25.0, help="seconds to wait before the first run (default 25)")
    p.add_argument("--workload", choices=("pipeline", "heterogeneous"), default="pipeline",
                   help="python -m benchmarks's chain over 128 x 128 x 400 (default), or "
                        "python -m benchmarks.heterogeneous's over its first survey")
    p.add_argument("--survey", type=int, nargs=3, metavar=("IL", "XL", "NT"), help="another survey shape")
    p.add_argument("--json", metavar="PATH", help="write every run as JSON")
    p.add_argument("--workdir", metavar="DIR", help="where the survey, stores and outputs go (default: a temp dir)")
    args = p.parse_args(argv)
    # Before Prefect is imported, here and (inherited) in every spawned worker: no network, quiet logs.
    for name, value in (("PREFECT_SERVER_ANALYTICS_ENABLED", "false"), ("DO_NOT_TRACK", "1"),
                        ("PREFECT_LOGGING_LEVEL", "WARNING"), ("DASK_LOGGING__DISTRIBUTED", "warning")):
        os.environ.setdefault(name, value)
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    if args.survey and min(args.survey) < 1:
        p.error(f"--survey needs three positive extents, got {args.survey}")
    repo = Path(__file__).resolve().parents[2]
    sys.path.append(str(repo))  # `tasks`, `flows` and `benchmarks` where PYTHONPATH does not name them first
    import memchunk_prefect
    from benchmarks import strategies as st
    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect.operators.registry import DEFAULT_STEPS

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="memchunk-cold-")).absolute()
    workdir.mkdir(parents=True, exist_ok=True)
    steps: list[dict] = [dict(s) for s in DEFAULT_STEPS]
    shape: tuple[int, int, int] = SHAPE
    if args.workload == "heterogeneous":
        from benchmarks.heterogeneous import HETERO_STEPS, SURVEYS_FULL

        steps, shape = [dict(s) for s in HETERO_STEPS], SURVEYS_FULL[0]
    shape = (args.survey[0], args.survey[1], args.survey[2]) if args.survey else shape
    survey = st.make_survey(workdir / "survey-{}x{}x{}.sgy".format(*shape), shape)
    print(f"memchunk_prefect from {Path(memchunk_prefect.__file__).parent}", flush=True)
    runs: list[dict] = []
    with _prefect_api():
        bench = st.Bench(2, "1GiB", workdir)
        try:
            time.sleep(max(0.0, args.settle))
            for r in range(args.runs):
                store = str(workdir / f"cold-{r}.sqlite")
                res = bench.measure(f"memchunk-cold #{r + 1}", lambda s=store, r=r: st.run_memchunk(
                    bench, survey, steps, s, f"cold-{r}"))
                runs.append({"wall_seconds": round(res.wall_seconds, 3), "completed": res.completed,
                             "oom_events": res.oom_events, "notes": res.notes,
                             "operators": per_operator(store, bench.n_workers)})
        finally:
            bench.close()
    print(f"\n{'run':<5} {'wall s':>7}  " + "  ".join(f"{n + ' s / chunks / traces read / idle':>44}"
                                                     for n in runs[0]["operators"]))
    for i, run in enumerate(runs, start=1):
        print(f"{i:<5} {run['wall_seconds']:>7.2f}  " + "  ".join(
            f"{m['map_seconds']:>17.2f} / {m['chunks']:>2d} / {m['traces_read']:>8,d} / {m['idle_slot_seconds']:5.2f}"
            for m in run["operators"].values()))
    walls = [r["wall_seconds"] for r in runs]
    idle = [sum(m["idle_slot_seconds"] for m in r["operators"].values()) for r in runs]
    print(f"median wall {statistics.median(walls):.2f} s over {len(walls)} runs; "
          f"median slot-seconds idle within the maps {statistics.median(idle):.2f}")
    if args.json:
        code = str(Path(memchunk_prefect.__file__).parent)
        Path(args.json).write_text(json.dumps({"shape": list(shape), "workload": args.workload, "code": code,
                                               "runs": runs, "loadavg": list(os.getloadavg())}, indent=2))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
