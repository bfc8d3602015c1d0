"""Volumes in: anything the runner accepts as a source of blocks, and a SEG-Y file as a lazy DataArray.

A *source* is a small picklable object the runner ships to Dask workers — a path
and a few numbers, never the samples (except :class:`ArraySource`, which holds an
in-memory array). On the worker, ``source.read(chunk)`` reads exactly one box,
as float32 (iline, xline, twt). :func:`read_block` adds the halo by the package's
one edge rule (:func:`memchunk_prefect.core.chunks.with_halo`: clipped at the volume's
edges) and returns the slices that trim it off the operator's result.

>>> src = as_source(np.arange(24, dtype="float32").reshape(2, 3, 4))
>>> block, trim = read_block(src, Chunk((1, 0, 0), (2, 3, 4)), halo=(1, 0, 0))
>>> block.shape, block[trim].shape
((2, 3, 4), (1, 3, 4))

Results are written by :class:`~memchunk_prefect.io.zarr_store.ZarrOutput` and exported as SEG-Y by
:func:`~memchunk_prefect.io.export.to_segy`.

NaN and Inf samples are read and written as they are: nothing here replaces or
checks them (operators document what they produce from them).

Byte-level SEG-Y work (headers, geometry) is in :mod:`memchunk_prefect.io.segy`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from memchunk_prefect.core.chunks import (
    AXES,
    Chunk,
    check_halo,
    normalize_halo,
    with_halo,
)
from memchunk_prefect.core.errors import (
    ChunkedSourceError,
    MdioError,
)
from memchunk_prefect.io import segy as _segy
from memchunk_prefect.io.mdio import MDIO_VARIABLE, MdioSource, is_mdio_store
from memchunk_prefect.io.segy_source import SEGY_SUFFIXES, SegySource
from memchunk_prefect.io.source import ArraySource, Source
from memchunk_prefect.io.zarr_store import DATA_NAME, ZarrSource

__all__ = ["SegySource", "MdioSource", "as_source", "read_block"]


def __getattr__(name: str) -> Any:
    """``open_segy`` from :mod:`memchunk_prefect.io.segy_xarray`, imported on first use (it loads xarray)."""
    if name == "open_segy":
        from memchunk_prefect.io.segy_xarray import open_segy

        return open_segy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: The suffix MDIO datasets are given (``survey.mdio``); any MDIO v1 directory is recognised by its metadata too.
MDIO_SUFFIX = ".mdio"


# --------------------------------------------------------------------------- sources


def _still_backed_by_file(da: Any) -> bool:
    """True when ``da``'s data is still the untouched lazy file array (no arithmetic, no load, no selection).

    xarray (2026.x) keeps attrs through arithmetic (``result * 2`` keeps ``memchunk_source``)
    and through ``isel``, so the attribute alone would point changed data back at the file.
    Walk xarray's wrapper chain instead: every lazy indexer must select everything and
    the innermost array must be a backend array (SEG-Y or zarr), not numpy.
    """
    from xarray.backends import BackendArray  # given a DataArray, xarray is loaded

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
        elif desc.get("kind") == "mdio":
            src = MdioSource(desc["path"], desc.get("name"))
        else:
            return None
    except Exception:
        return None  # the file moved or changed: fall back to the array itself
    return src if _describes(da, src) else None


#: Dask layers xarray gives a variable it opened lazily with ``chunks=`` (``mdio.open_mdio(path, chunks={})``).
_OPENED_LAYERS = ("original-open_dataset-", "open_dataset-")


def _describes(da: Any, src: Source) -> bool:
    """Whether ``da`` is still ``src``'s whole volume, untouched: same dims, shape and coordinates, and its data
    still the lazy file array (:func:`_still_backed_by_file`), or xarray's dask array over it as opened."""
    data = da.variable._data
    opened = hasattr(data, "dask") and all(str(k).startswith(_OPENED_LAYERS) for k in data.dask.layers)
    if tuple(da.shape) != src.shape or tuple(da.dims) != src.dims or not (opened or _still_backed_by_file(da)):
        return False
    c = src.coords()
    return all(np.array_equal(np.asarray(da.coords[dim].values), c[role])
               for role, dim in zip(AXES, src.dims) if dim in da.coords)


