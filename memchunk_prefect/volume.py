"""Volumes in and out: SEG-Y, zarr and in-memory arrays as sources of blocks; zarr as the output.

A *source* is a small picklable object the runner ships to Dask workers — a path
and a few numbers, never the samples (except :class:`ArraySource`, which holds an
in-memory array). On the worker, ``source.read(chunk)`` reads exactly one box,
as float32 (iline, xline, twt). :func:`read_block` adds the halo by the package's
one edge rule (:func:`memchunk_prefect.chunks.with_halo`: clipped at the volume's
edges) and returns the slices that trim it off the operator's result.

>>> src = as_source(np.arange(24, dtype="float32").reshape(2, 3, 4))
>>> block, trim = read_block(src, Chunk((1, 0, 0), (2, 3, 4)), halo=(1, 0, 0))
>>> block.shape, block[trim].shape
((2, 3, 4), (1, 3, 4))

Results are written with :class:`ZarrOutput` by region from many worker
processes at once; each finished chunk leaves an atomic completion marker, so a
store is reported complete only when the finished chunks cover every element.
:func:`open_result` opens a finished store as an ``xarray.DataArray`` with the
input's coordinates and :func:`~memchunk_prefect.segy.to_segy` exports it with the input file's headers.

NaN and Inf samples are read and written as they are: nothing here replaces or
checks them (operators document what they produce from them).

Byte-level SEG-Y work (headers, geometry, synthetic surveys) is in
:mod:`memchunk_prefect.segy`.
"""

from __future__ import annotations

import abc
import fcntl
import json
import math
import os
import shutil
import threading
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import xarray as xr
import zarr
from xarray.backends import BackendArray
from xarray.core import indexing

from . import segy as _segy
from .chunks import (
    AXES,
    Chunk,
    check_halo,
    check_shape,
    covers_exactly,
    normalize_halo,
    uncovered_boxes,
    with_halo,
)
from .errors import (
    ChunkedSourceError,
    IncompleteOutputError,
    OutputPathError,
    VolumeError,
)
from .files import atomic_write_text
from .segy import SegyGeometry, synthetic_survey, synthetic_volume, to_segy  # noqa: F401 (public re-exports)

__all__ = [
    "Source", "SegySource", "ZarrSource", "ArraySource", "as_source", "read_block",
    "open_segy", "synthetic_survey", "synthetic_volume",
    "ZarrOutput", "open_result", "to_segy", "DEFAULT_SAMPLE_INTERVAL_MS",
]

#: Sample interval given to arrays that carry none (ms), the common seismic default.
DEFAULT_SAMPLE_INTERVAL_MS = 4.0
#: Target size of one zarr storage chunk when none is given (bytes); 1-4 MiB suits local disks and object stores.
TARGET_STORAGE_CHUNK_BYTES = 2 * 2**20
#: Name of the data array inside a store written by ZarrOutput.
DATA_NAME = "data"
#: Storage chunks a region write processes at once (zarr's ``async.concurrency`` for the write; see ZarrOutput.write).
WRITE_CONCURRENCY = 1
#: Storage chunks a region read decompresses at once (zarr's ``async.concurrency`` for the read; see _read_region).
READ_CONCURRENCY = 2
#: Bookkeeping group inside a ZarrOutput store (completion markers and write locks).
META_GROUP = ".memchunk"

SEGY_SUFFIXES = (".sgy", ".segy")


def _as_f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _default_coords(shape: Sequence[int], sample_interval_ms: float = DEFAULT_SAMPLE_INTERVAL_MS) -> dict:
    ni, nx, nt = shape
    return {"iline": np.arange(ni), "xline": np.arange(nx),
            "twt": np.arange(nt) * float(sample_interval_ms), "sample_interval_ms": float(sample_interval_ms)}


# --------------------------------------------------------------------------- sources


