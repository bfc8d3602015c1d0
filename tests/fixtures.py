"""Test helpers that build what tests read from the small JSON fixtures in ``tests/data``."""

from __future__ import annotations

import json
from pathlib import Path

from memchunk_prefect.core.records import MapRun, Observation, Reward
from memchunk_prefect.learn.store import Store

DATA = Path(__file__).resolve().parent / "data"


def store_from_json(name: str, path: str | Path) -> Path:
    """A store at ``path`` holding the rows of ``tests/data/<name>`` (observations, rewards, maps)."""
    doc = json.loads((DATA / name).read_text())
    with Store(path) as s:
        s.add_many(Observation.from_dict(o) for o in doc.get("observations", []))
        for r in doc.get("rewards", []):
            s.add_reward(Reward.from_dict(r))
        for m in doc.get("maps", []):
            s.add_map(MapRun.from_dict(m))
    return Path(path)
