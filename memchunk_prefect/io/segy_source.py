"""A post-stack SEG-Y file as a source of blocks: what a Dask worker unpickles to read its chunk.

Kept apart from :mod:`memchunk_prefect.io.volume` (which builds sources from whatever a user passes and opens
lazy ``xarray`` views) so that a worker reading SEG-Y blocks imports segyio and numpy only: xarray and pandas
add ~40 MiB to every worker process, memory its chunks then do not have."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from memchunk_prefect.core.chunks import (
    Chunk,
)
from memchunk_prefect.io import segy as _segy
from memchunk_prefect.io.segy import SegyGeometry
from memchunk_prefect.io.segy_cache import cached_scan
from memchunk_prefect.io.source import Source

SEGY_SUFFIXES = (".sgy", ".segy")


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
        self.geometry = geometry or cached_scan(self.path, iline, xline, endian)
        self.iline = self.geometry.iline_byte
        self.xline = self.geometry.xline_byte
        self.endian = self.geometry.endian
        self._coords: dict | None = None

    def __getstate__(self) -> dict:
        d = self.__dict__.copy()
        d["_coords"] = None  # cdp_x/cdp_y are per trace: never shipped to workers (they read samples only)
        d["geometry"] = dataclasses.replace(self.geometry, cdp=None)
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
            if g.cdp is None:  # unpickled without them (or none recorded): the cache has them, or knows there are none
                g = cached_scan(self.path, self.iline, self.xline, self.endian)
            if g.cdp is not None:
                c["cdp_x"], c["cdp_y"] = g.cdp
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