class Source(abc.ABC):
    """What the runner needs from a volume: its shape, its coordinates, and one box at a time.

    Subclasses are small and picklable; ``read`` runs on the worker.
    """

    kind = "abstract"

    @property
    @abc.abstractmethod
    def shape(self) -> tuple[int, int, int]:
        """(iline, xline, twt) element counts."""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole volume as float32."""
        ni, nx, nt = self.shape
        return ni * nx * nt * 4

    @abc.abstractmethod
    def coords(self) -> dict[str, Any]:
        """``iline``, ``xline``, ``twt`` (ms) arrays, ``sample_interval_ms``, and ``cdp_x``/``cdp_y`` when known."""

    @abc.abstractmethod
    def read(self, chunk: Chunk) -> np.ndarray:
        """The float32, C-contiguous samples of exactly ``chunk`` (iline, xline, twt)."""

    def _check_chunk(self, chunk: Chunk) -> None:
        if any(b > n for b, n in zip(chunk.stop, self.shape)):
            raise VolumeError(f"{self!r}: chunk {chunk} reaches past the volume of shape {self.shape}")

    def memchunk_source(self) -> dict | None:
        """A JSON-able description that :func:`as_source` turns back into this source (None for in-memory)."""
        return None

    def identity(self) -> dict | None:
        """What an output computed from this source must have been computed from, to be resumed (JSON-able).

        Cheap (no data read). ``None`` when the content cannot be identified
        cheaply (an array in memory, a zarr store not written by memchunk): an
        output from such a source is always computed afresh, never resumed.
        """
        return None


class SegySource(Source):
    """A post-stack SEG-Y file read trace by trace on whichever process calls :meth:`read`.

    Pickles as the path, the byte locations and a small geometry (inline/crossline
    numbers and sample times; no per-trace data for sorted files), so workers do not
    rescan headers. Each worker thread keeps its own open segyio handle.
    """

    kind = "segy"

    def __init__(self, path: str | os.PathLike, iline: int = _segy.INLINE_BYTE, xline: int = _segy.CROSSLINE_BYTE,
                 *, endian: str | None = None, geometry: SegyGeometry | None = None):
        self.path = os.path.abspath(os.fspath(path))
        self.geometry = geometry or _segy.scan(self.path, iline, xline, endian)
        self.iline = self.geometry.iline_byte
        self.xline = self.geometry.xline_byte
        self.endian = self.geometry.endian
        self._coords: dict | None = None

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        d["_coords"] = None  # cdp_x/cdp_y are per trace: re-read them where needed, never ship them
        return d

    def __repr__(self) -> str:
        return f"SegySource({self.path!r}, iline={self.iline}, xline={self.xline})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SegySource) and (self.path, self.iline, self.xline) == (
            other.path, other.iline, other.xline)

    def __hash__(self) -> int:
        return hash((self.path, self.iline, self.xline))

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.geometry.shape

    def coords(self) -> dict[str, Any]:
        if self._coords is None:
            g = self.geometry
            c = {"iline": g.ilines.copy(), "xline": g.xlines.copy(), "twt": g.samples_ms.copy(),
                 "sample_interval_ms": g.sample_interval_ms}
            cdp = _segy.scan_cdp(self.path, g)
            if cdp is not None:
                c["cdp_x"], c["cdp_y"] = cdp
            self._coords = c
        return {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in self._coords.items()}

    def read(self, chunk: Chunk) -> np.ndarray:
        self._check_chunk(chunk)
        return _segy.read_traces(self.geometry, np.arange(chunk.start[0], chunk.stop[0]),
                                 np.arange(chunk.start[1], chunk.stop[1]), slice(chunk.start[2], chunk.stop[2]))

    def memchunk_source(self) -> dict:
        return {"kind": "segy", "path": self.path, "iline": self.iline, "xline": self.xline}

    def identity(self) -> dict:
        """Path, header byte locations, size and modification time (ns): a rewritten file is a new input."""
        st = os.stat(self.path)
        return {**self.memchunk_source(), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


class _ZarrArrays(threading.local):
    def __init__(self) -> None:
        self.arrays: dict[tuple, Any] = {}


_ZARR = _ZarrArrays()


def _zarr_array(path: str, name: str | None, mode: str = "r"):
    """Open (and cache per thread) the 3D array of a zarr store: ``name`` inside a group, or the root array."""
    key = (path, name, mode)
    arr = _ZARR.arrays.get(key)
    if arr is None:
        arr = zarr.open_array(path, path=name or "", mode=mode) if name else zarr.open_array(path, mode=mode)
        _ZARR.arrays[key] = arr
    return arr


def _read_region(arr: Any, chunk: Chunk) -> np.ndarray:
    """``arr[chunk]`` as float32, at most :data:`READ_CONCURRENCY` storage chunks decompressed at once.

    zarr otherwise decompresses up to ``async.concurrency`` (10) of the region's
    storage chunks at once, and how many were alive together moved the read's
    peak from run to run, which the model learns from: 16 x 128 x 400 slabs of a
    store in 36 x 36 x 400 storage chunks, each read 5 times (three runs), peaked at 8-28 MiB
    above resting memory at 10, 6-11 MiB at 2 in the same time, 3-8 MiB at 1 but
    ~40% slower (``python -m benchmarks.write_memory``, its reads-only rows). As
    for writes, the setting is the process's while it is set: with several
    threads per worker another thread's read may run at either concurrency (its
    memory, not its result, differs).
    """
    with zarr.config.set({"async.concurrency": READ_CONCURRENCY}):
        return _as_f32(arr[chunk.slices()])


def _find_zarr_array(path: str) -> str | None:
    """The name of the volume inside a zarr store: ``None`` for a root array, else the group member to use."""
    try:
        node = zarr.open(path, mode="r")
    except Exception as exc:  # zarr raises several types for "not a store"
        raise ChunkedSourceError(f"{path}: cannot open as a zarr store ({type(exc).__name__}: {exc}); expected a "
                                 "store written by ZarrOutput or any 3D zarr array") from exc
    if isinstance(node, zarr.Array):
        return None
    names = [n for n, a in node.arrays() if a.ndim == 3]
    if DATA_NAME in names:
        return DATA_NAME
    if len(names) == 1:
        return names[0]
    raise ChunkedSourceError(f"{path}: expected one 3D array (or one named {DATA_NAME!r}) in the zarr group, "
                             f"found {names or 'none'}")


class ZarrSource(Source):
    """A 3D zarr array on disk: a :class:`ZarrOutput` store (the ``data`` array) or any store holding one 3D array.

    Coordinates come from the store's ``iline``/``xline``/``twt`` (and ``cdp_x``/``cdp_y``)
    arrays when present, else indices and a 4 ms interval.
    """

    kind = "zarr"

    def __init__(self, path: str | os.PathLike, name: str | None = ...):  # type: ignore[assignment]
        self.path = os.path.abspath(os.fspath(path))
        if not os.path.exists(self.path):
            raise ChunkedSourceError(f"{self.path}: no such zarr store")
        self.name = _find_zarr_array(self.path) if name is ... else name
        arr = _zarr_array(self.path, self.name)
        if arr.ndim != 3:
            raise VolumeError(f"{self.path}: expected a 3D array (iline, xline, twt), found shape {arr.shape}")
        self._shape = check_shape(arr.shape)

    def __repr__(self) -> str:
        return f"ZarrSource({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZarrSource) and (self.path, self.name) == (other.path, other.name)

    def __hash__(self) -> int:
        return hash((self.path, self.name))

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._shape

    def coords(self) -> dict[str, Any]:
        c = _default_coords(self.shape)
        if self.name is None:
            return c
        g = zarr.open_group(self.path, mode="r")
        attrs = dict(g.attrs)
        if isinstance(attrs.get("sample_interval_ms"), (int, float)):
            c = _default_coords(self.shape, float(attrs["sample_interval_ms"]))  # type: ignore[arg-type]
        members = {n for n, _ in g.arrays()}
        for k in ("iline", "xline", "twt", "cdp_x", "cdp_y"):
            if k in members:
                c[k] = np.asarray(g[k][...])  # type: ignore[index]  # zarr's Group typing misses array slicing
        return c

    def read(self, chunk: Chunk) -> np.ndarray:
        """The region's values as float32, a few storage chunks decompressed at a time (:func:`_read_region`)."""
        self._check_chunk(chunk)
        if self.name == DATA_NAME and not zarr.open_group(self.path, mode="r").attrs.get("complete"):
            # A memchunk output another map is still writing (chained maps run side by side): the region asked
            # for is written, but a storage chunk it shares with a region being written now is rewritten in
            # place (zarr reads, merges and rewrites it, under that chunk's lock): read it under the same lock.
            return ZarrOutput(self.path, name=self.name).read_locked(chunk)
        return _read_region(_zarr_array(self.path, self.name), chunk)

    def memchunk_source(self) -> dict:
        return {"kind": "zarr", "path": self.path, "name": self.name}

    def identity(self, complete: bool = True) -> dict | None:
        """A memchunk store's ``write_id`` (new each time it is created) and ``completed_at``; None for others.

        ``complete=False``: the identity of a store another map of the same flow is still writing (chained maps
        run side by side): its ``write_id`` alone, the same before and after it completes.
        """
        if self.name is None:
            return None
        attrs = dict(zarr.open_group(self.path, mode="r").attrs)
        if not attrs.get("write_id"):
            return None
        if not complete:
            return {**self.memchunk_source(), "write_id": attrs["write_id"]}
        if not attrs.get("complete"):
            return None
        return {**self.memchunk_source(), "write_id": attrs["write_id"], "completed_at": attrs.get("completed_at")}


