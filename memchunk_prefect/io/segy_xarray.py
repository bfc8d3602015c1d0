"""A SEG-Y file as a lazy ``xarray.DataArray`` (:func:`open_segy`): headers read at once, samples on demand.

Its own module because it needs xarray (and pandas): the modules a Dask worker imports to read and write chunks
do not, and a worker that never imports them keeps ~40 MiB more for its chunks."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr
from xarray.backends import BackendArray
from xarray.core import indexing

from memchunk_prefect.core.chunks import (
    AXES,
)
from memchunk_prefect.io import segy as _segy
from memchunk_prefect.io.segy_source import SegySource


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

    Bad files raise a typed :class:`~memchunk_prefect.core.errors.SegyError` naming the file.
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
