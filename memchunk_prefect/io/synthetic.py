"""Synthetic post-stack surveys: dipping, folded, faulted reflectors convolved with a Ricker wavelet, plus noise.

:func:`synthetic_volume` builds one in memory; :func:`synthetic_survey` writes it as a real SEG-Y file, one
inline at a time, so surveys larger than memory can be made. The same seed gives the same survey.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from memchunk_prefect.core.chunks import check_shape
from memchunk_prefect.io.files import atomic_path
from memchunk_prefect.io.segy import CROSSLINE_BYTE, INLINE_BYTE, _segyio


def ricker(t_s: np.ndarray, peak_hz: float) -> np.ndarray:
    """Ricker (Mexican-hat) wavelet at times ``t_s`` (seconds), peak frequency ``peak_hz`` (Hz), 1 at t=0."""
    a = (np.pi * peak_hz * t_s) ** 2
    return (1.0 - 2.0 * a) * np.exp(-a)


@dataclass(frozen=True)
class _Model:
    """Geological model of a synthetic survey: layers, structure and a fault, drawn once from the seed."""

    t0: np.ndarray          # layer times at the survey's centre, in samples
    refl: np.ndarray        # reflection coefficient of each layer
    lateral: np.ndarray     # (layers, 2) lateral amplitude modulation phases
    dip_i: float            # samples per inline
    dip_x: float            # samples per crossline
    fold_amp: float         # samples
    fold_wl: tuple[float, float]  # wavelengths in traces along iline, xline
    fold_phase: tuple[float, float]
    fault_angle: float      # radians, strike of the fault trace in the (iline, xline) map
    fault_offset: float     # traces from the centre
    fault_slope: float      # traces the fault moves per sample deeper (a dipping fault plane)
    throw: float            # samples the hanging wall is moved down
    noise: float            # noise standard deviation relative to the mean trace amplitude


def _model(shape: tuple[int, int, int], seed: int) -> _Model:
    ni, nx, nt = shape
    rng = np.random.default_rng([seed, 0x5E15])
    n_layers = max(6, nt // 8)
    # Layers spread a little beyond the trace so dipping events enter and leave the window.
    t0 = np.sort(rng.uniform(-0.15 * nt, 1.15 * nt, n_layers))
    refl = rng.choice([-1.0, 1.0], n_layers) * rng.uniform(0.15, 1.0, n_layers)
    span = max(ni, nx, 2)
    return _Model(
        t0=t0, refl=refl, lateral=rng.uniform(0, 2 * np.pi, (n_layers, 2)),
        dip_i=rng.uniform(0.08, 0.25) * min(1.0, 128 / span) * nt / 400 * 2,
        dip_x=rng.uniform(-0.15, -0.05) * min(1.0, 128 / span) * nt / 400 * 2,
        fold_amp=rng.uniform(0.03, 0.06) * nt,
        fold_wl=(rng.uniform(0.6, 1.2) * max(ni, 2), rng.uniform(0.6, 1.2) * max(nx, 2)),
        fold_phase=(rng.uniform(0, 2 * np.pi), rng.uniform(0, 2 * np.pi)),
        fault_angle=rng.uniform(0.2, 1.2), fault_offset=rng.uniform(-0.15, 0.15) * span,
        fault_slope=rng.uniform(0.1, 0.3) * span / max(nt, 1),
        throw=rng.uniform(0.02, 0.04) * nt + 2.0, noise=0.03,
    )


def _synthetic_inline(model: _Model, i: int, shape: tuple[int, int, int], seed: int,
                      dt_ms: float, peak_hz: float) -> np.ndarray:
    """One inline (xline, twt) of the synthetic volume, float32. Depends only on (seed, shape, i)."""
    ni, nx, nt = shape
    j = np.arange(nx, dtype=np.float64)
    ci, cx = (ni - 1) / 2, (nx - 1) / 2
    # depth factor: deeper layers are more folded and dip more (growth), in 0.5 .. 1.5
    depth = 0.5 + np.clip(model.t0 / max(nt, 1), 0, 1)
    fold = (np.sin(2 * np.pi * (i - ci) / model.fold_wl[0] + model.fold_phase[0])
            * np.cos(2 * np.pi * (j - cx) / model.fold_wl[1] + model.fold_phase[1]))
    T = (model.t0[None, :]
         + depth[None, :] * (model.dip_i * (i - ci) + model.dip_x * (j - cx))[:, None]
         + (model.fold_amp * depth)[None, :] * fold[:, None])          # (nx, layers) in samples
    # Fault: a plane whose map trace moves with time (it dips); the hanging wall side is thrown down.
    ca, sa = np.cos(model.fault_angle), np.sin(model.fault_angle)
    dist = (i - ci) * ca + (j - cx) * sa - model.fault_offset            # traces from the fault at t=0
    hanging = dist[:, None] > model.fault_slope * T
    T = T + model.throw * hanging
    amp = model.refl[None, :] * (1.0 + 0.2 * np.sin(2 * np.pi * i / max(ni, 8) + model.lateral[None, :, 0])
                                 * np.cos(2 * np.pi * j[:, None] / max(nx, 8) + model.lateral[None, :, 1]))
    # Convolve the spikes with the Ricker wavelet analytically (sub-sample exact): each layer adds the
    # wavelet over +-K samples around its time; np.bincount sums the contributions.
    dt_s = dt_ms / 1000.0
    K = int(np.ceil(1.5 / (peak_hz * dt_s))) + 1
    k = np.arange(-K, K + 1)
    base = np.floor(T).astype(np.int64)
    idx = base[:, :, None] + k                                          # (nx, layers, 2K+1)
    w = amp[:, :, None] * ricker((idx - T[:, :, None]) * dt_s, peak_hz)
    ok = (idx >= 0) & (idx < nt)
    flat = (np.arange(nx)[:, None, None] * nt + idx)[ok]
    out = np.bincount(flat, weights=w[ok], minlength=nx * nt).reshape(nx, nt).astype(np.float64)
    noise_rng = np.random.default_rng([seed, 0xA015E, i])
    out += model.noise * noise_rng.standard_normal((nx, nt))
    return out.astype(np.float32)


def synthetic_volume(shape: Sequence[int], seed: int = 0, *, sample_interval_ms: float = 4.0,
                     peak_hz: float = 25.0) -> np.ndarray:
    """A synthetic post-stack volume in memory, float32 (iline, xline, twt).

    The same values :func:`synthetic_survey` writes.

    Folded and dipping reflectors of varied reflectivity (a few tenths to 1), cut by
    a dipping normal fault, convolved with a ``peak_hz`` Ricker wavelet along time,
    plus white noise (3% of the reflectivity scale). Deterministic in ``(shape, seed)``;
    each inline depends only on its index, so it can be generated one inline at a time.

    >>> v = synthetic_volume((4, 5, 60), seed=1)
    >>> v.shape, v.dtype, bool(v.std(axis=-1).min() > 0)
    ((4, 5, 60), dtype('float32'), True)
    """
    s = check_shape(shape)
    model = _model(s, seed)
    return np.stack([_synthetic_inline(model, i, s, seed, sample_interval_ms, peak_hz) for i in range(s[0])])


def synthetic_survey(path: str | os.PathLike, shape: Sequence[int], seed: int = 0, *,
                     sample_interval_ms: float = 4.0, first_iline: int = 100, first_xline: int = 300,
                     peak_hz: float = 25.0, origin_xy: tuple[float, float] = (620000.0, 6080000.0),
                     bin_size_m: tuple[float, float] = (25.0, 12.5), azimuth_deg: float = 30.0,
                     sorting: str = "iline", endian: str = "big", line_step: tuple[int, int] = (1, 1),
                     sample_format: int = 5) -> Path:
    """Write :func:`synthetic_volume` as a real SEG-Y file and return its path.

    Layout: IEEE float samples (``sample_format`` 5; 1 writes IBM floats, as many surveys in the field are),
    ``endian`` byte order, inline numbers at trace-header byte 189 and crossline numbers at 193 (starting at
    ``first_iline`` / ``first_xline``, ``line_step`` apart: (2, 4) numbers inlines 100, 102, ... and crosslines
    300, 304, ...), CDP_X/CDP_Y at 181/185 in centimetres (coordinate scalar -100 at
    byte 71) on a grid rotated by ``azimuth_deg`` with ``bin_size_m`` (inline, crossline
    spacing in metres) from ``origin_xy``; sample interval (µs) in the binary and every
    trace header. ``sorting="iline"`` (default) or ``"xline"`` chooses the trace order.

    Generated and written one inline at a time, so memory stays at one inline of
    data whatever the survey's size (crossline sorting writes that inline's traces
    at strided trace indices). The file is written under a
    temporary name and renamed when complete: a failed write leaves nothing at ``path``.
    """
    segyio = _segyio()
    s = check_shape(shape)
    if sorting not in ("iline", "xline"):
        raise ValueError(f"sorting must be 'iline' or 'xline', got {sorting!r}")
    ni, nx, nt = s
    if sample_format not in (1, 5):
        raise ValueError(f"sample_format must be 1 (IBM float) or 5 (IEEE float), got {sample_format!r}")
    il_step, xl_step = (int(v) for v in line_step)
    if il_step < 1 or xl_step < 1:
        raise ValueError(f"line_step must be two positive line-number steps, got {line_step!r}")
    dt_us = int(round(sample_interval_ms * 1000))
    if not 0 < dt_us < 2**16:
        raise ValueError(f"sample_interval_ms must be in (0, 65.5] ms to fit SEG-Y's 16-bit µs field, "
                         f"got {sample_interval_ms}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    model = _model(s, seed)
    spec = segyio.spec()
    spec.iline, spec.xline = INLINE_BYTE, CROSSLINE_BYTE
    spec.format = sample_format
    spec.endian = endian
    spec.samples = np.arange(nt) * sample_interval_ms
    spec.ilines = first_iline + il_step * np.arange(ni)
    spec.xlines = first_xline + xl_step * np.arange(nx)
    spec.offsets = [1]
    spec.sorting = segyio.TraceSortingFormat.INLINE_SORTING if sorting == "iline" else \
        segyio.TraceSortingFormat.CROSSLINE_SORTING
    with atomic_path(path) as tmp:
        with segyio.create(str(tmp), spec) as f:
            f.text[0] = segyio.tools.create_text_header({
                1: "MEMCHUNK-PREFECT SYNTHETIC POST-STACK SURVEY",
                2: f"SHAPE {ni} INLINES X {nx} CROSSLINES X {nt} SAMPLES, SEED {seed}",
                3: f"SAMPLE INTERVAL {sample_interval_ms} MS, RICKER {peak_hz} HZ, "
                   + ("IEEE FLOAT (FORMAT 5)" if sample_format == 5 else "IBM FLOAT (FORMAT 1)"),
                4: f"INLINE BYTE {INLINE_BYTE}, CROSSLINE BYTE {CROSSLINE_BYTE}, CDP X/Y 181/185 SCALAR -100",
                5: f"TRACES SORTED BY {sorting.upper()}",
            })
            f.bin.update({segyio.BinField.Interval: dt_us, segyio.BinField.Samples: nt,
                          segyio.BinField.Format: sample_format, segyio.BinField.SortingCode: int(spec.sorting),
                          segyio.BinField.MeasurementSystem: 1})
            grid = _Grid(s, sorting, first_iline, first_xline, il_step, xl_step, dt_us, origin_xy, bin_size_m,
                         np.deg2rad(azimuth_deg))
            for i in range(ni):
                data = _synthetic_inline(model, i, s, seed, sample_interval_ms, peak_hz)
                tr, headers = grid.inline_headers(i)
                if sorting == "iline":
                    a = i * nx
                    f.header[a:a + nx] = headers
                    f.trace[a:a + nx] = data
                else:
                    for jj, t in enumerate(tr.tolist()):
                        f.header[t] = headers[jj]
                        f.trace[t] = data[jj]
    return path


@dataclass(frozen=True)
class _Grid:
    """Where each trace of a synthetic survey goes in the file, and its trace header fields."""

    shape: tuple[int, int, int]
    sorting: str
    first_iline: int
    first_xline: int
    il_step: int
    xl_step: int
    dt_us: int
    origin_xy: tuple[float, float]
    bin_size_m: tuple[float, float]
    azimuth: float  # radians

    def inline_headers(self, i: int) -> tuple[np.ndarray, list[dict]]:
        """Inline ``i``'s trace indices in the file and their headers (line numbers, CDP X/Y in centimetres)."""
        segyio = _segyio()
        ni, nx, nt = self.shape
        j = np.arange(nx)
        az, (bi, bx) = self.azimuth, self.bin_size_m
        x = self.origin_xy[0] + i * bi * np.cos(az) - j * bx * np.sin(az)
        y = self.origin_xy[1] + i * bi * np.sin(az) + j * bx * np.cos(az)
        tr = (i * nx + j) if self.sorting == "iline" else (j * ni + i)
        TF = segyio.TraceField
        headers = [{
            TF.TRACE_SEQUENCE_FILE: int(t) + 1, TF.CDP: int(t) + 1,
            TF.INLINE_3D: self.first_iline + self.il_step * i, TF.CROSSLINE_3D: self.first_xline + self.xl_step * jj,
            TF.CDP_X: int(round(x[jj] * 100)), TF.CDP_Y: int(round(y[jj] * 100)),
            TF.SourceGroupScalar: -100, TF.offset: 1,
            TF.TRACE_SAMPLE_COUNT: nt, TF.TRACE_SAMPLE_INTERVAL: self.dt_us,
        } for jj, t in enumerate(tr.tolist())]
        return tr, headers
