"""What the store keeps of one chunked map for traces and simulations (:class:`~memchunk_prefect.core.records.MapRun`):
its operator, volume, halo, budget, the cluster it planned for and how it ended."""

from __future__ import annotations

import os
import time
from typing import Any

from memchunk_prefect.core.budget import Budget
from memchunk_prefect.core.records import MapRun
from memchunk_prefect.core.settings import ITEMSIZE
from memchunk_prefect.io.identity import params_record


def map_record(cmap: Any, outcome: str) -> MapRun:
    """The record of ``cmap`` (a :class:`~memchunk_prefect.run.executor.ChunkedMap` that started), ending now
    with ``outcome`` (``ok``, ``failed`` or ``interrupted``)."""
    path = getattr(cmap.source, "path", "") or ""
    return MapRun(flow_run_id=cmap.flow_run_id, operator=cmap.name, operator_key=cmap.key, source=str(path),
                  source_bytes=size_on_disk(path) if path else None, output_path=cmap.output_path,
                  shape=cmap.shape, halo=cmap.halo, itemsize=ITEMSIZE, slots=cmap.slots,
                  budget_bytes=int(cmap.budget), started_at=float(cmap.started_at or 0.0), ended_at=time.time(),
                  outcome=outcome, map_id=cmap.map_id, params=params_record(cmap.static),
                  whole_traces=cmap.spec.whole_traces, **cluster_shape(cmap.budget_read, cmap.slots))


def cluster_shape(budget: Budget | None, slots: int) -> dict[str, Any]:
    """What a map's record keeps of the cluster its budget was read from (``MapRun``'s cluster fields): the
    workers planned for (its slots over the threads per worker), their threads, memory limit and kill fraction
    (of the worker that set the budget), their median resting memory, bytes, and the threads per CPU core the
    budget counted from the cores the workers may run on (None where those were not read: a simulation then
    counts the machines' cores)."""
    if budget is None:
        return {}
    threads = max(1, int(budget.threads_per_worker or 1))
    resting = sorted(budget.resting_bytes.values())
    return {"workers": max(1, int(slots) // threads), "threads_per_worker": threads,
            "memory_limit_bytes": budget.memory_limit_bytes, "kill_fraction": budget.kill_fraction,
            "resting_bytes": int(resting[len(resting) // 2]) if resting else None,
            "threads_per_core": float(budget.threads_per_core) if budget.cores_read else None}


def size_on_disk(path: str) -> int | None:
    """Bytes of a file, or of every file under a directory (a zarr store); None if it cannot be read."""
    try:
        if os.path.isdir(path):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
        return os.path.getsize(path)
    except OSError:
        return None
