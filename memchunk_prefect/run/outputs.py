"""Where chunked maps write when the flow names no output: the default output directory and each map's path in it.
"""

from __future__ import annotations

import getpass
import os
import re
import stat
import tempfile
from pathlib import Path

from memchunk_prefect.core.errors import (
    OutputPathError,
)


def default_output_dir(output_dir: str | os.PathLike | None = None) -> Path:
    """Where chunked outputs go when ``chunked(..., output=)`` is not given (absolute).

    ``output_dir`` (the runner's), else ``$MEMCHUNK_OUTPUT_DIR``, else a per-user
    directory under the temporary directory.
    """
    return Path(output_dir or os.environ.get("MEMCHUNK_OUTPUT_DIR")
                or Path(tempfile.gettempdir()) / f"memchunk-{_user()}").absolute()


def _private_dir(d: Path) -> None:
    """Create ``d`` (and parents) user-only, and refuse one that is not a directory owned by this user.

    The default output directory lies under the shared temporary directory, where
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


def output_path_for(base: Path, run_id: str, n: int, operator: str) -> str:
    """``base/<run_id>/<n>-<operator>.zarr``, the directories made user-only; :class:`OutputPathError` where the
    operator's name would lead outside ``base``.

    A task name is free text: it is kept to one safe path component, and the result is checked to stay inside.
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", operator).lstrip(".") or "operator"
    _private_dir(base)
    _private_dir(base / run_id)
    path = base / run_id / f"{n:02d}-{safe}.zarr"
    if not path.resolve().is_relative_to(base.resolve()):
        raise OutputPathError(f"{path}: the output for {operator!r} would leave the output directory {base}")
    return str(path)
