"""Simulated runs of the same decision core: what-if, recommend, allocations, and WfCommons traces.

Never imports :mod:`memchunk_prefect.run`: a simulation needs no Prefect server or Dask cluster.

A recorded flow run on another survey or cluster, from Python (imported on first use, see
:mod:`memchunk_prefect.sim.plan`): :func:`from_flow_run` (a :class:`FlowPlan`: makespan, kills, chunks per step,
whether it meets a deadline) and :func:`recommend_flow_run` (the cluster to ask for); :func:`track_record`: the
store's past flow runs predicted again beside the makespans they had (:mod:`memchunk_prefect.sim.track`).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "from_flow_run": "memchunk_prefect.sim.plan",
    "recommend_flow_run": "memchunk_prefect.sim.plan",
    "FlowPlan": "memchunk_prefect.sim.plan",
    "deadline_seconds": "memchunk_prefect.sim.plan",
    "recorded_flow": "memchunk_prefect.sim.recorded",
    "step_for": "memchunk_prefect.sim.recorded",
    "track_record": "memchunk_prefect.sim.track",
    "TrackRecord": "memchunk_prefect.sim.track",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'memchunk_prefect.sim' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
