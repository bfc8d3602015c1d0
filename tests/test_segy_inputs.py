"""Real SEG-Y files made by others (segyio's test data): formats, byte orders, coordinates, and every bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import segyio

import memchunk_prefect.io.segy as segy_mod
from memchunk_prefect.core.chunks import Chunk
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
from memchunk_prefect.io.segy_source import SegySource
from memchunk_prefect.io.segy_xarray import open_segy
from memchunk_prefect.io.synthetic import synthetic_survey

F3_ILINES = np.arange(111, 134)
F3_XLINES = np.arange(875, 893)
F3_TWT = np.arange(1, 76) * 4.0


def _raw(path, endian="big"):
    """What segyio itself reads, trace by trace, as float32 (the oracle for values)."""
    with segyio.open(str(path), ignore_geometry=True, endian=endian) as f:
        return f.trace.raw[:].astype(np.float32)


# --------------------------------------------------------------------------- formats and byte orders


@pytest.mark.parametrize("name, format_code, endian", [
    ("f3.sgy", 3, "big"),
    ("f3-lsb.sgy", 3, "little"),
    ("Format1msb.sgy", 1, "big"),
    ("Format5lsb.sgy", 5, "little"),
    ("Format8msb.sgy", 8, "big"),
])
def test_every_sample_format_opens_as_float32_with_f3_coordinates(segy_dir, name, format_code, endian):
    da = open_segy(segy_dir / name)
    assert da.dims == ("iline", "xline", "twt")
    assert da.dtype == np.float32 and da.values.dtype == np.float32
    np.testing.assert_array_equal(da.iline.values, F3_ILINES)
    np.testing.assert_array_equal(da.xline.values, F3_XLINES)
    np.testing.assert_allclose(da.twt.values, F3_TWT)
    assert da.attrs["sample_interval_ms"] == 4.0
    assert da.attrs["format_code"] == format_code and da.attrs["endian"] == endian
    # values are exactly segyio's samples, placed inline-major (the file is inline-sorted)
    np.testing.assert_array_equal(da.values.reshape(-1, 75), _raw(segy_dir / name, endian))


def test_big_and_little_endian_f3_give_identical_values(segy_dir):
    np.testing.assert_array_equal(open_segy(segy_dir / "f3.sgy").values, open_segy(segy_dir / "f3-lsb.sgy").values)
    np.testing.assert_array_equal(open_segy(segy_dir / "small.sgy").values,
                                  open_segy(segy_dir / "small-lsb.sgy").values)


@pytest.mark.parametrize("name", ["f3.sgy", "Format1msb.sgy"])
def test_integer_and_ibm_formats_equal_the_ieee_copy(segy_dir, name):
    """f3 (int16) and the IBM copy hold the same numbers as the IEEE copy; they are not all zero."""
    ieee = open_segy(segy_dir / "Format5lsb.sgy").values
    other = open_segy(segy_dir / name).values
    assert np.abs(ieee).max() > 1000 and np.count_nonzero(ieee) > ieee.size // 2
    np.testing.assert_allclose(other, ieee, rtol=1e-6, atol=0)


def test_cdp_coordinates_come_from_headers_with_the_scalar_applied(segy_dir):
    da = open_segy(segy_dir / "f3.sgy")
    # first trace: CDP_X 6201972, CDP_Y 60742329, scalar -10 at byte 71 -> divide by 10
    assert da.cdp_x.dims == ("iline", "xline")
    assert da.cdp_x.values[0, 0] == pytest.approx(620197.2)
    assert da.cdp_y.values[0, 0] == pytest.approx(6074232.9)
    assert len(np.unique(da.cdp_x.values)) > 100  # one per trace, not a constant


@pytest.mark.parametrize("name, shape, interval_ms, ilines, xlines", [
    ("small.sgy", (5, 5, 50), 4.0, [1, 2, 3, 4, 5], [20, 21, 22, 23, 24]),
    ("tiny.sgy", (3, 2, 4), 1.0, [1, 2, 3], [20, 21]),
])
def test_small_files_have_their_documented_geometry(segy_dir, name, shape, interval_ms, ilines, xlines):
    da = open_segy(segy_dir / name)
    assert da.shape == shape
    assert da.attrs["sample_interval_ms"] == interval_ms
    assert da.iline.values.tolist() == ilines and da.xline.values.tolist() == xlines


def test_sources_read_real_files_box_by_box(segy_dir):
    src = SegySource(segy_dir / "f3.sgy")
    whole = open_segy(segy_dir / "f3.sgy").values
    box = Chunk((3, 5, 10), (9, 17, 40))
    np.testing.assert_array_equal(src.read(box), whole[box.slices()])


# --------------------------------------------------------------------------- bad input


def _gridded_file_with_a_missing_trace(path):
    """A 3 x 3 grid written with segyio with the (inline 2, crossline 11) trace left out: 8 traces."""
    spec = segyio.spec()
    spec.format, spec.samples, spec.tracecount = 5, np.arange(10) * 4.0, 8
    pairs = [(i, x) for i in (1, 2, 3) for x in (10, 11, 12) if (i, x) != (2, 11)]
    with segyio.create(str(path), spec) as f:
        for k, (i, x) in enumerate(pairs):
            f.header[k] = {segyio.TraceField.INLINE_3D: i, segyio.TraceField.CROSSLINE_3D: x}
            f.trace[k] = np.full(10, k, dtype=np.float32)
    return path


def _headers_inconsistent_halfway(path):
    """A 40 x 50 survey whose inline numbers go wrong for 3 traces halfway through the file (a bad merge)."""
    from memchunk_prefect import synthetic_survey

    synthetic_survey(path, (40, 50, 20), seed=2)
    with segyio.open(str(path), "r+", ignore_geometry=True) as f:
        for k in range(1000, 1003):
            f.header[k] = {segyio.TraceField.INLINE_3D: 9999}
    return path


def _readme_renamed(path):
    """A text file given a SEG-Y name (the repository's README, 79 KB when this case was found)."""
    path = path.with_name("README.sgy")
    path.write_bytes((Path(__file__).resolve().parents[1] / "README.md").read_bytes() * 20)
    return path


def _png_renamed(path):
    path = path.with_name("picture.sgy")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40)
    return path


