"""SEG-Y at the byte level: scan a file's headers into a geometry, read boxes of traces.

What this module covers:

- :func:`scan` opens a SEG-Y file, reads **headers only** (the binary header and a
  few trace-header fields of every trace) and returns a small :class:`SegyGeometry`:
  the inline/crossline numbers, the sample times, how traces are sorted, and
  nothing per-trace unless the file is unsorted. Every way a file can fail to be a
  post-stack 3D volume ends in a typed :class:`~memchunk_prefect.core.errors.SegyError`
  whose message names the file, what was expected, what was found, and what to do.
- :func:`read_box` reads the traces of an (inline, crossline) box, in contiguous
  trace runs, and returns ``float32`` (iline, xline, twt) samples whatever the
  file's sample format. NaN and Inf samples are returned as they are stored.

What it does not cover: the xarray view and the chunk sources
(:mod:`memchunk_prefect.io.volume`, which builds on this module), synthetic surveys
(:mod:`memchunk_prefect.io.synthetic`) and SEG-Y export (:mod:`memchunk_prefect.io.export`).

Conventions: sample times (``twt``) are in milliseconds as segyio reports them
(``f.samples``: delay recording time plus k × interval); sample intervals are in
ms; trace indices count from 0 in file order.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memchunk_prefect.core.errors import (
    NotSegyError,
    SegyEmptyError,
    SegyError,
    SegyFileNotFoundError,
    SegyGeometryError,
    SegyNotA3DVolumeError,
    SegyPrestackError,
    SegyTruncatedError,
)

#: Byte locations (1-based, as in the SEG-Y standard and segyio) of the trace-header fields used here.
INLINE_BYTE = 189
CROSSLINE_BYTE = 193
OFFSET_BYTE = 37
CDP_X_BYTE = 181
CDP_Y_BYTE = 185
COORD_SCALAR_BYTE = 71

TEXT_HEADER_BYTES = 3200
BINARY_HEADER_BYTES = 400
TRACE_HEADER_BYTES = 240

#: Bytes per sample of each SEG-Y sample format code segyio reads.
FORMAT_ITEMSIZE = {1: 4, 2: 4, 3: 2, 5: 4, 6: 8, 8: 1, 9: 8, 10: 4, 11: 2, 12: 8, 16: 1}

#: Upper bound on the raw trace bytes held at once while exporting a volume as SEG-Y (bytes).
READ_BATCH_BYTES = 64 * 2**20
#: Upper bound on the raw trace bytes of one read while reading a box (bytes). A box is read in contiguous trace
#: runs, each asked of the kernel ahead (:func:`_prefetch`); a run longer than this is read in pieces, so the
#: copies of one piece overlap the disk's reads of the next. Cold reads of 16-inline slabs of a 2 GiB
#: inline-sorted survey ran at about 340 MiB/s in 64 MiB pieces and about 600 MiB/s in 4 MiB pieces, both with
#: the read-ahead (``python -m benchmarks.studies.real_size --skip scan pipeline``).
READ_PIECE_BYTES = 4 * 2**20

_HINT_BYTES = (
    "If the inline/crossline numbers are stored elsewhere, pass their byte locations, e.g. "
    "`open_segy(path, iline=9, xline=21)` (or SegySource(path, iline=..., xline=...))."
)


# --------------------------------------------------------------------------- geometry


@dataclass(frozen=True, eq=False)
class SegyGeometry:
    """Where each (inline, crossline) trace of a post-stack file lives, from headers only.

    ``ilines``/``xlines`` are the header numbers in ascending order (the volume's
    axis 0 and 1); ``samples_ms`` the sample times (axis 2). ``sorting`` is
    ``"iline"`` (trace = i × n_xlines + j), ``"xline"`` (trace = j × n_ilines + i)
    or ``"unsorted"``, in which case ``trace_map[i, j]`` holds the trace index.
    Small enough to ship to every worker for a sorted file (the map is kept only
    for unsorted files).
    """

    path: str
    iline_byte: int
    xline_byte: int
    endian: str
    format_code: int
    ilines: np.ndarray
    xlines: np.ndarray
    samples_ms: np.ndarray
    sorting: str
    tracecount: int
    trace_map: np.ndarray | None = field(default=None, repr=False)
    #: (cdp_x, cdp_y) on the (iline, xline) grid, coordinate scalar applied; None where not recorded. Kept in the
    #: flow process only: a source drops it before it is shipped to workers.
    cdp: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.ilines), len(self.xlines), len(self.samples_ms))

    @property
    def sample_interval_ms(self) -> float:
        s = self.samples_ms
        return float(s[1] - s[0]) if len(s) > 1 else 0.0

    def trace_index(self, ii: np.ndarray, jj: np.ndarray) -> np.ndarray:
        """Trace indices (file order) of the outer product of inline indices ``ii`` and crossline indices ``jj``."""
        ii = np.asarray(ii, dtype=np.int64)
        jj = np.asarray(jj, dtype=np.int64)
        if self.sorting == "iline":
            return ii[:, None] * len(self.xlines) + jj[None, :]
        if self.sorting == "xline":
            return jj[None, :] * len(self.ilines) + ii[:, None]
        assert self.trace_map is not None
        return self.trace_map[np.ix_(ii, jj)].astype(np.int64)


_IMPORT_LOCK = threading.Lock()


def _segyio():
    """The segyio module, imported on first use (workers that never touch SEG-Y do not pay for it).

    Under a lock, with its C extension: ``segyio.open`` imports the extension (``from . import _segyio``) at its
    first call, and two threads of one fresh Dask worker opening their first files at once raced on that import,
    one getting the module half-initialised (``AttributeError: cannot access submodule '_segyio' of module
    'segyio' (most likely due to a circular import)``, seen in a 2-thread worker's first tasks, of a plain Prefect
    flow and of the runner's chunks alike).
    """
    with _IMPORT_LOCK:
        import segyio
        import segyio._segyio  # noqa: F401 - loaded here, once, not by the first segyio.open of each thread

    return segyio


def detect_endian(path: str | os.PathLike) -> str:
    """``"big"`` or ``"little"``: the byte order that gives a valid sample-format code (binary header bytes 3225-6).

    segyio 1.9 does not detect byte order itself: opened with the wrong one, a
    little-endian file looks truncated. Big-endian (the standard) wins a tie.
    """
    with open(path, "rb") as fh:
        fh.seek(TEXT_HEADER_BYTES + 24)
        raw = fh.read(2)
    if len(raw) < 2:
        return "big"
    big, little = struct.unpack(">h", raw)[0], struct.unpack("<h", raw)[0]
    if big in FORMAT_ITEMSIZE:
        return "big"
    if little in FORMAT_ITEMSIZE:
        return "little"
    return "big"


def _binary_header(path: str, endian: str) -> dict[str, int]:
    """The few binary-header fields needed to check a file's size before segyio opens it."""
    e = ">" if endian == "big" else "<"
    with open(path, "rb") as fh:
        fh.seek(TEXT_HEADER_BYTES)
        b = fh.read(BINARY_HEADER_BYTES)
    if len(b) < BINARY_HEADER_BYTES:
        return {}
    return {
        "interval_us": struct.unpack(e + "H", b[16:18])[0],
        "samples": struct.unpack(e + "H", b[20:22])[0],
        "format": struct.unpack(e + "h", b[24:26])[0],
        "ext_headers": struct.unpack(e + "h", b[304:306])[0],
    }


def check_file(path: str | os.PathLike) -> tuple[str, str]:
    """Refuse a missing, header-only or visibly truncated file before segyio sees it; return ``(path, endian)``."""
    p = Path(path)
    if not p.exists():
        raise SegyFileNotFoundError(
            p, "no such file. Expected a SEG-Y file (.sgy/.segy); check the path and the working directory "
            f"({os.getcwd()})."
        )
    if p.is_dir():
        raise SegyError(p, "is a directory, expected a SEG-Y file.")
    size = p.stat().st_size
    header_bytes = TEXT_HEADER_BYTES + BINARY_HEADER_BYTES
    if size < header_bytes:
        raise SegyTruncatedError(
            p, f"the file is {size} bytes, shorter than the {header_bytes}-byte textual + binary header every "
            "SEG-Y file starts with: not a SEG-Y file, or a cut-off copy. Copy or download it again."
        )
    endian = detect_endian(p)
    bh = _binary_header(str(p), endian)
    # The sample format first: it is what tells SEG-Y from anything else, and every other field of the binary
    # header means nothing in a file that is not SEG-Y (text read as binary makes a huge extended-header count).
    itemsize = FORMAT_ITEMSIZE.get(bh.get("format", 0))
    if itemsize is None:
        raise NotSegyError(
            p, f"not a SEG-Y file: its binary header (bytes 3201-3600) holds no SEG-Y sample format (bytes "
            f"3225-3226 read {bh.get('format')} either byte order; SEG-Y uses "
            f"{', '.join(str(k) for k in sorted(FORMAT_ITEMSIZE))}){_looks_like(p)}. Give the path of a SEG-Y "
            "file, or repair its binary header if it is one.")
    ext = max(0, bh.get("ext_headers", 0))
    first_trace = header_bytes + ext * TEXT_HEADER_BYTES
    if size <= first_trace:
        raise SegyEmptyError(
            p, f"the file holds headers only ({size} bytes) and no traces: expected trace data after byte "
            f"{first_trace}. Nothing to process; check that the right file was exported."
        )
    ns = bh.get("samples", 0)
    if itemsize and ns > 0:
        trace_bytes = TRACE_HEADER_BYTES + ns * itemsize
        whole, rest = divmod(size - first_trace, trace_bytes)
        if rest:
            raise SegyTruncatedError(
                p, f"the binary header declares {ns} samples of {itemsize} bytes (format {bh['format']}, "
                f"{endian}-endian), so each trace takes {trace_bytes} bytes, but the {size - first_trace} bytes "
                f"after the headers are {whole} whole traces and {rest} bytes more. The file is truncated or "
                "its binary header is wrong; copy it again or repair the header."
            )
    return str(p), endian


#: What the first bytes of a file that is not SEG-Y say it is.
_MAGIC = ((b"\x89PNG", "a PNG image"), (b"PK\x03\x04", "a zip archive"), (b"\x1f\x8b", "a gzip file"),
          (b"%PDF", "a PDF document"), (b"\x89HDF", "an HDF5 file"), (b"{", "JSON text"))


def _looks_like(path: Path) -> str:
    """`` (it looks like ...)`` from the file's first bytes, or "" where they say nothing."""
    with open(path, "rb") as fh:
        head = fh.read(TEXT_HEADER_BYTES + BINARY_HEADER_BYTES)
    for magic, what in _MAGIC:
        if head.startswith(magic):
            return f" (it starts like {what})"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return ""
    if text.isprintable() or all(c.isprintable() or c in "\r\n\t" for c in text):
        first = text.strip().splitlines()[0][:40] if text.strip() else ""
        return f" (it is plain text, starting {first!r})"
    return ""


def _open(path: str, endian: str):
    """segyio handle with geometry ignored (this module infers geometry itself), errors made typed."""
    segyio = _segyio()
    try:
        return segyio.open(path, "r", ignore_geometry=True, endian=endian)
    except RuntimeError as exc:
        msg = str(exc)
        if "inconsistent with file size" in msg or "unable to count traces" in msg:
            raise SegyTruncatedError(
                path, f"segyio cannot count whole traces ({msg}); the file is truncated or its headers "
                "declare the wrong sample count or format. Copy it again or repair the header."
            ) from exc
        raise SegyError(path, f"segyio cannot open it: {msg}") from exc
    except (IndexError, ValueError, OSError) as exc:
        raise SegyError(path, f"segyio cannot open it ({type(exc).__name__}: {exc}).") from exc


def check_byte_location(path: str, what: str, value: object) -> int:
    """A trace-header byte location segyio can read (the 1-based start of a header field), else a typed error."""
    valid = {int(f) for f in _segyio().TraceField.enums()}
    try:
        byte = int(value)  # type: ignore[call-overload]
        ok = not isinstance(value, bool) and byte == value and byte in valid
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise SegyGeometryError(
            path, f"{what}={value!r} is not a trace-header byte location: give the 1-based start of a header "
            "field, e.g. iline=189, xline=193 (SEG-Y rev 1) or iline=9, xline=21, as "
            "open_segy(path, iline=..., xline=...)")
    return byte


def scan(path: str | os.PathLike, iline: int = INLINE_BYTE, xline: int = CROSSLINE_BYTE,
         endian: str | None = None) -> SegyGeometry:
    """Read a file's headers (never its samples) and infer its post-stack 3D geometry.

    ``iline``/``xline`` are the trace-header byte locations of the inline and
    crossline numbers (1-based; 189/193 per SEG-Y rev 1). Raises a typed
    :class:`~memchunk_prefect.core.errors.SegyError` for a missing, truncated or empty
    file, a file whose traces do not form an (inline, crossline) grid, a pre-stack
    file, or a grid that disagrees with the trace count.
    """
    path, detected = check_file(path)
    iline = check_byte_location(path, "iline", iline)
    xline = check_byte_location(path, "xline", xline)
    endian = endian or detected
    with _open(path, endian) as f:
        n = f.tracecount
        samples = np.asarray(f.samples, dtype=np.float64)
        if n == 0 or len(samples) == 0:
            raise SegyEmptyError(path, f"found {n} traces of {len(samples)} samples: expected at least one trace "
                                 "with at least one sample. Nothing to process.")
        try:
            il = np.asarray(f.attributes(int(iline))[:], dtype=np.int64)
            xl = np.asarray(f.attributes(int(xline))[:], dtype=np.int64)
            off = np.asarray(f.attributes(OFFSET_BYTE)[:], dtype=np.int64)
        except (KeyError, IndexError, ValueError) as exc:
            raise SegyGeometryError(path, f"cannot read trace-header bytes iline={iline}, xline={xline}: {exc}. "
                                    "Byte locations are 1-based positions of 4-byte fields in the 240-byte trace "
                                    "header (189/193 per SEG-Y rev 1).") from exc
        fmt = int(f.format) if hasattr(f, "format") and isinstance(f.format, (int, np.integer)) else int(
            f.bin[_segyio().BinField.Format])
        # The coordinates in the same open file: a second scan later cost as much again (0.4 s per 128k traces).
        cdp_raw = tuple(np.asarray(f.attributes(b)[:], dtype=np.float64)
                        for b in (CDP_X_BYTE, CDP_Y_BYTE, COORD_SCALAR_BYTE))
    geom = geometry_from_headers(path, il, xl, off, samples, iline=int(iline), xline=int(xline),
                                 endian=endian, format_code=fmt)
    return dataclasses.replace(geom, cdp=_cdp_on_grid(geom, *cdp_raw))


def geometry_from_headers(path: str, il: np.ndarray, xl: np.ndarray, off: np.ndarray, samples: np.ndarray, *,
                          iline: int, xline: int, endian: str, format_code: int) -> SegyGeometry:
    """Infer the grid from per-trace inline, crossline and offset numbers (pure; the checks live here)."""
    n = len(il)
    where = f"inline (byte {iline}) and crossline (byte {xline})"
    ilines, ii = np.unique(il, return_inverse=True)
    xlines, jj = np.unique(xl, return_inverse=True)
    offsets = np.unique(off)
    if n > 1 and len(ilines) == 1 and len(xlines) == 1:
        raise SegyNotA3DVolumeError(
            path, f"not a sorted 3D volume: the {where} headers hold the same pair ({ilines[0]}, {xlines[0]}) in "
            f"all {n} traces, so the traces cannot be placed on an inline/crossline grid (shot gathers, 2D "
            f"lines and files with blank headers look like this). {_HINT_BYTES}"
        )
    pair = ii.astype(np.int64) * len(xlines) + jj
    counts = np.bincount(pair, minlength=len(ilines) * len(xlines))
    if counts.max() > 1:
        if len(offsets) > 1:
            per_pair = np.unique(counts[counts > 0])
            raise SegyPrestackError(
                path, f"pre-stack data: {len(offsets)} offsets (byte {OFFSET_BYTE}: {offsets[:5].tolist()}"
                f"{' ...' if len(offsets) > 5 else ''}) and up to {per_pair.max()} traces per (inline, crossline) "
                "position; expected one trace per position (a post-stack volume). Stack the gathers first, or "
                "select one offset, and write a post-stack SEG-Y file."
            )
        dup = int(np.argmax(counts > 1))
        raise SegyNotA3DVolumeError(
            path, f"not a sorted 3D volume: {int((counts > 1).sum())} (inline, crossline) positions hold more "
            f"than one trace, e.g. ({ilines[dup // len(xlines)]}, {xlines[dup % len(xlines)]}) holds "
            f"{counts[dup]}, reading the {where} headers. Expected exactly one trace per position. {_HINT_BYTES}"
        )
    if len(ilines) * len(xlines) != n:
        miss = int(np.argmax(counts == 0))
        raise SegyGeometryError(
            path, f"the headers name {len(ilines)} inlines x {len(xlines)} crosslines = "
            f"{len(ilines) * len(xlines)} positions, but the file has {n} traces of {len(samples)} samples: "
            f"{len(ilines) * len(xlines) - n} positions have no trace, e.g. (inline {ilines[miss // len(xlines)]}, "
            f"crossline {xlines[miss % len(xlines)]}). Expected a full rectangular grid; pad the missing traces "
            f"(e.g. with zeros) when exporting, or check the byte locations ({where}). {_HINT_BYTES}"
        )
    tmap = np.empty((len(ilines), len(xlines)), dtype=np.int64)
    tmap[ii, jj] = np.arange(n)
    ni, nx = tmap.shape
    if np.array_equal(tmap.ravel(), np.arange(n)):
        sorting, keep = "iline", None
    elif np.array_equal(tmap.T.ravel(), np.arange(n)):
        sorting, keep = "xline", None
    else:
        sorting, keep = "unsorted", tmap.astype(np.int32 if n < 2**31 else np.int64)
    return SegyGeometry(path=path, iline_byte=iline, xline_byte=xline, endian=endian, format_code=format_code,
                        ilines=ilines, xlines=xlines, samples_ms=samples, sorting=sorting, tracecount=n,
                        trace_map=keep)


def _cdp_on_grid(geom: SegyGeometry, x: np.ndarray, y: np.ndarray, s: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """CDP_X/CDP_Y (bytes 181/185, per trace in file order) as (iline, xline) float64 arrays with the coordinate
    scalar (byte 71) applied; None when every coordinate is zero (not recorded).

    SEG-Y scalar rule: negative means divide by its absolute value, positive means multiply, zero means 1.
    """
    if not (x.any() or y.any()):
        return None
    factor = np.where(s < 0, 1.0 / np.where(s == 0, 1, np.abs(s)), np.where(s == 0, 1.0, s))
    idx = geom.trace_index(np.arange(geom.shape[0]), np.arange(geom.shape[1]))
    return (x * factor)[idx], (y * factor)[idx]


# --------------------------------------------------------------------------- reading


class _Handles(threading.local):
    """Open segyio handles, one set per thread (segyio handles are not thread-safe).

    Keyed by path, byte order and the file's (size, mtime) so a rewritten file is reopened.
    """

    def __init__(self) -> None:
        self.files: dict[tuple, object] = {}


_HANDLES = _Handles()


def handle(path: str, endian: str):
    """A cached open segyio handle for this thread (opened on first use in each worker process)."""
    st = os.stat(path)
    key = (path, endian, st.st_size, st.st_mtime_ns)
    f = _HANDLES.files.get(key)
    if f is None:
        for old in [k for k in _HANDLES.files if k[0] == path]:
            _HANDLES.files.pop(old).close()  # type: ignore[attr-defined]
        f = _open(path, endian)
        _HANDLES.files[key] = f
    return f


def close_handles() -> None:
    """Close this thread's cached segyio handles (tests, or before deleting files)."""
    for f in _HANDLES.files.values():
        f.close()  # type: ignore[attr-defined]
    _HANDLES.files.clear()


def _runs(sorted_idx: np.ndarray, max_len: int) -> list[tuple[int, int, int]]:
    """Split sorted unique trace indices into contiguous runs ``(pos, first_trace, length)`` of at most ``max_len``."""
    if len(sorted_idx) == 0:
        return []
    breaks = np.flatnonzero(np.diff(sorted_idx) != 1) + 1
    starts = np.concatenate(([0], breaks))
    stops = np.concatenate((breaks, [len(sorted_idx)]))
    out = []
    for a, b in zip(starts.tolist(), stops.tolist()):
        for p in range(a, b, max_len):
            out.append((p, int(sorted_idx[p]), min(max_len, b - p)))
    return out


def _prefetch(geom: SegyGeometry, f: Any, runs: list[tuple[int, int, int]], itemsize: int) -> None:
    """Ask the kernel to start reading every run of a block at once (``posix_fadvise(WILLNEED)``), so the disk
    reads ahead of the copies: a block spread over the file (a tile of an inline-sorted survey, one run per inline)
    has its runs in flight together, and one long run is read ahead whole rather than at the kernel's default
    readahead. ``benchmarks/studies/real_size.py`` measures the read rates with and without. Where
    ``posix_fadvise`` does not exist (not Linux) or the file cannot be opened again, nothing is done."""
    if not hasattr(os, "posix_fadvise") or not runs:
        return
    trace_bytes = 240 + geom.shape[2] * itemsize
    start = 3600 + 3200 * int(getattr(f, "ext_headers", 0) or 0)
    try:
        fd = os.open(geom.path, os.O_RDONLY)
    except OSError:
        return
    try:
        for _, a, n in runs:
            os.posix_fadvise(fd, start + a * trace_bytes, n * trace_bytes, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_traces(geom: SegyGeometry, ii: np.ndarray, jj: np.ndarray, tkey: slice | np.ndarray) -> np.ndarray:
    """Samples ``tkey`` of the traces at inline indices ``ii`` × crossline indices ``jj``.

    Returned as float32 (len(ii), len(jj), nt).

    Only those traces are read, in contiguous runs (``f.trace.raw[a:b]``), at most
    :data:`READ_PIECE_BYTES` of raw samples at a time. This is the only function
    that reads sample data; tests patch it to prove that opening reads none.
    """
    f = handle(geom.path, geom.endian)
    idx = geom.trace_index(ii, jj).ravel()
    nt = len(np.arange(geom.shape[2])[tkey])
    itemsize = FORMAT_ITEMSIZE.get(geom.format_code, 4)
    max_len = max(1, READ_PIECE_BYTES // max(1, geom.shape[2] * itemsize))
    if len(idx) > 1 and bool(np.all(idx[1:] > idx[:-1])):
        # A block of a sorted file: its traces come in file order, each once, so every run of adjacent traces
        # is copied straight to its rows (no sort, no gather).
        out = np.empty((len(idx), nt), dtype=np.float32)
        runs = _runs(idx, max_len)
        _prefetch(geom, f, runs, itemsize)
        for pos, a, n in runs:
            raw = f.trace.raw[a:a + n]
            out[pos:pos + n] = raw[None, tkey] if raw.ndim == 1 else raw[:, tkey]
        return out.reshape(len(ii), len(jj), nt)
    order = np.argsort(idx, kind="stable")
    sidx = idx[order]
    uniq, first = np.unique(sidx, return_index=True)
    out = np.empty((len(idx), nt), dtype=np.float32)
    runs = _runs(uniq, max_len)
    _prefetch(geom, f, runs, itemsize)
    for pos, a, n in runs:
        raw = f.trace.raw[a:a + n]  # (n, samples) in the file's dtype (int16 for format 3, ...)
        if raw.ndim == 1:
            raw = raw[None, :]
        block = np.asarray(raw[:, tkey], dtype=np.float32)
        # uniq[pos:pos+n] are traces a..a+n-1; scatter them to every output row that asked for them
        lo, hi = first[pos], (first[pos + n] if pos + n < len(first) else len(sidx))
        sel = sidx[lo:hi] - a
        out[order[lo:hi]] = block[sel]
    return out.reshape(len(ii), len(jj), nt)


# --------------------------------------------------------------------------- synthetic surveys


# --------------------------------------------------------------------------- SEG-Y export


