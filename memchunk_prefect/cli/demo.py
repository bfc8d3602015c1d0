"""The demo: a synthetic survey through envelope -> gaussian_smooth -> gst3d_dip, chunked by the runner.

``memchunk demo`` (or ``python -m memchunk_prefect.cli.demo``) generates a synthetic
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
from typing import Any, Mapping, Sequence

from memchunk_prefect.core.settings import ITEMSIZE

#: 128 x 128 x 400 float32 = 25 MiB; gst3d_dip needs ~1.05 GiB above resting memory for it in one piece.
DEFAULT_SHAPE = (128, 128, 400)
DEFAULT_WORKERS = 2
#: Below what gst3d_dip needs in one piece: the budget per task is the kill line (0.95 x 1 GiB) less the
#: worker's resting memory, ~0.7 GiB. At 1.5 GiB the budget is ~1.2 GiB, the whole survey fits in one piece and
#: the demo would not show chunking by necessity.
DEFAULT_MEMORY_LIMIT = "1GiB"
#: On the GPU the host limit is not what the demo shows (the GPU's memory is the budget there), and a GPU worker's
#: process keeps CUDA's host libraries once its first chunk has used them: on an NVIDIA H100 with an empty CuPy
#: kernel cache, envelope's first chunk left 283 MiB held, gaussian_smooth's 121 MiB, and a 1 GiB worker then sat
#: over Dask's pause line (0.8 of its limit) for good: the rest of the map never started.
DEFAULT_GPU_MEMORY_LIMIT = "4GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="memchunk-demo", help="where the survey and outputs go (default: ./memchunk-demo)")
    p.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "T"), default=list(DEFAULT_SHAPE),
                   help=f"survey shape (default: {' '.join(map(str, DEFAULT_SHAPE))})")
    p.add_argument("--workers", type=int, default=DEFAULT_WORKERS, help="worker processes (one thread each)")
    p.add_argument("--memory-limit", default=None,
                   help=f"memory limit per worker, enforced by Dask's nanny (default {DEFAULT_MEMORY_LIMIT}; "
                        f"{DEFAULT_GPU_MEMORY_LIMIT} for a worker on a GPU, which keeps CUDA's host libraries)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="show Dask's INFO log and Prefect's line per task run (quiet by default)")


def ensure_survey(directory: Path, shape: Sequence[int]) -> Path:
    """The demo survey for ``shape``, generated once (its name carries the shape)."""
    from memchunk_prefect.io.synthetic import synthetic_survey

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"survey-{shape[0]}x{shape[1]}x{shape[2]}.sgy"
    if not path.exists():
        t = time.perf_counter()
        synthetic_survey(path, tuple(shape), seed=0)
        print(f"generated synthetic survey {path} ({shape[0]} x {shape[1]} x {shape[2]}) "
              f"in {time.perf_counter() - t:.1f} s")
    return path


def _no_telemetry() -> None:
    """No telemetry from the demo's temporary Prefect server unless the user asked for it: there may be no
    network to send it to, and its notice is noise in the demo's output. Set in the environment, which the
    server process inherits. (The server's startup timeout is raised by the runner itself:
    :func:`memchunk_prefect.run.prefect_api.temporary_server_defaults`.)"""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def summary_lines(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """One row per operator: its decisions, tasks, peak against budget, the model's upper bound over the measured
    peak at the chunks it planned (``-`` where every chunk was a probe), out-of-memory events recovered, energy.

    >>> print("\\n".join(summary_lines([{"operator": "envelope", "decisions": ["probe", "rechunk"], "tasks": 7,
    ...     "peak_bytes": 68_000_000, "budget_bytes": 781_000_000, "oom_events": 0, "bound_over_peak": 1.084,
    ...     "energy": {"estimate": 3.25}}])))
      operator  decisions       tasks  peak / budget per task  bound / peak  out of memory  energy
      envelope  probe, rechunk  7      64.8 MiB / 744.8 MiB    1.08x         0 recovered    3.2 J (estimated)
    """
    from memchunk_prefect.cli.format import table
    from memchunk_prefect.core.energy import energy_text
    from memchunk_prefect.core.errors import format_bytes

    header = ["operator", "decisions", "tasks", "peak / budget per task", "bound / peak", "out of memory", "energy"]
    rows = [[s["operator"], ", ".join(s["decisions"]), str(s["tasks"]),
             f"{format_bytes(s['peak_bytes']) if s['peak_bytes'] else 'n/a'} / {format_bytes(s['budget_bytes'])}",
             "-" if s.get("bound_over_peak") is None else f"{s['bound_over_peak']:.2f}x",
             f"{s['oom_events']} recovered", energy_text(s.get("energy", {}))]
            for s in summaries]
    return table(header, rows, indent="  ").splitlines()


def one_piece_lines(gst: Mapping[str, Any], whole: Any, on_gpu: Any = None) -> list[str]:
    """What the learned model says gst3d_dip would need for the whole survey in one piece (``whole``, host memory;
    ``on_gpu``, the GPU model's, where the map ran on the GPU), against the budgets its map had.

    >>> from types import SimpleNamespace as P
    >>> gst = {"budget_bytes": 3 << 30, "chunks": 5, "oom_events": 0, "gpu_budget_bytes": 70 << 30,
    ...        "gpu_peak_bytes": 9 << 30}
    >>> lines = one_piece_lines(gst, P(mean_bytes=57 << 20, upper_bytes=142 << 20),
    ...                         P(mean_bytes=10 << 30, upper_bytes=11 << 30))
    >>> "predicts 57.0 MiB (upper bound 142.0 MiB), within the 3.0 GiB budget; it ran in 5 chunks" in lines[0]
    True
    >>> print(lines[1])
      on the GPU: 10.0 GiB (upper bound 11.0 GiB), within the 70.0 GiB GPU budget; its chunks peaked at 9.0 GiB there
    """
    from memchunk_prefect.core.errors import format_bytes

    def verdict(pred: Any, budget: int) -> str:
        return "over" if pred.mean_bytes > budget else "within"

    lines = [f"  gst3d_dip in one piece: the model now predicts {format_bytes(whole.mean_bytes)} (upper bound "
             f"{format_bytes(whole.upper_bytes)}), {verdict(whole, gst['budget_bytes'])} the "
             f"{format_bytes(gst['budget_bytes'])} budget; it ran in {gst['chunks']} chunks with {gst['oom_events']} "
             "out-of-memory events"]
    if on_gpu is not None and gst.get("gpu_budget_bytes"):
        peak = gst.get("gpu_peak_bytes")
        lines.append(f"  on the GPU: {format_bytes(on_gpu.mean_bytes)} "
                     f"(upper bound {format_bytes(on_gpu.upper_bytes)}), "
                     f"{verdict(on_gpu, gst['gpu_budget_bytes'])} the {format_bytes(gst['gpu_budget_bytes'])} GPU "
                     "budget" + (f"; its chunks peaked at {format_bytes(peak)} there" if peak else ""))
    return lines


def demo_layout(workers: int, limit: int | None, env: Mapping[str, str] | None = None) -> tuple[dict, str, str]:
    """``(cluster_kwargs, device, words)``: the demo's cluster and device, and what they are in words.

    On the GPU where this machine has one and CuPy is installed (or the fake device is set): one single-thread
    worker per GPU, each pinned to its own (:mod:`memchunk_prefect.run.pinning`), operators on ``device="auto"``
    (the GPU where every worker has a usable one, else the CPU). Otherwise ``workers`` CPU workers.
    ``limit`` (bytes per worker) None: :data:`DEFAULT_MEMORY_LIMIT`, or :data:`DEFAULT_GPU_MEMORY_LIMIT` on the GPU.
    """
    from memchunk_prefect.core.units import parse_bytes
    from memchunk_prefect.run.pinning import PRELOAD, usable_gpus

    devices, found = usable_gpus(env)
    if limit is None:
        limit = parse_bytes(DEFAULT_GPU_MEMORY_LIMIT if devices else DEFAULT_MEMORY_LIMIT)
    common = {"threads_per_worker": 1, "processes": True, "memory_limit": limit, "dashboard_address": "127.0.0.1:0"}
    if devices:
        return ({**common, "n_workers": len(devices), "preload": [PRELOAD]}, "auto",
                f"on the GPU: {found}, one single-thread worker each; operators run there where every worker can "
                "use its GPU, else on the CPU (the models' keys say which)")
    return {**common, "n_workers": workers}, "cpu", f"on the CPU ({found}): {workers} worker(s)"


def run(args: argparse.Namespace) -> int:
    from memchunk_prefect.core.errors import format_bytes
    from memchunk_prefect.run.doctor import preflight
    from memchunk_prefect.run.logs import quiet

    if not getattr(args, "verbose", False):
        quiet()
    _no_telemetry()
    directory = Path(args.dir).absolute()
    # What the run cannot do without (Prefect home and database or API, store, output directory): checked in
    # seconds, before a survey is generated or a cluster started.
    preflight(store=args.store, output_dir=directory / "runs")

    from memchunk_prefect.core.units import parse_bytes
    from memchunk_prefect.operators.registry import DEFAULT_STEPS
    from memchunk_prefect.pipeline import attribute_pipeline
    from memchunk_prefect.run.runner import MemoryAwareRunner

    asked = None if args.memory_limit is None else parse_bytes(args.memory_limit, what="--memory-limit")
    survey = ensure_survey(directory, args.shape)
    cluster_kwargs, device, device_words = demo_layout(args.workers, asked)
    limit, workers = cluster_kwargs["memory_limit"], cluster_kwargs["n_workers"]
    print(f"memchunk demo: {device_words}")
    runner = MemoryAwareRunner(cluster_kwargs=cluster_kwargs, store=args.store, output_dir=str(directory / "runs"),
                               device=device)
    pipeline = attribute_pipeline.with_options(task_runner=runner)  # type: ignore[arg-type]  # a DaskTaskRunner
    t = time.perf_counter()
    state = pipeline(str(survey), DEFAULT_STEPS, None, return_state=True)
    wall = time.perf_counter() - t
    summaries = state.result()  # raises the flow's error when it failed
    run_id = str(state.state_details.flow_run_id or "")
    print()
    print(f"memchunk demo: {args.shape[0]} x {args.shape[1]} x {args.shape[2]} survey, {workers} workers x "
          f"{format_bytes(limit)} memory limit, {wall:.1f} s (why each decision: the log lines above)")
    print()
    for line in summary_lines(summaries):
        print(line)
    gst = next((s for s in summaries if s["operator"] == "gst3d_dip"), None)
    if gst:
        # What the learned model now says the whole survey would need in one piece.
        from memchunk_prefect.learn.bank import ModelBank
        from memchunk_prefect.learn.store import Store

        with Store(args.store) as store:
            bank = ModelBank(store)
            whole = bank.predict(gst["operator_key"], tuple(args.shape), ITEMSIZE)
            on_gpu = (bank.predict_gpu(gst["operator_key"], tuple(args.shape), ITEMSIZE)
                      if gst.get("gpu_budget_bytes") else None)
        print()
        for line in one_piece_lines(gst, whole, on_gpu):
            print(line)
    if summaries:
        print(f"  outputs: {Path(summaries[-1]['output']).parent}/")
    api = os.environ.get("PREFECT_API_URL")
    if api:
        print(f"  the run in the Prefect UI: {api.removesuffix('/api')}/runs/flow-run/{run_id}")
    else:
        print("  the run in the Prefect UI: `memchunk ui`, then open "
              f"http://127.0.0.1:4200/runs/flow-run/{run_id}")
    print("  what was learned: `memchunk models`; run `memchunk demo` again to start warm")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="memchunk demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--store", default=None, help="observation store (default: $MEMCHUNK_STORE or the Prefect home)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
