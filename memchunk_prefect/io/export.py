"""Export a volume (a result, a zarr store, an array) as SEG-Y with a template file's geometry and headers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.errors import (
    SegyGeometryError,
)
from memchunk_prefect.io.files import atomic_path
from memchunk_prefect.io.segy import CROSSLINE_BYTE, INLINE_BYTE, READ_BATCH_BYTES, _segyio, scan
from memchunk_prefect.io.volume import as_source


def to_segy(data_or_path: Any, out_path: str | os.PathLike, template_segy: str | os.PathLike, *,
            iline: int = INLINE_BYTE, xline: int = CROSSLINE_BYTE) -> Path:
    """Write a volume as SEG-Y with the template file's geometry, textual, binary and trace headers.

    ``data_or_path`` is anything :func:`as_source` accepts (a result DataArray, a zarr
    store path, a numpy array in (iline, xline, twt) order). Samples are written as
    IEEE float (format 5) in the template's byte order and trace order; every other
    header field is copied. The shape (and, where the data carries real header
    numbers, the inline/crossline numbers) must match the template, else
    :class:`~memchunk_prefect.core.errors.SegyGeometryError`. Written under a temporary
    name and renamed when complete. Reads one inline (or crossline) batch at a time.
    """
    segyio = _segyio()
    src = as_source(data_or_path)
    template = os.path.abspath(os.fspath(template_segy))
    g = scan(template, iline, xline)
    if src.shape != g.shape:
        raise SegyGeometryError(template, f"cannot export data of shape {src.shape} with this template of shape "
                                f"{g.shape} (iline, xline, twt); the data must come from this survey")
    c = src.coords()
    for k, ref in (("iline", g.ilines), ("xline", g.xlines)):
        v = np.asarray(c[k])
        if not np.array_equal(v, np.arange(len(v))) and not np.array_equal(v, ref):
            raise SegyGeometryError(template, f"the data's {k} numbers {v[:3].tolist()}... differ from the "
                                    f"template's {ref[:3].tolist()}...; export with the survey the data came from")
    out = Path(out_path).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    ni, nx, nt = g.shape
    with atomic_path(out) as tmp:
        with segyio.open(template, "r", ignore_geometry=True, endian=g.endian) as s:
            spec = segyio.spec()
            spec.format = 5
            spec.endian = g.endian
            spec.samples = s.samples
            spec.tracecount = s.tracecount
            spec.ext_headers = s.ext_headers
            with segyio.create(str(tmp), spec) as d:
                d.text[0] = s.text[0]
                for n in range(1, 1 + s.ext_headers):
                    d.text[n] = s.text[n]
                d.bin = s.bin
                d.bin.update({segyio.BinField.Format: 5})
                # Along the template's sort order, one line at a time: contiguous trace runs.
                outer = 1 if g.sorting == "xline" else 0
                batch = max(1, int(READ_BATCH_BYTES // max(1, (nx if outer == 0 else ni) * nt * 4)))  # float32 samples
                n_outer = g.shape[outer]
                for a in range(0, n_outer, batch):
                    b = min(n_outer, a + batch)
                    box = Chunk((a, 0, 0), (b, nx, nt)) if outer == 0 else Chunk((0, a, 0), (ni, b, nt))
                    block = src.read(box)
                    ii = np.arange(box.start[0], box.stop[0])
                    jj = np.arange(box.start[1], box.stop[1])
                    tr = g.trace_index(ii, jj).ravel()
                    flat = block.reshape(-1, nt)
                    if np.array_equal(tr, np.arange(tr[0], tr[0] + len(tr))):  # sorted: one contiguous run
                        t0, t1 = int(tr[0]), int(tr[0]) + len(tr)
                        d.header[t0:t1] = s.header[t0:t1]
                        d.trace[t0:t1] = flat
                    else:
                        for row, t in enumerate(tr.tolist()):
                            d.header[t] = s.header[t]
                            d.trace[t] = flat[row]
    return out
