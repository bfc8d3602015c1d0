"""What the runner reads a volume through: the :class:`Source` protocol, in-memory arrays, and the halo rule.

A *source* is a small picklable object the runner ships to Dask workers — a path
and a few numbers, never the samples (except :class:`ArraySource`, which holds an
in-memory array). On the worker, ``source.read(chunk)`` reads exactly one box,
as float32 (iline, xline, twt). :func:`read_block` adds the halo by the package's
one edge rule (:func:`memchunk_prefect.core.chunks.with_halo`: clipped at the volume's
edges) and returns the slices that trim it off the operator's result.

>>> src = ArraySource(np.arange(24, dtype="float32").reshape(2, 3, 4))
>>> src.read(Chunk((1, 0, 0), (2, 3, 2))).tolist()
[[[12.0, 13.0], [16.0, 17.0], [20.0, 21.0]]]

SEG-Y and zarr sources are in :mod:`memchunk_prefect.io.volume` and :mod:`memchunk_prefect.io.zarr_store`;
:func:`~memchunk_prefect.io.volume.as_source` makes a source of anything the runner accepts, and
:func:`~memchunk_prefect.io.volume.read_block` reads a chunk with its halo.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, Sequence

import numpy as np
import xarray as xr

from memchunk_prefect.core.chunks import (
    Chunk,
    check_shape,
)
from memchunk_prefect.core.errors import (
    VolumeError,
)

#: Sample interval given to arrays that carry none (ms), the common seismic default.
DEFAULT_SAMPLE_INTERVAL_MS = 4.0


def _as_f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _default_coords(shape: Sequence[int], sample_interval_ms: float = DEFAULT_SAMPLE_INTERVAL_MS) -> dict:
    ni, nx, nt = shape
    return {"iline": np.arange(ni), "xline": np.arange(nx),
            "twt": np.arange(nt) * float(sample_interval_ms), "sample_interval_ms": float(sample_interval_ms)}


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


