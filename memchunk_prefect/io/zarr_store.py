"""Zarr in and out: any 3D zarr array as a source, and the store a chunked map writes region by region.

A :class:`ZarrOutput` is created in the flow process with the input's geometry and coordinates; each chunk's
worker writes its region under a per-storage-chunk lock and leaves an atomic completion marker; the store is
finished (its metadata says complete) only when every element was written. :func:`open_result` opens a
finished store as an ``xarray.DataArray``. :class:`ZarrSource` reads any 3D zarr array, including an output
another map is still writing (under the same locks).
"""

from __future__ import annotations

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
import zarr

from memchunk_prefect.core.chunks import (
    AXES,
    Chunk,
    Shape,
    check_shape,
    covers_exactly,
    uncovered_boxes,
)
from memchunk_prefect.core.errors import (
    ChunkedSourceError,
    IncompleteOutputError,
    OutputPathError,
    VolumeError,
)
from memchunk_prefect.io.files import atomic_write_text
from memchunk_prefect.io.source import Source, _as_f32, _default_coords, dims_convention

#: Target size of one zarr storage chunk when none is given (bytes); 1-4 MiB suits local disks and object stores.
TARGET_STORAGE_CHUNK_BYTES = 2 * 2**20


#: Name of the data array inside a store written by :class:`~memchunk_prefect.io.output.ZarrOutput`.
DATA_NAME = "data"


#: Storage chunks a region write processes at once (zarr's ``async.concurrency`` for the write; see ZarrOutput.write).
WRITE_CONCURRENCY = 1


#: Storage chunks a region read decompresses at once (zarr's ``async.concurrency`` for the read; see _read_region).
READ_CONCURRENCY = 2


#: Bookkeeping group inside a ZarrOutput store (completion markers and write locks).
META_GROUP = ".memchunk"


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
    ~40% slower (``python -m benchmarks.studies.write_memory``, its reads-only rows). As
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
    written = _root_attrs(path).get("memchunk_data")
    if written in names:
        return str(written)
    if DATA_NAME in names:
        return DATA_NAME
    if len(names) == 1:
        return names[0]
    raise ChunkedSourceError(f"{path}: expected one 3D array (or one named {DATA_NAME!r}) in the zarr group, "
                             f"found {names or 'none'}")


def _root_attrs(path: str) -> dict:
    """The root group's attributes (empty for a root array or an unreadable store): read from its zarr.json."""
    try:
        doc = json.loads((Path(path) / "zarr.json").read_text())
    except (OSError, ValueError):
        return {}
    attrs = doc.get("attributes") if doc.get("node_type") == "group" else None
    return dict(attrs) if isinstance(attrs, dict) else {}


def _data_name(attrs: Mapping[str, Any]) -> str:
    """The data array of a store memchunk wrote: ``memchunk_data`` in its root attributes (``data`` by default)."""
    name = attrs.get("memchunk_data")
    return name if isinstance(name, str) and name else DATA_NAME


class ZarrSource(Source):
    """A 3D zarr array on disk: a :class:`ZarrOutput` store (its data array) or any store holding one 3D array.

    Coordinates come from the store's coordinate arrays named after its dims (``iline``/``xline``/``twt``,
    or ``inline``/``crossline``/``time``, and ``cdp_x``/``cdp_y``) when present, else indices and a 4 ms
    interval. Its dims are those its memchunk metadata or its array's ``dimension_names`` give, when they
    follow a convention (:func:`~memchunk_prefect.io.source.dims_convention`), else ``iline``/``xline``/``twt``.
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
        attrs = _root_attrs(self.path) if self.name is not None else {}
        self._dims = dims_convention(attrs.get("dims") or ()) or dims_convention(
            getattr(arr.metadata, "dimension_names", None) or ()) or AXES
        #: A memchunk output's data array: read under its write locks until the store is complete.
        self._memchunk_output = bool(attrs.get("memchunk_store")) and self.name == _data_name(attrs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ZarrSource) and (type(self), self.path, self.name) == (
            type(other), other.path, other.name)

    def __hash__(self) -> int:
        return hash((self.path, self.name))

    @property
    def shape(self) -> tuple[int, int, int]:
        return self._shape

    @property
    def dims(self) -> tuple[str, str, str]:
        return self._dims

    def coords(self) -> dict[str, Any]:
        c = _default_coords(self.shape)
        if self.name is None:
            return c
        g = zarr.open_group(self.path, mode="r")
        attrs = dict(g.attrs)
        if isinstance(attrs.get("sample_interval_ms"), (int, float)):
            c = _default_coords(self.shape, float(attrs["sample_interval_ms"]))  # type: ignore[arg-type]
        members = {n for n, _ in g.arrays()}
        for role, dim in zip(AXES, self.dims):
            if dim in members:
                c[role] = np.asarray(g[dim][...])  # type: ignore[index]  # zarr's Group typing misses array slicing
        if "sample_interval_ms" not in attrs and len(c["twt"]) > 1:
            c["sample_interval_ms"] = float(c["twt"][1] - c["twt"][0])
        for k in ("cdp_x", "cdp_y"):
            if k in members:
                c[k] = np.asarray(g[k][...])  # type: ignore[index]
        return c

    def read(self, chunk: Chunk) -> np.ndarray:
        """The region's values as float32, a few storage chunks decompressed at a time (:func:`_read_region`)."""
        self._check_chunk(chunk)
        if self._memchunk_output and not zarr.open_group(self.path, mode="r").attrs.get("complete"):
            # A memchunk output another map is still writing (chained maps run side by side): the region asked
            # for is written, but a storage chunk it shares with a region being written now is rewritten in
            # place (zarr reads, merges and rewrites it, under that chunk's lock): read it under the same lock.
            return ZarrOutput(self.path, name=self.name).read_locked(chunk)  # type: ignore[arg-type]
        return _read_region(_zarr_array(self.path, self.name), chunk)

    def memchunk_source(self) -> dict:
        return {"kind": self.kind, "path": self.path, "name": self.name}

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


