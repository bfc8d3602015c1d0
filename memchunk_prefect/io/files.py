"""Atomic, durable file writes: a reader sees the old file or the new one, never a partial one.

Every writer in the package that replaces a file readers may be looking at
(completion markers, zarr group metadata, flow manifests, SEG-Y exports) goes
through here: write a temporary file beside the target, ``fsync`` it, rename it
over the target (``os.replace`` is atomic on POSIX within one filesystem), then
``fsync`` the directory so the rename itself survives a power cut (without it
the directory entry may still point at the old file after a crash: see
``fsync(2)``, "calling fsync() does not necessarily ensure that the entry in the
directory containing the file has also reached disk").

What it does not cover: SQLite (``store.py``), which has its own journal.

>>> import json, tempfile, pathlib
>>> d = pathlib.Path(tempfile.mkdtemp())
>>> atomic_write_json(d / "m.json", {"a": 1})
>>> json.loads((d / "m.json").read_text()), sorted(p.name for p in d.iterdir())
({'a': 1}, ['m.json'])
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any, Iterator


def temporary_name(path: str | os.PathLike) -> Path:
    """A hidden, unique name beside ``path`` for its temporary file (same directory, so the rename is atomic)."""
    p = Path(path)
    return p.with_name(f".{p.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def fsync_directory(directory: str | os.PathLike) -> None:
    """Make renames in ``directory`` durable; a filesystem that cannot fsync a directory is skipped."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - e.g. some network filesystems
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path to write; on success it replaces ``path`` atomically and durably.

    On any exception (Ctrl-C included) the temporary file is removed and
    ``path`` is untouched. The writer must flush and close its file before the
    block ends (the contents are ``fsync``-ed here by reopening it).
    """
    target = Path(path)
    tmp = temporary_name(target)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(target.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as fh:
            fh.write(text)


def atomic_write_json(path: str | os.PathLike, doc: Any) -> None:
    """Replace ``path`` with ``doc`` as indented, key-sorted JSON, atomically and durably."""
    atomic_write_text(path, json.dumps(doc, indent=2, sort_keys=True))
