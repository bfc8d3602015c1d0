"""Where chunked maps write when the flow names no output, and what is there: list it, and remove what a user names.

The default output directory is ``./memchunk-outputs`` in the flow's working directory (for a Prefect
deployment, the project's directory), unless ``MEMCHUNK_OUTPUT_DIR`` or the runner's ``output_dir=`` names
another. Each flow run gets a folder there (its run id) holding one store per chunked map (zarr, or MDIO where
asked) and a small
``memchunk-run.json`` saying which flow run wrote it and when. Nothing is ever removed by the runner itself:
:func:`list_runs` and :func:`remove_runs` (``memchunk outputs``) leave keep-or-clean to the user, and never
remove a folder whose outputs may still be being written.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from memchunk_prefect.core.errors import (
    OutputPathError,
)

#: The default output directory's name, in the flow's working directory.
DEFAULT_DIRNAME = "memchunk-outputs"
#: The file in each flow run's folder that says which run wrote it.
RUN_MANIFEST = "memchunk-run.json"
#: An unfinished output changed this recently may still be being written: never removed.
BUSY_SECONDS = 3600.0


def default_output_dir(output_dir: str | os.PathLike | None = None) -> Path:
    """Where chunked outputs go when ``chunked(..., output=)`` is not given (absolute).

    ``output_dir`` (the runner's), else ``$MEMCHUNK_OUTPUT_DIR``, else ``memchunk-outputs`` in the current
    working directory: where a user who ran the flow looks, and where a deployment's project lives. (A
    temporary directory is the first thing a cluster's cleanup or a reboot wipes.)
    """
    return Path(output_dir or os.environ.get("MEMCHUNK_OUTPUT_DIR") or Path.cwd() / DEFAULT_DIRNAME).absolute()


def _private_dir(d: Path) -> None:
    """Create ``d`` (and parents) user-only, and refuse one that is not a directory owned by this user.

    The output directory may lie in a shared place (a project directory, a scratch file system), where
    another user could have created (or linked) it first.
    """
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OutputPathError(f"{d}: not a directory owned by you; set the runner's output_dir= or "
                              "MEMCHUNK_OUTPUT_DIR to a directory of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001  # pragma: no cover - no user name in the environment
        return str(os.getuid())


#: The suffixes of the stores chunked maps write: zarr stores and MDIO datasets.
STORE_SUFFIXES = (".zarr", ".mdio")


def output_path_for(base: Path, run_id: str, n: int, operator: str, run: dict | None = None,
                    suffix: str = ".zarr") -> str:
    """``base/<run_id>/<n>-<operator><suffix>`` (``.zarr`` or ``.mdio``), the directories made user-only;
    :class:`OutputPathError` where the operator's name would lead outside ``base``.

    A task name is free text: it is kept to one safe path component, and the result is checked to stay inside.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", operator).lstrip(".") or "operator"
    _private_dir(base)
    _private_dir(base / run_id)
    manifest = base / run_id / RUN_MANIFEST
    if run is not None and not manifest.exists():
        from memchunk_prefect.io.files import atomic_write_text

        atomic_write_text(manifest, json.dumps({**run, "created": time.time()}, indent=1))
    path = base / run_id / f"{n:02d}-{safe}{suffix}"
    if not path.resolve().is_relative_to(base.resolve()):
        raise OutputPathError(f"{path}: the output for {operator!r} would leave the output directory {base}")
    return str(path)


@dataclass(frozen=True)
class RunOutputs:
    """One flow run's folder in the output directory.

    ``size_bytes``: everything under it; ``modified``: its newest file's time (seconds since the epoch);
    ``outputs``: its stores (zarr and MDIO); ``unfinished``: those not finalized (a run stopped early, or still
    running);
    ``flow`` / ``flow_run``: the flow's and the run's names where its ``memchunk-run.json`` says them.
    """

    path: Path
    size_bytes: int
    modified: float
    outputs: tuple[str, ...]
    unfinished: tuple[str, ...]
    flow: str = ""
    flow_run: str = ""

    @property
    def name(self) -> str:
        return self.path.name

    def busy(self, now: float, busy_seconds: float = BUSY_SECONDS) -> bool:
        """An unfinished output changed within ``busy_seconds``: it may still be being written."""
        return bool(self.unfinished) and now - self.modified < busy_seconds


def list_runs(base: str | os.PathLike) -> list[RunOutputs]:
    """The flow runs' folders in the output directory ``base``, oldest first (none where it does not exist)."""
    base = Path(base)
    if not base.is_dir():
        return []
    runs = []
    for d in sorted(p for p in base.iterdir() if p.is_dir() and not p.is_symlink()):
        files = [f for f in d.rglob("*") if f.is_file() and not f.is_symlink()]
        stores = sorted(s for s in d.iterdir() if s.is_dir() and s.suffix in STORE_SUFFIXES)
        unfinished = tuple(s.name for s in stores if not _finished(s))
        meta = _manifest(d)
        runs.append(RunOutputs(path=d, size_bytes=sum(f.stat().st_size for f in files),
                               modified=max([f.stat().st_mtime for f in files], default=d.stat().st_mtime),
                               outputs=tuple(s.name for s in stores), unfinished=unfinished,
                               flow=str(meta.get("flow", "")), flow_run=str(meta.get("flow_run", ""))))
    return sorted(runs, key=lambda r: r.modified)


def remove_runs(base: str | os.PathLike, names: list[str] | tuple[str, ...] = (), *,
                older_than_seconds: float | None = None, now: float | None = None,
                dry_run: bool = False) -> tuple[list[RunOutputs], list[tuple[RunOutputs, str]]]:
    """Remove the flow runs' folders named (their folder names, or the flow runs' names) and those unchanged for
    ``older_than_seconds``; (removed, [(kept, why)]). A folder whose outputs may still be being written
    (:meth:`RunOutputs.busy`) is kept, whoever asks. Only folders inside ``base`` are touched. Names that match
    nothing raise :class:`OutputPathError` naming them, before anything is removed."""
    now = time.time() if now is None else now
    runs = list_runs(base)
    wanted = set(names)
    unknown = wanted - {r.name for r in runs} - {r.flow_run for r in runs}
    if unknown:
        raise OutputPathError(f"no flow run's outputs named {', '.join(sorted(unknown))} in {Path(base).absolute()}; "
                              "`memchunk outputs` lists them")
    chosen = [r for r in runs if r.name in wanted or (r.flow_run and r.flow_run in wanted)
              or (older_than_seconds is not None and now - r.modified > older_than_seconds)]
    removed, kept = [], []
    for r in chosen:
        if r.busy(now):
            kept.append((r, f"{', '.join(r.unfinished)} unfinished and changed {now - r.modified:.0f} s ago: may "
                            "still be being written"))
            continue
        if not r.path.resolve().is_relative_to(Path(base).resolve()):
            kept.append((r, "outside the output directory"))
            continue
        if not dry_run:
            shutil.rmtree(r.path)
        removed.append(r)
    return removed, kept


def _finished(store: Path) -> bool:
    try:
        meta = json.loads((store / "zarr.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(meta.get("attributes", {}).get("complete"))


def _manifest(d: Path) -> dict:
    try:
        return json.loads((d / RUN_MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