def clear_output_path(path: str | os.PathLike, overwrite: bool) -> Path:
    """The absolute path where a new store may be created: nothing there, or (``overwrite``) a store removed.

    :class:`~memchunk_prefect.core.errors.OutputPathError` for something there without ``overwrite``, and for
    anything there that is not a zarr store (never deleted).
    """
    p = Path(path).absolute()
    if p.exists():
        if not overwrite:
            raise OutputPathError(f"{p}: already exists. Use ZarrOutput.open({str(p)!r}) to resume writing it, "
                                  "pass overwrite=True to replace it, or choose another path.")
        if not (p / "zarr.json").exists() and not (p.is_dir() and not any(p.iterdir())):
            raise OutputPathError(f"{p}: exists and is not a zarr store; refusing to delete it with overwrite=True")
        shutil.rmtree(p)
    return p


def output_coords(shape: Shape, coords: Mapping[str, Any] | None) -> dict[str, Any]:
    """The input's coordinates (keyed by role, see :meth:`Source.coords`) over defaults, checked against
    ``shape``: :class:`~memchunk_prefect.core.errors.VolumeError` for a coordinate of another length."""
    c = dict(_default_coords(shape))
    if coords:
        c.update({k: v for k, v in coords.items() if v is not None})
    for k, n in zip(AXES, shape):
        if len(np.asarray(c[k])) != n:
            raise VolumeError(f"coordinate {k!r} has {len(np.asarray(c[k]))} values for an axis of {n}")
    return c


def output_storage_chunks(shape: Shape, zarr_chunks: Sequence[int] | None, dtype: str) -> Shape:
    """``zarr_chunks`` (default :func:`default_zarr_chunks`), each clipped to the volume."""
    zc = tuple(int(z) for z in (zarr_chunks or default_zarr_chunks(shape, np.dtype(dtype).itemsize)))
    return tuple(min(z, n) for z, n in zip(check_shape(zc), shape))  # type: ignore[return-value]


def memchunk_attrs(shape: Shape, zarr_chunks: Shape, dims: Sequence[str], coords: Mapping[str, Any],
                   attrs: Mapping[str, Any] | None, data_name: str = DATA_NAME, layout: str = "zarr") -> dict[str, Any]:
    """The root attributes that make a store a memchunk output: its layout (``zarr``, or ``mdio`` with
    ``memchunk_data`` naming its data variable), ``complete`` (False until :meth:`ZarrOutput.finalize`), a fresh
    ``write_id``, the input's scalar coordinates and ``attrs`` (JSON-able, else
    :class:`~memchunk_prefect.core.errors.VolumeError`)."""
    try:
        json.dumps(dict(attrs or {}))
    except TypeError as exc:
        raise VolumeError(f"attrs must be JSON-able (plain numbers, strings, lists, dicts): {exc}") from exc
    doc = {"dims": list(dims), "shape": list(shape), "zarr_chunks": list(zarr_chunks), "complete": False,
           "memchunk_store": 1, "write_id": uuid.uuid4().hex, **_json_coords(coords), **dict(attrs or {})}
    if data_name != DATA_NAME:
        doc["memchunk_data"] = data_name
    if layout != "zarr":
        doc["memchunk_layout"] = layout
    return doc


