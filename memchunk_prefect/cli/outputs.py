"""``memchunk outputs``: the flow runs' outputs in the output directory, with sizes; remove what a user names.

Keep-or-clean is the user's decision: nothing is removed unless named (``--remove RUN...``) or older than an
age (``--older-than 7d``), and a run whose unfinished outputs changed in the last hour is never removed (it may
still be being written: :func:`memchunk_prefect.run.outputs.remove_runs`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

from memchunk_prefect.cli.format import table
from memchunk_prefect.cli.registry import EXIT_FAILURE, EXIT_OK, emit
from memchunk_prefect.core.errors import format_bytes
from memchunk_prefect.core.units import parse_seconds
from memchunk_prefect.run.outputs import default_output_dir, list_runs, remove_runs


def _age(seconds: float) -> str:
    """``3 d``, ``5 h``, ``12 min``, ``40 s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def run(args: argparse.Namespace) -> int:
    base = default_output_dir(args.dir)
    now = time.time()
    if args.remove or args.older_than:
        older = None if args.older_than is None else parse_seconds(args.older_than)
        removed, kept = remove_runs(base, list(args.remove), older_than_seconds=older, now=now, dry_run=args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        for r in removed:
            emit(f"{verb} {r.path} ({format_bytes(r.size_bytes)})")
        for r, why in kept:
            emit(f"kept {r.path}: {why}")
        emit(f"{verb} {len(removed)} run(s), {format_bytes(sum(r.size_bytes for r in removed))}")
        return EXIT_FAILURE if kept and args.remove else EXIT_OK
    runs = list_runs(base)
    if args.json:
        emit(json.dumps({"dir": str(base), "runs": [{
            "name": r.name, "path": str(r.path), "size_bytes": r.size_bytes, "modified": r.modified,
            "flow": r.flow, "flow_run": r.flow_run, "outputs": list(r.outputs), "unfinished": list(r.unfinished)}
            for r in runs]}, indent=1))
        return EXIT_OK
    if not runs:
        emit(f"no flow runs' outputs in {base}")
        return EXIT_OK
    body = [[r.name, r.flow_run or "-", r.flow or "-", format_bytes(r.size_bytes), _age(now - r.modified),
             f"{len(r.outputs)}" + (f" ({len(r.unfinished)} unfinished)" if r.unfinished else ""),
             datetime.datetime.fromtimestamp(r.modified).strftime("%Y-%m-%d %H:%M")] for r in runs]
    emit(f"{base}: {len(runs)} flow run(s), {format_bytes(sum(r.size_bytes for r in runs))}")
    emit(table(["run", "flow run", "flow", "size", "age", "outputs", "changed"], body))
    return EXIT_OK
