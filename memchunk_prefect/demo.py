"""The demo: a synthetic survey through envelope -> gaussian_smooth -> gst3d_dip, chunked by the runner.

``memchunk demo`` (or ``python -m memchunk_prefect.demo``) generates a synthetic
post-stack survey once, then runs the ``attribute-pipeline`` flow on a local Dask
cluster of single-thread worker processes with a deliberately small memory limit
(1 GiB per worker by default: the nanny kills at 0.95 of it, and a worker rests at
~0.25 GiB), so the structure tensor (about 42x its input here, ~1.05 GiB for the
whole survey) cannot run on the survey in one piece. It prints, per operator, what the runner
decided and why, the out-of-memory events avoided and recovered, and where the
outputs and the run in the Prefect UI are. The observations go to the default
store, so a second ``memchunk demo`` starts warm (``memchunk models`` shows them).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any, Sequence

from .settings import ITEMSIZE

#: 128 x 128 x 400 float32 = 25 MiB; gst3d_dip needs ~1.05 GiB above resting memory for it in one piece.
DEFAULT_SHAPE = (128, 128, 400)
DEFAULT_WORKERS = 2
#: Below what gst3d_dip needs in one piece: the budget per task is the kill line (0.95 x 1 GiB) less the
#: worker's resting memory, ~0.7 GiB. (It was 1.5 GiB while the budget was 0.75 x the limit; with the kill-line
#: budget, ~1.2 GiB at 1.5 GiB, the whole survey fit and the demo no longer showed chunking by necessity.)
DEFAULT_MEMORY_LIMIT = "1GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="memchunk-demo", help="where the survey and outputs go (default: ./memchunk-demo)")
    p.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "T"), default=list(DEFAULT_SHAPE),
                   help=f"survey shape (default: {' '.join(map(str, DEFAULT_SHAPE))})")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="worker processes (one thread each)")
    p.add_argument("--memory-limit", default=DEFAULT_MEMORY_LIMIT,
                   help=f"memory limit per worker, enforced by Dask's nanny (default {DEFAULT_MEMORY_LIMIT})")


def ensure_survey(directory: Path, shape: Sequence[int]) -> Path:
    """The demo survey for ``shape``, generated once (its name carries the shape)."""
    from .volume import synthetic_survey

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"survey-{shape[0]}x{shape[1]}x{shape[2]}.sgy"
    if not path.exists():
        t = time.perf_counter()
        synthetic_survey(path, tuple(shape), seed=0)
        print(f"generated synthetic survey {path} ({shape[0]} x {shape[1]} x {shape[2]}) "
              f"in {time.perf_counter() - t:.1f} s")
    return path


def _demo_settings():
    """Settings for a first run on a fresh machine, unless the user set them.

    A temporary Prefect server migrating a new database on a busy 2-core machine
    can take longer than Prefect's default 20 s to start; and there is no network
    here to send telemetry to.
    """
    from prefect.settings import (
        PREFECT_SERVER_ANALYTICS_ENABLED,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
        temporary_settings,
    )

    updates: dict[Any, Any] = {}
    if "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" not in os.environ:
        updates[PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS] = 180
    if "PREFECT_SERVER_ANALYTICS_ENABLED" not in os.environ:
        updates[PREFECT_SERVER_ANALYTICS_ENABLED] = False
    return temporary_settings(updates=updates)


def run(args: argparse.Namespace) -> int:
    from flows.pipeline import DEFAULT_STEPS, attribute_pipeline

    from .errors import format_bytes
    from .runner import MemoryAwareRunner, parse_bytes

    directory = Path(args.dir).absolute()
    survey = ensure_survey(directory, args.shape)
    limit = parse_bytes(args.memory_limit, what="--memory-limit")
    runner = MemoryAwareRunner(
        cluster_kwargs={"n_workers": args.workers, "threads_per_worker": 1, "processes": True,
                        "memory_limit": limit, "dashboard_address": "127.0.0.1:0"},
        store=args.store, output_dir=str(directory / "runs"))
    run_id: dict[str, Any] = {}

    def remember_id(flow, flow_run, state):
        run_id["id"] = str(flow_run.id)

    pipeline = attribute_pipeline.with_options(task_runner=runner,  # type: ignore[arg-type]  # a DaskTaskRunner
                                               on_completion=[remember_id],
                                               on_failure=[remember_id])
    t = time.perf_counter()
    with _demo_settings():
        summaries = pipeline(str(survey), DEFAULT_STEPS, None)
    wall = time.perf_counter() - t
    print()
    print(f"memchunk demo: {args.shape[0]} x {args.shape[1]} x {args.shape[2]} survey, {args.workers} workers x "
          f"{format_bytes(limit)} memory limit, {wall:.1f} s")
    for s in summaries:
        print(f"\n  {s['operator']} ({s['operator_key']})")
        for d, reason in zip(s["decisions"], s["reasons"]):
            print(f"    {d:<14} {reason}")
        peak = format_bytes(s["peak_bytes"]) if s["peak_bytes"] else "n/a"
        print(f"    {s['tasks']} tasks, peak {peak} of a {format_bytes(s['budget_bytes'])} budget per task, "
              f"{s['oom_events']} out-of-memory events recovered")
        print(f"    output: {s['output']}")
    gst = next((s for s in summaries if s["operator"] == "gst3d_dip"), None)
    if gst:
        # What the learned model now says the whole survey would need in one piece.
        from .model import ModelBank
        from .store import Store

        with Store(args.store) as store:
            whole = ModelBank(store).predict(gst["operator_key"], tuple(args.shape), ITEMSIZE)
        verdict = "over" if whole.mean_bytes > gst["budget_bytes"] else "within"
        print(f"\n  gst3d_dip in one piece: the model now predicts {format_bytes(whole.mean_bytes)} (upper bound "
              f"{format_bytes(whole.upper_bytes)}), {verdict} the {format_bytes(gst['budget_bytes'])} budget; it ran "
              f"in {gst['chunks']} chunks with {gst['oom_events']} out-of-memory events")
    api = os.environ.get("PREFECT_API_URL")
    rid = run_id.get("id", "")
    if api:
        print(f"\n  the run in the Prefect UI: {api.removesuffix('/api')}/runs/flow-run/{rid}")
    else:
        print("\n  the run in the Prefect UI: start the server with `prefect server start` (or `memchunk ui`), then "
              f"open http://127.0.0.1:4200/runs/flow-run/{rid}")
    print("  what was learned: `memchunk models`; run `memchunk demo` again to start warm")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memchunk demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--store", default=None, help="observation store (default: $MEMCHUNK_STORE or the Prefect home)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
