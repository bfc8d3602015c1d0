"""memchunk-prefect: a Prefect 3 task runner that chooses chunk sizes from learned memory.

Public names are imported lazily so that ``import memchunk_prefect`` stays cheap
on Dask workers and in command-line tools.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "MemoryAwareRunner": "memchunk_prefect.run.runner",
    "chunked": "memchunk_prefect.run.chunked",
    "ChunkedResult": "memchunk_prefect.run.chunked",
    "open_segy": "memchunk_prefect.io.segy_xarray",
    "synthetic_survey": "memchunk_prefect.io.synthetic",
    "measure": "memchunk_prefect.run.monitor",
    "Measurement": "memchunk_prefect.run.monitor",
    "operator": "memchunk_prefect.operators",
    "Chunk": "memchunk_prefect.core.chunks",
    "Observation": "memchunk_prefect.core.records",
    "quiet": "memchunk_prefect.run.logs",
    # A recorded flow run simulated on another survey or cluster: will it finish by the deadline?
    "from_flow_run": "memchunk_prefect.sim.plan",
    "recommend_flow_run": "memchunk_prefect.sim.plan",
    "FlowPlan": "memchunk_prefect.sim.plan",
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        # Errors are re-exported too: memchunk_prefect.SegyError etc.
        errors = importlib.import_module("memchunk_prefect.core.errors")
        if hasattr(errors, name):
            return getattr(errors, name)
        raise AttributeError(f"module 'memchunk_prefect' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
