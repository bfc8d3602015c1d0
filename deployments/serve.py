"""Serve the deployments of prefect.yaml without a work pool: ``python -m deployments.serve``.

One long-running process registers the same deployments as ``prefect deploy
--all`` (names, descriptions, tags, parameters, schedules, read from
``prefect.yaml`` so the two never drift apart), then runs their flow runs
itself as they come due or are triggered from the UI. It needs a Prefect
server (``prefect server start``, or ``memchunk ui``) and ``PREFECT_API_URL``
pointing at it.

    python -m deployments.serve                  # every deployment in prefect.yaml
    python -m deployments.serve nightly-reprocess
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
PREFECT_YAML = REPO / "prefect.yaml"


def load_config(path: str | Path = PREFECT_YAML) -> dict[str, Any]:
    import yaml

    with open(path) as fh:
        return yaml.safe_load(fh)


def load_flow(entrypoint: str, root: Path = REPO):
    """``flows/seismic.py:reprocess_survey`` -> the flow object (the file imported as a module, as Prefect does)."""
    from prefect.flows import load_flow_from_entrypoint

    file, _, name = entrypoint.rpartition(":")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return load_flow_from_entrypoint(f"{root / file}:{name}")


def schedules_of(entry: dict[str, Any]) -> list:
    from prefect.client.schemas.schedules import CronSchedule

    out = []
    for s in entry.get("schedules") or []:
        if "cron" not in s:
            raise ValueError(f"deployment {entry['name']!r}: only cron schedules are served here, got {s!r}")
        out.append(CronSchedule(cron=s["cron"], timezone=s.get("timezone")))
    return out


def build_deployments(names: Sequence[str] = (), path: str | Path = PREFECT_YAML) -> list:
    """``RunnerDeployment`` objects for the deployments of ``prefect.yaml`` (all, or those named)."""
    config = load_config(path)
    entries = [d for d in config.get("deployments", []) if not names or d["name"] in names]
    missing = set(names) - {d["name"] for d in entries}
    if missing:
        raise SystemExit(f"no deployment named {', '.join(sorted(missing))} in {path}")
    out = []
    for d in entries:
        flow = load_flow(d["entrypoint"])
        active = all(s.get("active", True) for s in d.get("schedules") or [])
        out.append(flow.to_deployment(
            name=d["name"], description=d.get("description"), tags=d.get("tags") or [],
            parameters=d.get("parameters") or {}, schedules=schedules_of(d) or None, paused=not active,
            concurrency_limit=d.get("concurrency_limit"),
        ))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="deployment names (default: every one in prefect.yaml)")
    p.add_argument("--limit", type=int, default=None, help="most flow runs at once (default: no limit)")
    args = p.parse_args(argv)
    from prefect import serve

    serve(*build_deployments(args.names), limit=args.limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