_THIRD_DIMS = ("twt", "time", "depth", "samples", "sample")


class ArraySource(Source):
    """An array in memory: numpy (axes read as iline, xline, twt) or an ``xarray.DataArray``.

    A DataArray with dims named ``iline``/``xline`` and one of ``twt``/``time``/``depth``
    is transposed to that order; other 3D DataArrays are taken positionally.
    ``coords`` overrides the coordinates (numpy arrays get indices 0..n-1 and
    ``sample_interval_ms``, 4 ms unless given). A lazily-backed DataArray (e.g. a slice of
    :func:`open_segy`) stays lazy: only the box read is loaded.
    """

    kind = "array"

    def __init__(self, array: Any, *, coords: Mapping[str, Any] | None = None,
                 sample_interval_ms: float | None = None):
        self._coords: dict[str, Any]
        if isinstance(array, xr.DataArray):
            if array.ndim != 3:
                raise VolumeError(f"expected a 3D DataArray (iline, xline, twt), got dims {array.dims} "
                                  f"of shape {array.shape}")
            dims = list(array.dims)
            third = next((d for d in dims if d in _THIRD_DIMS), None)
            if "iline" in dims and "xline" in dims and third is not None:
                array = array.transpose("iline", "xline", third)
            check_shape(array.shape)
            dt = sample_interval_ms or array.attrs.get("sample_interval_ms")
            c = _default_coords(array.shape, dt or DEFAULT_SAMPLE_INTERVAL_MS)
            for name, dim in zip(("iline", "xline", "twt"), array.dims):
                if dim in array.coords:
                    c[name] = np.asarray(array.coords[dim].values)
            if dt is None and len(c["twt"]) > 1 and array.dims[2] in array.coords:
                c["sample_interval_ms"] = float(c["twt"][1] - c["twt"][0])
            for k in ("cdp_x", "cdp_y"):
                if k in array.coords and array.coords[k].dims == array.dims[:2]:
                    c[k] = np.asarray(array.coords[k].values)
            self._coords = c
            self.array = array
        else:
            arr = np.asarray(array)
            if arr.ndim != 3:
                raise VolumeError(f"expected a 3D array (iline, xline, twt), got shape {arr.shape}")
            check_shape(arr.shape)
            self._coords = _default_coords(arr.shape, sample_interval_ms or DEFAULT_SAMPLE_INTERVAL_MS)
            self.array = arr
        if coords:
            self._coords.update(coords)

    def __repr__(self) -> str:
        return f"ArraySource({type(self.array).__name__} of shape {self.shape})"

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.array.shape)  # type: ignore[return-value]

    def coords(self) -> dict[str, Any]:
        return {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in self._coords.items()}

    def read(self, chunk: Chunk) -> np.ndarray:
        self._check_chunk(chunk)
        a = self.array
        if hasattr(a, "isel") and hasattr(a, "dims"):
            return _as_f32(a.isel(dict(zip(a.dims, chunk.slices()))).values)
        return _as_f32(a[chunk.slices()])