def _dataset_source(ds: Any) -> Source:
    """An ``xarray.Dataset`` (an MDIO dataset, e.g. from ``mdio.open_mdio``) as a source of its data variable.

    The variable is the one its ``attributes.defaultVariableName`` names (``amplitude`` for MDIO). Opened from
    an MDIO store and untouched, the store itself is the source (workers read it; its storage chunking and
    identity hold); anything else is read from the Dataset as an array (:class:`ArraySource`).
    """
    meta = ds.attrs.get("attributes")
    name = str(meta.get("defaultVariableName") or MDIO_VARIABLE) if isinstance(meta, Mapping) else MDIO_VARIABLE
    if name not in ds.data_vars:
        have = sorted(map(str, ds.data_vars))
        raise MdioError(f"the Dataset has no data variable {name!r} (its data variables: {have}); pass the volume "
                        "itself, e.g. chunked(ds['<name>']), or an MDIO dataset's path")
    da = ds[name]
    path = ds.encoding.get("source")
    if isinstance(path, str) and is_mdio_store(path):
        try:
            src = MdioSource(path, name)
        except MdioError:
            return ArraySource(da)  # not a post-stack volume as stored: ArraySource says what is wrong with it
        if _describes(da, src):
            return src
    return ArraySource(da)


def as_source(obj: Any, **kw: Any) -> Source:
    """Turn what a user passes to ``chunked(...)`` into a :class:`Source`.

    - a :class:`Source` → itself;
    - a ``str``/``Path`` ending ``.sgy``/``.segy`` → :class:`SegySource` (``iline=``, ``xline=`` pass through);
    - an MDIO v1 dataset's directory (or a path ending ``.mdio``) → :class:`~memchunk_prefect.io.mdio.MdioSource`
      (``variable=`` passes through);
    - a zarr directory (or a path ending ``.zarr``) → :class:`ZarrSource`;
    - an ``xarray.DataArray`` from :func:`open_segy` / :func:`open_result`, unmodified → the file it
      names (so workers read the file); any other DataArray or a numpy array → :class:`ArraySource`;
    - an ``xarray.Dataset`` (``mdio.open_mdio(path)``) → its ``amplitude`` variable: the store it was opened
      from while untouched, else that variable as an array.

    Anything else raises :class:`~memchunk_prefect.core.errors.ChunkedSourceError`.
    """
    if isinstance(obj, Source):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        p = Path(obj)
        if p.suffix.lower() in SEGY_SUFFIXES:
            return SegySource(p, **kw)
        if p.suffix.lower() == MDIO_SUFFIX or is_mdio_store(p):
            return MdioSource(p, **kw)
        if p.is_dir() and any((p / m).exists() for m in ("zarr.json", ".zarray", ".zgroup")):
            return ZarrSource(p, **kw)
        if p.suffix.lower() == ".zarr":
            return ZarrSource(p, **kw)
        raise ChunkedSourceError(
            f"cannot tell what volume the path {os.fspath(obj)!r} holds: expected a SEG-Y file ending "
            f"{' or '.join(SEGY_SUFFIXES)}, an MDIO dataset or a zarr store directory"
            + ("" if p.exists() else " (and it does not exist)")
        )

    xr = sys.modules.get("xarray")  # an xarray object means xarray is loaded; a worker never loads it for a path
    if xr is not None and isinstance(obj, xr.DataArray):
        mapped = None if kw else _source_from_attrs(obj)
        return mapped if mapped is not None else ArraySource(obj, **kw)
    if xr is not None and isinstance(obj, xr.Dataset) and not kw:
        return _dataset_source(obj)
    if isinstance(obj, np.ndarray):
        return ArraySource(obj, **kw)
    raise ChunkedSourceError(
        f"cannot read a volume from a {type(obj).__module__}.{type(obj).__qualname__}: expected a SEG-Y path "
        "(.sgy/.segy), an MDIO or zarr store path, an xarray.DataArray or MDIO xarray.Dataset, a numpy array "
        "(iline, xline, twt), or a memchunk_prefect.io.volume source (SegySource, MdioSource, ZarrSource, "
        "ArraySource)"
    )


# --------------------------------------------------------------------------- open_segy (lazy xarray)


# --------------------------------------------------------------------------- zarr output


def read_block(source: Any, chunk: Chunk, halo: int | Sequence[int] | None = None) -> tuple[np.ndarray, tuple]:
    """Read ``chunk`` plus its halo (clipped at the volume's edges) and the slices that trim the halo off.

    ``block[trim]`` (and the operator's result ``[trim]``) has ``chunk.shape``. A halo
    larger than the volume raises :class:`~memchunk_prefect.core.errors.HaloTooLargeError`.
    """
    src = as_source(source)
    check_halo(normalize_halo(halo), src.shape)
    read, trim = with_halo(chunk, halo, src.shape)
    return src.read(read), trim
