"""A SEG-Y file's geometry, scanned once per file identity and kept for later maps and runs.

Scanning a file's trace headers is linear in its traces (about 0.4 s per 128k traces here) and happened in
the flow process at every map and every run. :func:`cached_scan` keys the geometry by the file's identity
(absolute path, size, modification time in ns, header byte locations): kept in this process, and on disk under
``$MEMCHUNK_CACHE_DIR`` (default ``~/.cache/memchunk``) as one small ``.npz`` per file, so a nightly run over
the same survey scans nothing. A rewritten file has a new identity and is scanned again; a file changed in the last
:data:`SETTLE_SECONDS` is scanned and not kept (a file system's clock may not tell two quick rewrites of the
same size apart); an unreadable or unwritable cache is skipped (the scan is the fallback, never an error).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from memchunk_prefect.io.segy import CROSSLINE_BYTE, INLINE_BYTE, SegyGeometry, check_file, scan

logger = logging.getLogger("memchunk_prefect.io.segy_cache")

CACHE_ENV = "MEMCHUNK_CACHE_DIR"
#: Bump when the stored fields change: an old entry is then ignored.
CACHE_VERSION = 1
#: A file changed this recently (seconds) is scanned, not kept.
SETTLE_SECONDS = 2.0
_MEMORY: dict[tuple, SegyGeometry] = {}
_LOCK = threading.Lock()


def cache_dir() -> Path:
    """Where geometries are kept on disk: ``$MEMCHUNK_CACHE_DIR``, else ``~/.cache/memchunk``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "memchunk").expanduser()


def cached_scan(path: str | os.PathLike, iline: int = INLINE_BYTE, xline: int = CROSSLINE_BYTE,
                endian: str | None = None) -> SegyGeometry:
    """:func:`memchunk_prefect.io.segy.scan`, once per file identity (see the module docstring)."""
    p = os.path.abspath(os.fspath(path))
    check_file(p)  # a missing or damaged file says so, cached or not
    st = os.stat(p)
    if time.time() - st.st_mtime < SETTLE_SECONDS:
        return scan(p, iline, xline, endian)
    key = (p, st.st_size, st.st_mtime_ns, iline, xline, endian)
    with _LOCK:
        hit = _MEMORY.get(key)
    if hit is not None:
        return hit
    name = hashlib.sha256(repr((CACHE_VERSION, *key)).encode()).hexdigest()[:32] + ".npz"
    geom = _load(cache_dir() / name, p)
    if geom is None:
        geom = scan(p, iline, xline, endian)
        _save(cache_dir() / name, geom)
    with _LOCK:
        _MEMORY[key] = geom
    return geom


def _save(file: Path, g: SegyGeometry) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, Any] = {"ilines": g.ilines, "xlines": g.xlines, "samples_ms": g.samples_ms,
                  "meta": np.array([g.iline_byte, g.xline_byte, g.format_code, g.tracecount], dtype=np.int64),
                  "text": np.array([g.endian, g.sorting])}
        if g.trace_map is not None:
            arrays["trace_map"] = g.trace_map
        if g.cdp is not None:
            arrays["cdp_x"], arrays["cdp_y"] = g.cdp
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, file)
    except OSError as exc:  # a read-only home, a full disk: scan again next time
        logger.debug("could not keep the geometry of %s in %s: %r", g.path, file, exc)


def _load(file: Path, path: str) -> SegyGeometry | None:
    try:
        with np.load(file, allow_pickle=False) as z:
            il_byte, xl_byte, fmt, n = (int(v) for v in z["meta"])
            endian, sorting = (str(v) for v in z["text"])
            cdp = (z["cdp_x"], z["cdp_y"]) if "cdp_x" in z else None
            return SegyGeometry(path=path, iline_byte=il_byte, xline_byte=xl_byte, endian=endian, format_code=fmt,
                                ilines=z["ilines"], xlines=z["xlines"], samples_ms=z["samples_ms"], sorting=sorting,
                                tracecount=n, trace_map=z["trace_map"] if "trace_map" in z else None, cdp=cdp)
    except (OSError, KeyError, ValueError):
        return None