def output_layout(path: str | os.PathLike) -> str:
    """How a memchunk output at ``path`` is laid out: ``zarr`` (:class:`ZarrOutput`'s own) or ``mdio``."""
    layout = _root_attrs(os.fspath(path)).get("memchunk_layout")
    return layout if isinstance(layout, str) else "zarr"


def init_bookkeeping(p: Path) -> None:
    """Create the store's bookkeeping group (completion markers, write locks), as zarr groups."""
    meta = p / META_GROUP
    for sub in (meta, meta / "done", meta / "locks"):
        sub.mkdir(parents=True, exist_ok=True)
        atomic_write_text(sub / "zarr.json", _group_json({}))
    atomic_write_text(meta / "zarr.json", _group_json({
        "about": "memchunk-prefect bookkeeping: done/<chunk key> marks a written chunk; "
                 "locks/<storage chunk> serialises partial storage-chunk writes"}))
    _ZARR.arrays.clear()


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
               zarr_chunks: Sequence[int] | None = None, overwrite: bool = False,
               dims: Sequence[str] = AXES) -> "ZarrOutput":
        """Create an empty store for a volume of ``shape`` with the input's ``coords`` (see :meth:`Source.coords`).

        ``dims``: the names of the (inline, crossline, vertical) axes, the input's (:attr:`Source.dims`); the
        data array and the coordinate arrays are named after them. ``attrs`` must be JSON-able; they go on the
        data array and the root group. An existing store raises
        :class:`~memchunk_prefect.core.errors.OutputPathError` unless ``overwrite=True`` (which deletes it,
        markers included); open an existing store with :meth:`open` to resume it.
        """
        shape = check_shape(shape)
        p = clear_output_path(path, overwrite)
        c = output_coords(shape, coords)
        zc = output_storage_chunks(shape, zarr_chunks, dtype)
        dims = tuple(str(d) for d in dims)
        root_attrs = memchunk_attrs(shape, zc, dims, c, attrs)
        g = zarr.open_group(str(p), mode="w", attributes=root_attrs)
        os.chmod(p, 0o700)  # results are the user's: a user-only root hides everything inside it
        fill = np.nan if np.dtype(dtype).kind == "f" else 0
        a = g.create_array(DATA_NAME, shape=shape, chunks=zc, dtype=dtype, fill_value=fill,
                           dimension_names=dims)
        a.attrs.update({"sample_interval_ms": float(c["sample_interval_ms"]), **dict(attrs or {})})
        for role, dim in zip(AXES, dims):
            g.create_array(dim, data=np.asarray(c[role]), dimension_names=(dim,))
        if dims[2] in ("twt", "time"):
            g[dims[2]].attrs["units"] = "ms"
        for k in ("cdp_x", "cdp_y"):
            if k in c and np.shape(c[k]) == shape[:2]:
                g.create_array(k, data=np.asarray(c[k], dtype=np.float64), dimension_names=dims[:2])
        init_bookkeeping(p)
        return cls(p)

    @classmethod
    def open(cls, path: str | os.PathLike) -> "ZarrOutput":
        """Open an existing store (to resume writing it, or to check it): a zarr or an MDIO output of memchunk."""
        p = Path(path)
        name = _data_name(_root_attrs(str(p)))
        if not (p / "zarr.json").exists() or not (p / name / "zarr.json").exists():
            raise OutputPathError(f"{p.absolute()}: not a store written by ZarrOutput (no {name}/zarr.json)")
        return cls(p, name=name)

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
            # 33 MiB every time, in the same time: python -m benchmarks.studies.write_memory). The model learns from
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

        Exact tiling (:func:`~memchunk_prefect.core.chunks.covers_exactly`) is the common case;
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
    """A memchunk output as a lazy ``xarray.DataArray`` with the input's coordinates.

    Its dims are the store's: the input's names for a zarr output (``iline``/``xline``/``twt`` or
    ``inline``/``crossline``/``time``), MDIO's for an MDIO output (whose variable is ``amplitude``).

    Raises :class:`~memchunk_prefect.core.errors.IncompleteOutputError` when the store was
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
    import xarray as xr  # the flow's side only: workers write regions with zarr and never need it

    ds = xr.open_dataset(p, engine="zarr", consolidated=False, chunks=None, mask_and_scale=False)
    da = ds[out.name]
    for k in ("cdp_x", "cdp_y"):
        if k in ds and k not in da.coords:
            da = da.assign_coords({k: ds[k]})
    da.attrs.update({k: v for k, v in attrs.items() if k not in da.attrs})
    da.attrs["memchunk_source"] = {"kind": output_layout(p), "path": p, "name": out.name}
    return da