def _zip_renamed(path):
    import zipfile

    path = path.with_name("archive.sgy")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("survey.sgy", bytes(range(256)) * 40)
    return path


def _empty(path):
    path = path.with_name("empty.sgy")
    path.write_bytes(b"")
    return path


def _zarr_directory_renamed(path):
    path = path.with_name("store.sgy")
    (path / "zarr.json").parent.mkdir()
    (path / "zarr.json").write_text("{}")
    return path


BAD_INPUTS = [
    (_readme_renamed, NotSegyError, ["README.sgy", "not a SEG-Y file", "sample format", "plain text"]),
    (_png_renamed, NotSegyError, ["picture.sgy", "not a SEG-Y file", "a PNG image"]),
    (_zip_renamed, NotSegyError, ["archive.sgy", "not a SEG-Y file", "a zip archive"]),
    (_empty, SegyTruncatedError, ["empty.sgy", "0 bytes", "not a SEG-Y file"]),
    (_zarr_directory_renamed, SegyError, ["store.sgy", "is a directory", "expected a SEG-Y file"]),
    # (file or builder, exception, words the message must contain)
    ("does-not-exist.sgy", SegyFileNotFoundError, ["does-not-exist.sgy", "no such file", "Expected a SEG-Y"]),
    ("broken.sgy", SegyTruncatedError, ["broken.sgy", "truncated", "4 samples", "68 bytes"]),
    ("text.sgy", SegyEmptyError, ["text.sgy", "no traces", "3600 bytes"]),
    ("shot-gather.sgy", SegyNotA3DVolumeError,
     ["shot-gather.sgy", "not a sorted 3D volume", "byte 189", "byte 193", "61 traces", "open_segy(path, iline="]),
    ("small-ps.sgy", SegyPrestackError, ["small-ps.sgy", "pre-stack", "2 offsets", "post-stack", "Stack"]),
    ("long.sgy", SegyGeometryError, ["long.sgy", "60000 samples", "3 traces", "byte 189"]),
    (_gridded_file_with_a_missing_trace, SegyGeometryError,
     ["3 inlines x 3 crosslines = 9 positions", "8 traces", "inline 2, crossline 11"]),
    (_headers_inconsistent_halfway, SegyGeometryError,
     ["41 inlines x 50 crosslines = 2050 positions", "2000 traces", "50 positions have no trace", "byte 189"]),
]


@pytest.mark.parametrize("bad, error, words", BAD_INPUTS,
                         ids=[b if isinstance(b, str) else b.__name__.strip("_") for b, _, _ in BAD_INPUTS])
@pytest.mark.parametrize("opener", [open_segy, SegySource], ids=["open_segy", "SegySource"])
def test_bad_input_raises_a_typed_error_naming_file_expectation_and_finding(segy_dir, tmp_path, bad, error, words,
                                                                            opener):
    path = bad(tmp_path / "missing-trace.sgy") if callable(bad) else (
        tmp_path / bad if bad == "does-not-exist.sgy" else segy_dir / bad)
    with pytest.raises(error) as info:
        opener(path)
    message = str(info.value)
    assert isinstance(info.value, SegyError) and info.value.path == str(path)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_a_missing_file_is_also_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        open_segy(tmp_path / "nope.sgy")


