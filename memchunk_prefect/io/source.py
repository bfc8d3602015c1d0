"""What the runner reads a volume through: the :class:`Source` protocol, in-memory arrays, and the halo rule.

A *source* is a small picklable object the runner ships to Dask workers — a path
and a few numbers, never the samples (except :class:`ArraySource`, which holds an
in-memory array). On the worker, ``source.read(chunk)`` reads exactly one box,
as float32, its axes in the order (inline, crossline, vertical).

Two dimension conventions name those axes: segysak's ``iline``/``xline``/``twt`` and MDIO's
``inline``/``crossline``/``time`` (or ``depth``). A source keeps the names its volume uses
(:attr:`Source.dims`), and outputs are written with them; :meth:`Source.coords` keys the axes by
their role (``iline``, ``xline``, ``twt``) whatever they are named.

>>> dims_convention(("inline", "crossline", "depth"))
('inline', 'crossline', 'depth')
>>> dims_convention(("x", "y", "z")) is None
True

:func:`~memchunk_prefect.io.volume.read_block` adds the halo by the package's
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
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from memchunk_prefect.core.chunks import (
    AXES,
    Chunk,
    check_shape,
)
from memchunk_prefect.core.errors import (
    VolumeError,
)

#: Sample interval given to arrays that carry none (ms), the common seismic default.
DEFAULT_SAMPLE_INTERVAL_MS = 4.0

#: The lateral dimension names of the two conventions: segysak's and MDIO's.
LATERAL_DIMS = (("iline", "xline"), ("inline", "crossline"))

#: Names of the vertical (sample) dimension either convention uses: two-way time (ms) or depth.
VERTICAL_DIMS = ("twt", "time", "depth", "samples", "sample")


def is_dataarray(obj: Any) -> bool:
    """Whether ``obj`` is an ``xarray.DataArray``, without importing xarray (~40 MiB and 0.3 s) into a process
    that has none: Dask workers read blocks with no use for it."""
    xr = sys.modules.get("xarray")
    return xr is not None and isinstance(obj, xr.DataArray)


def dims_convention(dims: Sequence[Any]) -> tuple[str, str, str] | None:
    """``dims`` as (inline, crossline, vertical) names when they follow a known convention, else None.

    The order is the one the runner reads in; ``dims`` may hold the names in any order.
    """
    names = [str(d) for d in dims]
    vertical = next((d for d in names if d in VERTICAL_DIMS), None)
    for il, xl in LATERAL_DIMS:
        if il in names and xl in names and vertical is not None and len(names) == 3:
            return (il, xl, vertical)
    return None


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

    @property
    def dims(self) -> tuple[str, str, str]:
        """The names of the volume's (inline, crossline, vertical) axes, as its outputs are written."""
        return AXES

    @abc.abstractmethod
    def coords(self) -> dict[str, Any]:
        """``iline``, ``xline``, ``twt`` (ms) arrays, ``sample_interval_ms``, and ``cdp_x``/``cdp_y`` when known.

        Keyed by the axes' roles whatever :attr:`dims` names them: a depth volume's depths are under ``twt``
        and its depth step under ``sample_interval_ms``, in the volume's depth unit.
        """

    def chunking(self) -> tuple[Chunk, ...] | None:
        """The volume's storage chunks where they are worth keeping as a map's incoming chunking, else None."""
        return None

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


class ArraySource(Source):
    """An array in memory: numpy (axes read as iline, xline, twt) or an ``xarray.DataArray``.

    A DataArray whose dims follow a convention (``iline``/``xline`` or ``inline``/``crossline``, and one
    of ``twt``/``time``/``depth``) is read in (inline, crossline, vertical) order, and its outputs keep
    its names; other 3D DataArrays are taken positionally and named ``iline``/``xline``/``twt``.
    ``coords`` overrides the coordinates (numpy arrays get indices 0..n-1 and
    ``sample_interval_ms``, 4 ms unless given). A lazily-backed DataArray (e.g. a slice of
    :func:`open_segy`) stays lazy: only the box read is loaded.
    """

    kind = "array"

    def __init__(self, array: Any, *, coords: Mapping[str, Any] | None = None,
                 sample_interval_ms: float | None = None):
        self._coords: dict[str, Any]
        if is_dataarray(array):
            if array.ndim != 3:
                raise VolumeError(f"expected a 3D DataArray (iline, xline, twt), got dims {array.dims} "
                                  f"of shape {array.shape}")
            named = dims_convention(array.dims)
            if named is not None:
                array = array.transpose(*named)
            self._dims = named or AXES
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
            self._dims = AXES
            self.array = arr
        if coords:
            self._coords.update(coords)

    def __repr__(self) -> str:
        return f"ArraySource({type(self.array).__name__} of shape {self.shape})"

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(int(s) for s in self.array.shape)  # type: ignore[return-value]

    @property
    def dims(self) -> tuple[str, str, str]:
        return self._dims

    def coords(self) -> dict[str, Any]:
        return {k: (np.array(v) if isinstance(v, np.ndarray) else v) for k, v in self._coords.items()}

    def read(self, chunk: Chunk) -> np.ndarray:
        self._check_chunk(chunk)
        a = self.array
        if hasattr(a, "isel") and hasattr(a, "dims"):
            return _as_f32(a.isel(dict(zip(a.dims, chunk.slices()))).values)
        return _as_f32(a[chunk.slices()])


