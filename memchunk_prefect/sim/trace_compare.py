"""Two WfFormat traces of the same work side by side: a real run and its simulation (``memchunk compare-traces``).

What: per task category (the operator), each trace's tasks, failed attempts, summed and mean runtime
(seconds), span (seconds), energy (joules) and its sources, and the second's relative difference from the
first. Why: a simulation (``memchunk simulate --trace``) is only worth trusting as far as it matches the
runs it models, operator by operator. The traces are read as documents; :mod:`memchunk_prefect.sim.trace`
writes (and validates) them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Mapping

from memchunk_prefect.core.energy import JOULES_PER_KWH


def _when(value: Any) -> float | None:
    """Epoch seconds of an RFC 3339 / ISO 8601 time (``executedAt``); None when it is missing or unreadable."""
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except (TypeError, ValueError):
        return None


def per_category(doc: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per task category (the operator) of a WfFormat instance: tasks, failed attempts, summed and mean
    runtime (seconds), span (first start to last end, seconds), energy (joules) and its sources."""
    spec = {t["id"]: t for t in doc["workflow"]["specification"]["tasks"]}
    out: dict[str, dict[str, Any]] = {}
    for t in doc["workflow"].get("execution", {}).get("tasks", []):
        s = spec.get(t["id"], {})
        cat = str(t.get("category") or s.get("category") or s.get("name") or "?")
        c = out.setdefault(cat, {"tasks": 0, "failed": 0, "runtime_seconds": 0.0, "energy_joules": 0.0,
                                 "energy_sources": set(), "first": None, "last": None})
        runtime = float(t.get("runtimeInSeconds", 0.0))
        c["tasks"] += 1
        c["failed"] += t.get("outcome", "ok") != "ok"
        c["runtime_seconds"] += runtime
        c["energy_joules"] += float(t.get("energyInKWh", 0.0)) * JOULES_PER_KWH
        if t.get("energySource"):
            c["energy_sources"].add(str(t["energySource"]))
        start = _when(t.get("executedAt"))
        if start is not None:
            c["first"] = start if c["first"] is None else min(c["first"], start)
            c["last"] = start + runtime if c["last"] is None else max(c["last"], start + runtime)
    for c in out.values():
        c["mean_runtime_seconds"] = c["runtime_seconds"] / c["tasks"] if c["tasks"] else 0.0
        c["span_seconds"] = None if c["first"] is None else c["last"] - c["first"]
        c["energy_sources"] = sorted(c.pop("energy_sources"))
        del c["first"], c["last"]
    return out


def compare(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """Two traces of the same work side by side (e.g. a real run and its simulation), per operator and
    whole: each figure of :func:`per_category` for both, and ``b``'s relative difference from ``a``
    (``(b - a) / a``; None where ``a`` is 0 or unknown). Makespan is each instance's ``makespanInSeconds``."""
    ca, cb = per_category(a), per_category(b)

    def rel(x: Any, y: Any) -> float | None:
        return None if x in (None, 0) or y is None else (float(y) - float(x)) / float(x)

    rows = []
    for cat in sorted(set(ca) | set(cb)):
        x, y = ca.get(cat, {}), cb.get(cat, {})
        row: dict[str, Any] = {"category": cat}
        for f in ("tasks", "failed", "runtime_seconds", "mean_runtime_seconds", "span_seconds", "energy_joules"):
            row[f] = (x.get(f), y.get(f), rel(x.get(f), y.get(f)))
        row["energy_sources"] = (x.get("energy_sources", []), y.get("energy_sources", []))
        rows.append(row)
    ma = a["workflow"].get("execution", {}).get("makespanInSeconds")
    mb = b["workflow"].get("execution", {}).get("makespanInSeconds")
    return {"a": a.get("name"), "b": b.get("name"), "makespan_seconds": (ma, mb, rel(ma, mb)), "operators": rows}
