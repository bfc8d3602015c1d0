"""A chain of seismic attribute operators over one SEG-Y file, chunked by the runner.

``attribute_pipeline(segy_path, steps)`` runs each step on the previous step's
output (the first on the seismic itself), so a light operator (envelope) can
feed a heavy one (gst3d_dip) and the runner decides at each boundary whether
to keep the chunking or re-cut it. Steps are plain data, so the flow can be
deployed with parameters::

    [{"name": "envelope"}, {"name": "gaussian_smooth", "sigma": [2, 2, 2]}, {"name": "gst3d_dip"}]
"""

from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger

from memchunk_prefect.operators.registry import DEFAULT_STEPS, resolve_step
from memchunk_prefect.run.chunked import chunked
from memchunk_prefect.run.runner import MemoryAwareRunner


# Prefect types a flow's task runner as TaskRunner[PrefectFuture]; prefect-dask's is TaskRunner[PrefectDaskFuture].
@flow(name="attribute-pipeline", task_runner=MemoryAwareRunner(), log_prints=True)  # type: ignore[arg-type]
def attribute_pipeline(segy_path: str, steps: list[dict[str, Any]] | None = None,
                       output_dir: str | None = None, output_format: str = "zarr") -> list[dict[str, Any]]:
    """Run ``steps`` in a chain over ``segy_path`` (a SEG-Y file, or an MDIO or zarr store); return each step's
    summary (decisions, events, output).

    Outputs are stores named after their step under ``output_dir`` (default: the
    runner's output directory): zarr stores, or MDIO v1 datasets with
    ``output_format="mdio"``.
    """
    log = get_run_logger()
    steps = steps or DEFAULT_STEPS
    resolved = [resolve_step(s) for s in steps]  # check every step before running any
    current: Any = segy_path
    maps = []
    # Every step is submitted before any is waited for: each step's chunks start as soon as the chunks of the
    # step before that they read are written (a chunked .map returns at once).
    for n, (op, params) in enumerate(resolved, start=1):
        suffix = ".mdio" if output_format == "mdio" else ".zarr"
        out = os.path.join(output_dir, f"{n:02d}-{op.name}{suffix}") if output_dir else None
        current = op.map(chunked(current, output=out, output_format=output_format), **params)
        maps.append((op, current))
    summaries = []
    for op, result in maps:
        summary = result.summary()  # waits for the step; raises what stopped it
        summaries.append(summary)
        log.info("%s: %s; %d tasks, %d out-of-memory events recovered; output %s", op.name,
                 ", ".join(summary["decisions"]), summary["tasks"], summary["oom_events"], summary["output"])
    return summaries