def _still_backed_by_file(da: Any) -> bool:
    """True when ``da``'s data is still the untouched lazy file array (no arithmetic, no load, no selection).

    xarray (2026.x) keeps attrs through arithmetic (``result * 2`` keeps ``memchunk_source``)
    and through ``isel``, so the attribute alone would point changed data back at the file.
    Walk xarray's wrapper chain instead: every lazy indexer must select everything and
    the innermost array must be a backend array (SEG-Y or zarr), not numpy.
    """
    d = getattr(da.variable, "_data", None)
    for _ in range(16):
        key = getattr(d, "key", None)
        if key is not None:
            for k, n in zip(getattr(key, "tuple", ()), da.shape):
                if not (isinstance(k, slice) and k.indices(n) == (0, n, 1)):
                    return False
        if isinstance(d, BackendArray):
            return True
        if d is None or not hasattr(d, "array"):
            return False
        d = d.array
    return False


def _source_from_attrs(da: Any) -> Source | None:
    """The file-backed source a DataArray's ``memchunk_source`` attribute names, if it still describes the DataArray.

    xarray keeps attrs through ``isel``/``sel``, so the attribute alone could point a slice
    back at the whole file: the shape and the coordinates must match too.
    """
    desc = da.attrs.get("memchunk_source") if hasattr(da, "attrs") else None
    if not isinstance(desc, Mapping):
        return None
    try:
        if desc.get("kind") == "segy":
            src: Source = SegySource(desc["path"], desc.get("iline", _segy.INLINE_BYTE),
                                     desc.get("xline", _segy.CROSSLINE_BYTE))
        elif desc.get("kind") == "zarr":
            src = ZarrSource(desc["path"], desc.get("name", DATA_NAME))
        else:
            return None
    except Exception:
        return None  # the file moved or changed: fall back to the array itself
    if tuple(da.shape) != src.shape or tuple(da.dims) != AXES or not _still_backed_by_file(da):
        return None
    c = src.coords()
    for name in AXES:
        if name in da.coords and not np.array_equal(np.asarray(da.coords[name].values), c[name]):
            return None
    return src