def test_other_byte_locations_can_be_passed(tmp_path):
    """A survey whose numbers sit elsewhere fails at 189/193 and opens when told where they are."""
    path = synthetic_survey(tmp_path / "s.sgy", (3, 4, 10))
    with segyio.open(str(path), "r+") as f:  # move inline/crossline numbers to bytes 9 / 21
        for k in range(f.tracecount):
            h = f.header[k]
            f.header[k] = {segyio.TraceField.FieldRecord: h[189], segyio.TraceField.CDP: h[193],
                           segyio.TraceField.INLINE_3D: 0, segyio.TraceField.CROSSLINE_3D: 0}
    with pytest.raises(SegyNotA3DVolumeError, match="byte 189"):
        open_segy(path)
    da = open_segy(path, iline=9, xline=21)
    assert da.iline.values.tolist() == [100, 101, 102] and da.xline.values.tolist() == [300, 301, 302, 303]
    assert da.attrs["memchunk_source"] == {"kind": "segy", "path": str(path), "iline": 9, "xline": 21}


def test_nan_and_inf_samples_are_read_as_they_are(tmp_path):
    path = synthetic_survey(tmp_path / "s.sgy", (2, 3, 8))
    with segyio.open(str(path), "r+") as f:
        t = f.trace[4].copy()
        t[2], t[3], t[5] = np.nan, np.inf, -np.inf
        f.trace[4] = t
    v = open_segy(path).values[1, 1]  # trace 4 = inline index 1, crossline index 1
    assert np.isnan(v[2]) and v[3] == np.inf and v[5] == -np.inf


def test_header_scan_never_reads_samples(segy_dir, monkeypatch):
    def no_samples(*a, **k):  # pragma: no cover - must not run
        raise AssertionError("sample data read while opening")

    monkeypatch.setattr(segy_mod, "read_traces", no_samples)
    da = open_segy(segy_dir / "f3.sgy")
    assert da.shape == (23, 18, 75)


def test_a_files_geometry_is_scanned_once_per_identity_and_kept_across_processes(tmp_path, monkeypatch):
    import os
    import time

    from memchunk_prefect.io import segy_cache

    monkeypatch.setenv("MEMCHUNK_CACHE_DIR", str(tmp_path / "cache"))
    path = synthetic_survey(tmp_path / "s.sgy", (6, 5, 20), seed=1)
    settled = time.time() - 60
    os.utime(path, (settled, settled))
    scans = []
    real = segy_cache.scan
    monkeypatch.setattr(segy_cache, "scan", lambda *a, **k: scans.append(a) or real(*a, **k))
    first = SegySource(path)
    again = SegySource(path)
    assert len(scans) == 1 and again.shape == first.shape == (6, 5, 20)
    assert np.array_equal(again.coords()["cdp_x"], first.coords()["cdp_x"])
    segy_cache._MEMORY.clear()  # a new process: the disk keeps it
    third = SegySource(path)
    assert len(scans) == 1 and np.array_equal(third.coords()["cdp_y"], first.coords()["cdp_y"])
    synthetic_survey(path, (6, 5, 20), seed=2)  # rewritten: a new identity
    os.utime(path, (settled + 1, settled + 1))
    SegySource(path)
    assert len(scans) == 2


def test_threads_of_a_fresh_worker_open_segy_files_with_segyio_s_extension_already_loaded(segy_dir):
    """``segyio.open`` imports segyio's C extension at its first call; two threads of a fresh 2-thread worker
    doing so at once raced on that import (``cannot access submodule '_segyio' of module 'segyio'``, seen in a
    plain flow's first tasks of the workload family). The reader loads the extension under its import lock,
    before any thread's first open: checked in a fresh interpreter, where nothing imported it before, and with
    8 threads opening a real file at once."""
    import subprocess
    import sys

    path = segy_dir / "small.sgy"
    code = (
        "import sys, threading\n"
        "from memchunk_prefect.io.segy import _segyio, handle\n"
        "_segyio()\n"
        "assert 'segyio._segyio' in sys.modules, 'the extension is not loaded'\n"
        "barrier, errors = threading.Barrier(8), []\n"
        "def go():\n"
        "    barrier.wait()\n"
        "    try:\n"
        f"        handle({str(path)!r}, 'big')\n"
        "    except Exception as exc:\n"
        "        errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=go) for _ in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert not errors, errors\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