def as_source(obj: Any, **kw: Any) -> Source:
    """Turn what a user passes to ``chunked(...)`` into a :class:`Source`.

    - a :class:`Source` → itself;
    - a ``str``/``Path`` ending ``.sgy``/``.segy`` → :class:`SegySource` (``iline=``, ``xline=`` pass through);
    - a zarr directory (or a path ending ``.zarr``) → :class:`ZarrSource`;
    - an ``xarray.DataArray`` from :func:`open_segy` / :func:`open_result`, unmodified → the file it
      names (so workers read the file); any other DataArray or a numpy array → :class:`ArraySource`.

    Anything else raises :class:`~memchunk_prefect.errors.ChunkedSourceError`.
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        p = Path(obj)
        if p.suffix.lower() in SEGY_SUFFIXES:
            return SegySource(p, **kw)
        if p.is_dir() and any((p / m).exists() for m in ("zarr.json", ".zarray", ".zgroup")):
            return ZarrSource(p, **kw)
        if p.suffix.lower() == ".zarr":
            return ZarrSource(p, **kw)
        raise ChunkedSourceError(
            f"cannot tell what volume the path {os.fspath(obj)!r} holds: expected a SEG-Y file ending "
            f"{' or '.join(SEGY_SUFFIXES)} or a zarr store directory"
            + ("" if p.exists() else " (and it does not exist)")
        )

    if isinstance(obj, xr.DataArray):
        mapped = None if kw else _source_from_attrs(obj)
        return mapped if mapped is not None else ArraySource(obj, **kw)
    if isinstance(obj, np.ndarray):
        return ArraySource(obj, **kw)
    raise ChunkedSourceError(
        f"cannot read a volume from a {type(obj).__module__}.{type(obj).__qualname__}: expected a SEG-Y path "
        "(.sgy/.segy), a zarr store path, an xarray.DataArray, a numpy array (iline, xline, twt), or a "
        "memchunk_prefect.volume source (SegySource, ZarrSource, ArraySource)"
    )


def read_block(source: Any, chunk: Chunk, halo: int | Sequence[int] | None = None) -> tuple[np.ndarray, tuple]:
    """Read ``chunk`` plus its halo (clipped at the volume's edges) and the slices that trim the halo off.

    ``block[trim]`` (and the operator's result ``[trim]``) has ``chunk.shape``. A halo
    larger than the volume raises :class:`~memchunk_prefect.errors.HaloTooLargeError`.
    """
    src = as_source(source)
    check_halo(normalize_halo(halo), src.shape)
    read, trim = with_halo(chunk, halo, src.shape)
    return src.read(read), trim


# --------------------------------------------------------------------------- open_segy (lazy xarray)


class SegyBackendArray(BackendArray):
    """Lazy SEG-Y samples for xarray (the way xarray's own backends do it).

    xarray wraps it in ``indexing.LazilyIndexedArray``; selections compose lazily and
    only the final outer-indexed read reaches :meth:`_raw_indexing_method`, which reads
    just the traces selected. Picklable: it holds only a :class:`SegySource`.
    """

    def __init__(self, source: SegySource):
        self.source = source
        self.shape = source.shape
        self.dtype = np.dtype("float32")

    def __getitem__(self, key):
        return indexing.explicit_indexing_adapter(key, self.shape, indexing.IndexingSupport.OUTER,
                                                  self._raw_indexing_method)

    def _raw_indexing_method(self, key: tuple) -> np.ndarray:
        idx, squeeze = [], []
        for axis, (k, n) in enumerate(zip(key, self.shape)):
            if isinstance(k, (int, np.integer)):
                idx.append(np.array([int(k) % n]))
                squeeze.append(axis)
            elif isinstance(k, slice):
                idx.append(np.arange(n)[k])
            else:
                idx.append(np.asarray(k, dtype=np.int64) % n)
        ii, jj, tt = idx
        if 0 in (len(ii), len(jj), len(tt)):
            out = np.empty((len(ii), len(jj), len(tt)), dtype=np.float32)
        else:
            contiguous = np.array_equal(tt, np.arange(tt[0], tt[0] + len(tt)))
            out = _segy.read_traces(self.source.geometry, ii, jj,
                                    slice(int(tt[0]), int(tt[0]) + len(tt)) if contiguous else tt)
        return out.squeeze(axis=tuple(squeeze)) if squeeze else out


def open_segy(path: str | os.PathLike, iline: int = _segy.INLINE_BYTE, xline: int = _segy.CROSSLINE_BYTE, *,
              endian: str | None = None, name: str | None = None):
    """A post-stack SEG-Y file as a lazy ``xarray.DataArray`` with dims ``(iline, xline, twt)``.

    Only headers are read here; samples are read when values are asked for, and
    then only the traces selected (``da.isel(iline=3).values`` reads one inline).
    Values are float32 for every sample format segyio reads (IBM and IEEE floats,
    1/2/4-byte integers; either byte order, detected from the binary header).

    Coordinates: ``iline``/``xline`` are the header numbers at bytes ``iline``/``xline``,
    ``twt`` the sample times in ms (``f.samples``), and ``cdp_x``/``cdp_y`` (2-D over
    iline, xline; scalar at byte 71 applied) when the file records them.
    ``attrs`` carry ``sample_interval_ms``, ``source`` (the path), the byte locations,
    ``sorting``, ``format_code`` and ``memchunk_source`` (how the runner maps the
    DataArray back to the file so workers read it directly).

    Bad files raise a typed :class:`~memchunk_prefect.errors.SegyError` naming the file.
    """
    src = SegySource(path, iline, xline, endian=endian)
    c = src.coords()
    backend = SegyBackendArray(src)
    var = xr.Variable(AXES, indexing.LazilyIndexedArray(backend))
    coords: dict[str, Any] = {"iline": c["iline"], "xline": c["xline"], "twt": ("twt", c["twt"], {"units": "ms"})}
    if "cdp_x" in c:
        coords["cdp_x"] = (("iline", "xline"), c["cdp_x"])
        coords["cdp_y"] = (("iline", "xline"), c["cdp_y"])
    g = src.geometry
    attrs = {
        "sample_interval_ms": g.sample_interval_ms, "source": src.path, "iline_byte": src.iline,
        "xline_byte": src.xline, "sorting": g.sorting, "format_code": g.format_code, "endian": g.endian,
        "memchunk_source": src.memchunk_source(),
    }
    return xr.DataArray(var, coords=coords, name=name or Path(src.path).stem, attrs=attrs)


# --------------------------------------------------------------------------- zarr output


def default_zarr_chunks(shape: Sequence[int], itemsize: int = 4,
                        target_bytes: int = TARGET_STORAGE_CHUNK_BYTES) -> tuple[int, int, int]:
    """Storage chunks of whole traces, about ``target_bytes`` each, near-square in (iline, xline).

    >>> default_zarr_chunks((128, 128, 400))
    (36, 36, 400)
    >>> default_zarr_chunks((3, 1000, 50))
    (3, 1000, 50)
    """
    ni, nx, nt = check_shape(shape)
    trace_bytes = nt * itemsize
    if trace_bytes > 2 * target_bytes:  # very long traces: cut time too
        return (1, 1, max(1, target_bytes // itemsize))
    traces = max(1, target_bytes // trace_bytes)
    side = max(1, int(math.isqrt(traces)))
    ci = min(ni, side)
    cx = min(nx, max(1, traces // ci))
    ci = min(ni, max(1, traces // cx))
    return (ci, cx, nt)


def _parse_key(key: str) -> Chunk | None:
    """Inverse of :meth:`Chunk.key`: ``i0-4_x0-8_t0-50`` → Chunk; None for anything else."""
    try:
        return Chunk.from_key(key)
    except VolumeError:
        return None


def _group_json(attrs: Mapping[str, Any]) -> str:
    return json.dumps({"zarr_format": 3, "node_type": "group", "attributes": dict(attrs)})


def _json_coords(coords: Mapping[str, Any]) -> dict:
    """Only the JSON-able scalars of a coords dict (arrays are stored as zarr arrays)."""
    return {k: v for k, v in coords.items() if not isinstance(v, np.ndarray) and isinstance(v, (int, float, str))}


class ZarrOutput:
    """A zarr (format 3) store that many worker processes fill by region, with per-chunk completion markers.

    Layout (a valid zarr hierarchy that ``xarray.open_zarr`` also reads)::

        <path>/data                 float32 (iline, xline, twt), fill NaN, dimension_names set
        <path>/iline, xline, twt    coordinate arrays (twt in ms); cdp_x, cdp_y (iline, xline) when known
        <path>/.memchunk/done/<chunk.key()>/zarr.json    one completion marker per finished chunk
        <path>/.memchunk/locks/<a.b.c>/zarr.json          lock file of storage chunk (a, b, c)

    Why the bookkeeping nodes are zarr groups: zarr 3.1 warns ("Object at .memchunk is
    not recognized as a component of a Zarr hierarchy") whenever it lists a group that
    holds plain files or directories, which ``xarray.open_zarr`` does on every open.
    Writing each marker and lock as an (empty) group's ``zarr.json`` keeps the store a
    clean hierarchy: xarray ignores subgroups, and zarr lists them silently.

    Concurrency: a write that covers whole storage chunks needs no lock (chunks of
    one map are disjoint, so no one else writes those storage chunks). A write that
    covers only part of a storage chunk makes zarr read, modify and rewrite that
    chunk, so two such writers could lose each other's data: it takes an exclusive
    ``fcntl.flock`` on that storage chunk's lock file first (in sorted order, so two
    writers never deadlock). The kernel drops the lock if the process dies.
    """

    def __init__(self, path: str | os.PathLike, *, name: str = DATA_NAME):
        self.path = os.path.abspath(os.fspath(path))
        self.name = name
        arr = _zarr_array(self.path, self.name)
        self.shape: tuple[int, int, int] = tuple(int(s) for s in arr.shape)  # type: ignore[assignment]
        self.zarr_chunks: tuple[int, int, int] = tuple(int(s) for s in arr.chunks)  # type: ignore[assignment]
        self.dtype = np.dtype(arr.dtype)

    def __repr__(self) -> str:
        return f"ZarrOutput({self.path!r}, shape={self.shape}, zarr_chunks={self.zarr_chunks})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZarrOutput) and (self.path, self.name) == (other.path, other.name)

    def __hash__(self) -> int:
        return hash((self.path, self.name))

    # ---- creating and opening

    @classmethod
    def create(cls, path: str | os.PathLike, shape: Sequence[int], coords: Mapping[str, Any] | None = None, *,
               dtype: str = "float32", attrs: Mapping[str, Any] | None = None,
               zarr_chunks: Sequence[int] | None = None, overwrite: bool = False) -> "ZarrOutput":
        """Create an empty store for a volume of ``shape`` with the input's ``coords`` (see :meth:`Source.coords`).

        ``attrs`` must be JSON-able; they go on the data array and the root group.
        An existing store raises :class:`~memchunk_prefect.errors.OutputPathError`
        unless ``overwrite=True`` (which deletes it, markers included); open an existing
        store with :meth:`open` to resume it.
        """
        shape = check_shape(shape)
        p = Path(path).absolute()
        if p.exists():
            if not overwrite:
                raise OutputPathError(f"{p}: already exists. Use ZarrOutput.open({str(p)!r}) to resume writing it, "
                                      "pass overwrite=True to replace it, or choose another path.")
            if not (p / "zarr.json").exists() and not (p.is_dir() and not any(p.iterdir())):
                raise OutputPathError(f"{p}: exists and is not a zarr store; refusing to delete it with overwrite=True")
            shutil.rmtree(p)
        c = dict(_default_coords(shape))
        if coords:
            c.update({k: v for k, v in coords.items() if v is not None})
        for k, n in zip(AXES, shape):
            if len(np.asarray(c[k])) != n:
                raise VolumeError(f"coordinate {k!r} has {len(np.asarray(c[k]))} values for an axis of {n}")
        zc = tuple(int(z) for z in (zarr_chunks or default_zarr_chunks(shape, np.dtype(dtype).itemsize)))
        zc = tuple(min(z, n) for z, n in zip(check_shape(zc), shape))
        try:
            json.dumps(dict(attrs or {}))
        except TypeError as exc:
            raise VolumeError(f"attrs must be JSON-able (plain numbers, strings, lists, dicts): {exc}") from exc
        root_attrs = {"dims": list(AXES), "shape": list(shape), "zarr_chunks": list(zc), "complete": False,
                      "memchunk_store": 1, "write_id": uuid.uuid4().hex, **_json_coords(c), **dict(attrs or {})}
        g = zarr.open_group(str(p), mode="w", attributes=root_attrs)
        os.chmod(p, 0o700)  # results are the user's: a user-only root hides everything inside it
        fill = np.nan if np.dtype(dtype).kind == "f" else 0
        a = g.create_array(DATA_NAME, shape=shape, chunks=zc, dtype=dtype, fill_value=fill,
                           dimension_names=AXES)
        a.attrs.update({"sample_interval_ms": float(c["sample_interval_ms"]), **dict(attrs or {})})
        for k in AXES:
            g.create_array(k, data=np.asarray(c[k]), dimension_names=(k,))
        g["twt"].attrs["units"] = "ms"
        for k in ("cdp_x", "cdp_y"):
            if k in c and np.shape(c[k]) == shape[:2]:
                g.create_array(k, data=np.asarray(c[k], dtype=np.float64), dimension_names=("iline", "xline"))
        meta = p / META_GROUP
        for sub in (meta, meta / "done", meta / "locks"):
            sub.mkdir(parents=True, exist_ok=True)
            atomic_write_text(sub / "zarr.json", _group_json({}))
        atomic_write_text(meta / "zarr.json", _group_json({
            "about": "memchunk-prefect bookkeeping: done/<chunk key> marks a written chunk; "
                     "locks/<storage chunk> serialises partial storage-chunk writes"}))
        _ZARR.arrays.clear()
        return cls(p)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ZarrOutput":
        """Open an existing store (to resume writing it, or to check it)."""
        p = Path(path)
        if not (p / "zarr.json").exists() or not (p / DATA_NAME / "zarr.json").exists():
            raise OutputPathError(f"{p.absolute()}: not a store written by ZarrOutput (no {DATA_NAME}/zarr.json)")
        return cls(p)

    # ---- writing

    def _storage_chunks(self, chunk: Chunk) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """Storage-chunk grid indices that ``chunk`` touches, split into (fully covered, partly covered)."""
        ranges = [range(a // z, (b - 1) // z + 1) for a, b, z in zip(chunk.start, chunk.stop, self.zarr_chunks)]
        full: list[tuple[int, int, int]] = []
        partial: list[tuple[int, int, int]] = []
        for ix in ranges[0]:
            for jx in ranges[1]:
                for kx in ranges[2]:
                    cell = (ix, jx, kx)
                    covered = all(a <= c * z and min((c + 1) * z, n) <= b for a, b, c, z, n in
                                  zip(chunk.start, chunk.stop, cell, self.zarr_chunks, self.shape))
                    (full if covered else partial).append(cell)
        return full, partial

    def write(self, chunk: Chunk, data: np.ndarray, *, mark_done: bool = True) -> None:
        """Write ``data`` (of ``chunk.shape``) at ``chunk``'s region, then record the chunk as done.

        Safe from many processes at once for disjoint chunks (see the class docstring).
        The marker is written after the data, atomically: a marker means the data is there.
        With ``mark_done=False`` the caller marks it with :meth:`mark_done` (to attach a record).
        """
        if any(b > n for b, n in zip(chunk.stop, self.shape)):
            raise VolumeError(f"{self.path}: chunk {chunk} reaches past the output of shape {self.shape}")
        data = np.asarray(data)
        if tuple(data.shape) != chunk.shape:
            raise VolumeError(f"{self.path}: data of shape {tuple(data.shape)} does not fit chunk {chunk} "
                              f"of shape {chunk.shape}; an operator must return a block of its input's shape")
        arr = _zarr_array(self.path, self.name, "r+")
        _, partial = self._storage_chunks(chunk)
        with ExitStack() as stack:
            for cell in sorted(partial):
                stack.enter_context(self._lock(cell))
            # One storage chunk at a time: zarr otherwise reads, decompresses, merges and compresses all of them
            # at once (async.concurrency, 10), and how many were alive together moved a chunk's measured peak
            # by tens of MiB from run to run (gaussian_smooth on 72 x 128 x 400: 49-60 MiB; one at a time
            # 33 MiB every time, in the same time: python -m benchmarks.write_memory). The model learns from
            # those peaks. The setting is the process's while it is set: with several threads per worker another
            # thread's write may run at either concurrency (its memory, not its result, differs).
            stack.enter_context(zarr.config.set({"async.concurrency": WRITE_CONCURRENCY}))
            arr[chunk.slices()] = data.astype(self.dtype, copy=False)
        if mark_done:
            self.mark_done(chunk)

    def read_locked(self, chunk: Chunk) -> np.ndarray:
        """Read ``chunk``'s region while other processes write other regions: every storage chunk it touches
        is read under a shared lock (taken in the writers' order), so no partial write is seen half done."""
        full, partial = self._storage_chunks(chunk)
        with ExitStack() as stack:
            for cell in sorted(full + partial):
                stack.enter_context(self._lock(cell, shared=True))
            return _read_region(_zarr_array(self.path, self.name), chunk)

    def _lock(self, cell: tuple[int, int, int], shared: bool = False):
        """An inter-process lock on one storage chunk (fcntl.flock on its lock node's zarr.json): exclusive to
        write part of it, ``shared`` to read it while it may be written."""
        lockdir = Path(self.path) / META_GROUP / "locks" / ".".join(map(str, cell))
        lockfile = lockdir / "zarr.json"
        if not lockfile.exists():
            lockdir.mkdir(parents=True, exist_ok=True)
            try:  # O_EXCL: exactly one process writes the (valid group) content; others just open it
                fd = os.open(lockfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as fh:
                    fh.write(_group_json({}))
            except FileExistsError:
                pass
        return _Flock(lockfile, shared)

    def mark_done(self, chunk: Chunk, record: Mapping[str, Any] | None = None) -> None:
        """Write ``chunk``'s completion marker (atomically), with an optional JSON-able ``record``.

        The runner puts the chunk's measured observation in ``record``, so a run that
        stops before collecting it (Ctrl-C, a cancelled flow, a lost scheduler) loses
        no measurement: the next run reads it back (:meth:`done_records`).
        """
        d = Path(self.path) / META_GROUP / "done" / chunk.key()
        d.mkdir(parents=True, exist_ok=True)
        attrs = {"start": list(chunk.start), "stop": list(chunk.stop), "written_at": time.time(), "pid": os.getpid()}
        if record is not None:
            attrs["record"] = dict(record)
        atomic_write_text(d / "zarr.json", _group_json(attrs))

    def done_records(self, chunks: Iterable[Chunk]) -> list[dict]:
        """The records attached to the completion markers of ``chunks`` (markers without one are skipped)."""
        out = []
        for c in chunks:
            try:
                doc = json.loads((Path(self.path) / META_GROUP / "done" / c.key() / "zarr.json").read_text())
            except (OSError, ValueError):
                continue
            rec = (doc.get("attributes") or {}).get("record")
            if isinstance(rec, dict):
                out.append(rec)
        return out

    # ---- completion

    def is_done(self, chunk: Chunk) -> bool:
        """Whether ``chunk``'s completion marker exists (its data is written)."""
        return (Path(self.path) / META_GROUP / "done" / chunk.key() / "zarr.json").exists()

    def completed_chunks(self) -> list[Chunk]:
        """The chunks whose completion marker exists (sorted)."""
        done = Path(self.path) / META_GROUP / "done"
        if not done.is_dir():
            return []
        out = []
        for e in os.scandir(done):
            c = _parse_key(e.name) if e.is_dir() else None
            if c is not None and (Path(e.path) / "zarr.json").exists():
                out.append(c)
        return sorted(out)

    def missing_elements(self) -> int:
        """How many elements no completed chunk covers (0 when complete). Overlapping markers count once."""
        return _uncovered(self.completed_chunks(), self.shape)

    def is_complete(self) -> bool:
        """True when the completed chunks cover every element of the volume.

        Exact tiling (:func:`~memchunk_prefect.chunks.covers_exactly`) is the common case;
        coverage with overlaps (a resumed run that re-cut the volume differently) also counts,
        since overlapping chunks wrote the same values.
        """
        done = self.completed_chunks()
        return covers_exactly(done, self.shape) or _uncovered(done, self.shape) == 0

    def finalize(self) -> None:
        """Verify every element was written, then mark the store ``complete``; else raise IncompleteOutputError.

        Idempotent: a store already marked complete keeps its ``completed_at`` (part
        of the identity of outputs computed from it, see :meth:`ZarrSource.identity`).
        """
        if zarr.open_group(self.path, mode="r").attrs.get("complete"):
            return
        done = self.completed_chunks()
        if not (covers_exactly(done, self.shape) or _uncovered(done, self.shape) == 0):
            missing = _uncovered(done, self.shape)
            total = self.shape[0] * self.shape[1] * self.shape[2]
            raise IncompleteOutputError(
                f"{self.path}: {missing} of {total} elements ({100 * missing / total:.1f}%) were never written: "
                f"{len(done)} chunks completed, and they do not cover the volume of shape {self.shape}. Run the "
                "map again to fill the missing chunks (completed chunks are kept), or open it with "
                "open_result(path, allow_incomplete=True) to inspect it (missing elements read as NaN)."
            )
        g = zarr.open_group(self.path, mode="r+")
        g.attrs["complete"] = True
        g.attrs["completed_at"] = time.time()

    def to_source(self) -> ZarrSource:
        return ZarrSource(self.path, self.name)


class _Flock:
    """Context manager holding ``fcntl.flock`` (exclusive, or ``shared``) on a file for the duration of the block."""

    def __init__(self, path: Path, shared: bool = False):
        self.path = path
        self.shared = shared
        self.fd: int | None = None

    def __enter__(self) -> "_Flock":
        self.fd = os.open(self.path, os.O_RDONLY if self.shared else os.O_RDWR)
        fcntl.flock(self.fd, fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.fd is not None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        finally:
            os.close(self.fd)
            self.fd = None


def _uncovered(chunks: Iterable[Chunk], shape: Sequence[int]) -> int:
    """Elements of ``shape`` that no chunk covers (exact; overlaps count once)."""
    return sum(b.elements for b in uncovered_boxes(shape, chunks))


def open_result(path: str | os.PathLike, allow_incomplete: bool = False):
    """A ZarrOutput store as a lazy ``xarray.DataArray`` (iline, xline, twt) with the input's coordinates.

    Raises :class:`~memchunk_prefect.errors.IncompleteOutputError` when the store was
    not finalized (not every element written), unless ``allow_incomplete=True``
    (unwritten elements then read as NaN).
    """
    p = os.path.abspath(os.fspath(path))
    out = ZarrOutput.open(p)
    attrs = dict(zarr.open_group(p, mode="r").attrs)
    if not attrs.get("complete") and not allow_incomplete:
        missing = out.missing_elements()
        raise IncompleteOutputError(
            f"{p}: the store is not marked complete ({missing} of {int(np.prod(out.shape))} elements not covered by "
            f"completed chunks{'; it was never finalized' if missing == 0 else ''}). Finish the run (or call "
            "ZarrOutput.open(path).finalize()), or pass allow_incomplete=True to inspect it anyway."
        )
    ds = xr.open_dataset(p, engine="zarr", consolidated=False, chunks=None, mask_and_scale=False)
    da = ds[DATA_NAME]
    for k in ("cdp_x", "cdp_y"):
        if k in ds:
            da = da.assign_coords({k: ds[k]})
    da.attrs.update({k: v for k, v in attrs.items() if k not in da.attrs})
    da.attrs["memchunk_source"] = {"kind": "zarr", "path": p, "name": DATA_NAME}
    return da
