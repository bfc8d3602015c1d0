"""The data layer on synthetic surveys: round trips, lazy reads, sources, zarr output under concurrency, SEG-Y export."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import segyio
import xarray as xr
from hypothesis import given, settings
from hypothesis import strategies as st

import memchunk_prefect.io.segy as segy_mod
import memchunk_prefect.io.synthetic as synthetic_mod
from memchunk_prefect.core.chunks import Chunk, balanced_grid, grid
from memchunk_prefect.core.errors import (
    ChunkedSourceError,
    HaloTooLargeError,
    IncompleteOutputError,
    OutputPathError,
    SegyGeometryError,
    VolumeError,
)
from memchunk_prefect.io.export import to_segy
from memchunk_prefect.io.segy_source import SegySource
from memchunk_prefect.io.segy_xarray import open_segy
from memchunk_prefect.io.source import ArraySource
from memchunk_prefect.io.synthetic import synthetic_survey, synthetic_volume
from memchunk_prefect.io.volume import as_source, read_block
from memchunk_prefect.io.zarr_store import ZarrOutput, ZarrSource, default_zarr_chunks, open_result

SHAPE = (9, 11, 40)


@pytest.fixture(scope="module")
def survey(tmp_path_factory):
    """One synthetic survey as inline-sorted and crossline-sorted SEG-Y, a zarr store, and the in-memory truth."""
    d = tmp_path_factory.mktemp("survey")
    truth = synthetic_volume(SHAPE, seed=3)
    il = synthetic_survey(d / "il.sgy", SHAPE, seed=3)
    xl = synthetic_survey(d / "xl.sgy", SHAPE, seed=3, sorting="xline", endian="little")
    out = ZarrOutput.create(d / "z.zarr", SHAPE, SegySource(il).coords(), zarr_chunks=(4, 4, 40))
    for c in grid(SHAPE, (4, 4, 40)):
        out.write(c, truth[c.slices()])
    out.finalize()
    return {"truth": truth, "il": il, "xl": xl, "zarr": d / "z.zarr", "dir": d}


# --------------------------------------------------------------------------- synthetic surveys


def test_synthetic_survey_round_trips_in_iline_xline_twt_order(survey):
    da = open_segy(survey["il"])
    assert da.dims == ("iline", "xline", "twt") and da.shape == SHAPE
    np.testing.assert_array_equal(da.values, survey["truth"])
    assert da.iline.values.tolist() == list(range(100, 109))
    assert da.xline.values.tolist() == list(range(300, 311))
    np.testing.assert_allclose(da.twt.values, np.arange(40) * 4.0)


def test_crossline_sorted_little_endian_file_reads_the_same_volume(survey):
    da = open_segy(survey["xl"])
    assert da.attrs["sorting"] == "xline" and da.attrs["endian"] == "little"
    np.testing.assert_array_equal(da.values, survey["truth"])


@pytest.mark.parametrize("name", ["il", "xl"])
@pytest.mark.parametrize("box", [((0, 0, 0), (9, 11, 40)), ((2, 3, 0), (7, 9, 40)), ((0, 0, 5), (9, 1, 17)),
                                 ((4, 0, 0), (5, 11, 40)), ((8, 10, 39), (9, 11, 40))])
def test_every_box_reads_its_samples_whatever_the_files_order_and_the_read_pieces(survey, name, box, monkeypatch):
    """An inline-sorted file's boxes take the in-order path (runs copied straight to their rows), a
    crossline-sorted file's the sorted gather; runs cut into pieces of 3 traces, then whole."""
    chunk = Chunk(*box)
    src = SegySource(survey[name])
    for piece in (3 * 40 * 4, segy_mod.READ_PIECE_BYTES):
        monkeypatch.setattr(segy_mod, "READ_PIECE_BYTES", piece)
        np.testing.assert_array_equal(src.read(chunk), survey["truth"][chunk.slices()])


def test_synthetic_traces_vary_along_time_and_across_the_survey():
    """The reference study's pitfalls: constant traces, and xline/sample axes swapped."""
    v = synthetic_volume((24, 20, 120), seed=0)
    assert v.dtype == np.float32
    assert v.std(axis=2).min() > 0.05 * v.std()           # every trace varies in time
    assert np.abs(np.diff(v, axis=0)).mean() > 0.05 * v.std()  # neighbouring inlines differ
    assert np.abs(np.diff(v, axis=1)).mean() > 0.05 * v.std()  # neighbouring crosslines differ
    # reflectors are continuous in space but oscillate in time: traces correlate with their
    # neighbour far more than a trace correlates with itself shifted by 3 samples
    lateral = np.corrcoef(v[10, 10], v[10, 11])[0, 1]
    vertical = np.corrcoef(v[10, 10, :-3], v[10, 10, 3:])[0, 1]
    assert lateral > 0.5 > vertical


def test_synthetic_volume_is_deterministic_by_seed():
    a, b, c = (synthetic_volume((4, 5, 30), seed=s) for s in (7, 7, 8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_synthetic_survey_headers_say_what_the_file_is(tmp_path):
    path = synthetic_survey(tmp_path / "s.sgy", (3, 4, 20), sample_interval_ms=2.0, first_iline=7, first_xline=50)
    with segyio.open(str(path)) as f:
        assert f.format == 5 or f.bin[segyio.BinField.Format] == 5
        assert f.bin[segyio.BinField.Interval] == 2000 and f.bin[segyio.BinField.Samples] == 20
        h = f.header[5]  # inline-sorted: trace 5 = inline 8, crossline 51
        assert (h[189], h[193]) == (8, 51)
        assert h[segyio.TraceField.TRACE_SAMPLE_INTERVAL] == 2000 and h[71] == -100
    da = open_segy(path)
    assert da.attrs["sample_interval_ms"] == 2.0
    # a regular rotated grid: neighbouring inlines are 25 m apart, crosslines 12.5 m
    dx = np.hypot(np.diff(da.cdp_x.values, axis=0), np.diff(da.cdp_y.values, axis=0))
    dy = np.hypot(np.diff(da.cdp_x.values, axis=1), np.diff(da.cdp_y.values, axis=1))
    np.testing.assert_allclose(dx, 25.0, atol=0.02)
    np.testing.assert_allclose(dy, 12.5, atol=0.02)


def test_writing_a_128x128x400_survey_takes_seconds(tmp_path):
    import time

    t = time.perf_counter()
    synthetic_survey(tmp_path / "big.sgy", (128, 128, 400))
    assert time.perf_counter() - t < 10


def test_a_failed_survey_write_leaves_no_file(tmp_path, monkeypatch):
    real = synthetic_mod._synthetic_inline

    def fail_at_third(model, i, *a, **k):
        if i == 2:
            raise OSError("disk full (simulated)")
        return real(model, i, *a, **k)

    monkeypatch.setattr(synthetic_mod, "_synthetic_inline", fail_at_third)
    with pytest.raises(OSError, match="disk full"):
        synthetic_survey(tmp_path / "s.sgy", (5, 4, 10))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("shape", [(0, 4, 10), (4, 0, 10), (4, 4, 0)])
def test_a_zero_size_volume_is_refused_everywhere(tmp_path, shape):
    with pytest.raises(VolumeError, match="empty"):
        synthetic_survey(tmp_path / "s.sgy", shape)
    with pytest.raises(VolumeError, match="empty"):
        ArraySource(np.zeros(shape, dtype=np.float32))
    with pytest.raises(VolumeError, match="empty"):
        ZarrOutput.create(tmp_path / "z.zarr", shape)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- lazy reading


def test_open_segy_reads_headers_only_and_isel_reads_only_the_selected_traces(survey, monkeypatch):
    reads = []

    class CountingRaw:
        def __init__(self, raw):
            self.raw = raw

        def __getitem__(self, s):
            reads.append((s.start, s.stop))
            return self.raw[s]

    class CountingHandle:
        def __init__(self, f):
            self.trace = type("T", (), {"raw": CountingRaw(f.trace.raw)})()

    real_handle = segy_mod.handle
    monkeypatch.setattr(segy_mod, "handle", lambda path, endian: CountingHandle(real_handle(path, endian)))
    da = open_segy(survey["il"])
    assert reads == []                                   # opening read no sample
    v = da.isel(iline=4, xline=slice(2, 5)).values       # one inline, three crosslines
    np.testing.assert_array_equal(v, survey["truth"][4, 2:5])
    nx = SHAPE[1]
    assert reads == [(4 * nx + 2, 4 * nx + 5)]            # exactly those 3 traces, in one run


def test_lazy_dataarray_pickles_small_and_reads_on_the_other_side(survey):
    da = open_segy(survey["il"])
    blob = pickle.dumps(da.isel(iline=slice(2, 6)))
    assert len(blob) < 64 * 1024
    np.testing.assert_array_equal(pickle.loads(blob).values, survey["truth"][2:6])


# --------------------------------------------------------------------------- sources


def test_sources_report_shape_and_coordinates(survey):
    s = SegySource(survey["il"])
    z = ZarrSource(survey["zarr"])
    a = ArraySource(survey["truth"])
    for src in (s, z, a):
        assert src.shape == SHAPE
    for src in (s, z):
        c = src.coords()
        assert c["iline"].tolist() == list(range(100, 109)) and c["sample_interval_ms"] == 4.0
        assert c["cdp_x"].shape == SHAPE[:2]
    c = a.coords()
    assert c["iline"].tolist() == list(range(9)) and c["sample_interval_ms"] == 4.0
    assert ArraySource(survey["truth"], sample_interval_ms=2.0).coords()["twt"][1] == 2.0


BOXES = st.tuples(*[st.integers(0, n - 1) for n in SHAPE]).flatmap(
    lambda start: st.tuples(st.just(start), st.tuples(*[st.integers(a + 1, n) for a, n in zip(start, SHAPE)])))


@settings(max_examples=40, deadline=None)
@given(box=BOXES, kind=st.sampled_from(["il", "xl", "zarr", "numpy", "xarray"]))
def test_any_box_read_from_any_source_equals_the_same_box_in_memory(survey, box, kind):
    chunk = Chunk(*box)
    src = {
        "il": lambda: SegySource(survey["il"]), "xl": lambda: SegySource(survey["xl"]),
        "zarr": lambda: ZarrSource(survey["zarr"]), "numpy": lambda: ArraySource(survey["truth"]),
        "xarray": lambda: ArraySource(xr.DataArray(survey["truth"], dims=("iline", "xline", "twt"))),
    }[kind]()
    got = src.read(chunk)
    assert got.dtype == np.float32 and got.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(got, survey["truth"][chunk.slices()])


def test_sources_pickle_as_paths_not_samples(survey):
    for src in (SegySource(survey["il"]), ZarrSource(survey["zarr"])):
        blob = pickle.dumps(src)
        assert len(blob) < 8 * 1024
        back = pickle.loads(blob)
        assert back == src
        np.testing.assert_array_equal(back.read(Chunk((1, 2, 3), (4, 5, 6))), survey["truth"][1:4, 2:5, 3:6])


def test_as_source_picks_the_source_from_what_it_is_given(survey, tmp_path):
    assert isinstance(as_source(str(survey["il"])), SegySource)
    assert isinstance(as_source(survey["zarr"]), ZarrSource)
    assert isinstance(as_source(survey["truth"]), ArraySource)
    s = SegySource(survey["il"])
    assert as_source(s) is s
    # a DataArray from open_segy/open_result maps back to its file, so workers read the file
    assert as_source(open_segy(survey["il"])) == s
    assert as_source(open_result(survey["zarr"])) == ZarrSource(survey["zarr"])
    # ...but a slice of it is not the whole file: it stays a (lazy) array source
    part = as_source(open_segy(survey["il"]).isel(iline=slice(0, 3)))
    assert isinstance(part, ArraySource) and part.shape == (3, 11, 40)
    np.testing.assert_array_equal(part.read(Chunk((0, 0, 0), (3, 11, 40))), survey["truth"][:3])
    # ...and neither is a computed one, though xarray keeps attrs (memchunk_source) through arithmetic
    doubled = open_result(survey["zarr"]) * 2
    assert "memchunk_source" in doubled.attrs and isinstance(as_source(doubled), ArraySource)
    np.testing.assert_array_equal(as_source(doubled).read(Chunk((0, 0, 0), SHAPE)), survey["truth"] * 2)
    # dims in another order are transposed to (iline, xline, twt)
    t = xr.DataArray(survey["truth"], dims=("iline", "xline", "twt")).transpose("twt", "iline", "xline")
    np.testing.assert_array_equal(as_source(t).read(Chunk((0, 0, 0), SHAPE)), survey["truth"])


@pytest.mark.parametrize("obj, words", [
    ([1, 2, 3], ["builtins.list", "SEG-Y path", "zarr store", "numpy array"]),
    (42, ["builtins.int", "xarray.DataArray"]),
    ("volume.txt", ["volume.txt", ".sgy"]),
])
def test_as_source_refuses_what_it_cannot_read_and_says_what_it_accepts(obj, words):
    with pytest.raises(ChunkedSourceError) as info:
        as_source(obj)
    for w in words:
        assert w in str(info.value)


def test_read_block_adds_the_halo_clipped_at_the_edges(survey):
    src = ArraySource(survey["truth"])
    chunk = Chunk((0, 4, 0), (3, 8, 40))
    block, trim = read_block(src, chunk, halo=(2, 2, 0))
    np.testing.assert_array_equal(block, survey["truth"][0:5, 2:10, :])  # no halo before inline 0
    np.testing.assert_array_equal(block[trim], survey["truth"][chunk.slices()])


def test_read_block_refuses_a_halo_larger_than_the_volume(survey):
    with pytest.raises(HaloTooLargeError, match="iline: halo 9 >= 9"):
        read_block(survey["truth"], Chunk((0, 0, 0), (2, 2, 40)), halo=(9, 1, 0))


# --------------------------------------------------------------------------- zarr output


def test_default_storage_chunks_are_whole_traces_of_one_to_four_mib():
    for shape in [(128, 128, 400), (500, 700, 1500), (64, 64, 64)]:
        zc = default_zarr_chunks(shape)
        assert zc[2] == shape[2]
        nbytes = zc[0] * zc[1] * zc[2] * 4
        assert 1 * 2**20 <= nbytes <= 4 * 2**20 or zc[:2] == shape[:2]


def test_concurrent_unaligned_writes_from_processes_give_exactly_the_reference(tmp_path):
    """Chunks cut across storage chunks, written by 3 processes at once: partial chunks take the lock."""
    shape = (24, 20, 16)
    ref = synthetic_volume(shape, seed=5)
    out = ZarrOutput.create(tmp_path / "r.zarr", shape, zarr_chunks=(8, 8, 16))
    chunks = balanced_grid(shape, (7, 5, 1))  # 3-4 inlines x 4 xlines: none aligned to 8 x 8
    assert any(out._storage_chunks(c)[1] for c in chunks)
    ctx = multiprocessing.get_context("spawn")  # what Dask's nannies use; zarr's IO thread does not survive fork
    with ProcessPoolExecutor(3, mp_context=ctx) as pool:
        for f in [pool.submit(out.write, c, ref[c.slices()]) for c in chunks]:
            f.result()
    assert out.is_complete()
    out.finalize()
    np.testing.assert_array_equal(open_result(out.path).values, ref)


def test_an_incomplete_store_is_never_reported_complete(tmp_path):
    shape = (6, 5, 8)
    v = synthetic_volume(shape)
    out = ZarrOutput.create(tmp_path / "r.zarr", shape, zarr_chunks=(3, 5, 8))
    chunks = grid(shape, (2, 5, 8))
    for c in chunks[:-1]:
        out.write(c, v[c.slices()])
    out.write(chunks[-1], v[chunks[-1].slices()], mark_done=False)  # data there, but no marker: a crash mid-way
    assert not out.is_complete()
    assert out.missing_elements() == 2 * 5 * 8
    with pytest.raises(IncompleteOutputError, match="80 of 240 elements"):
        out.finalize()
    with pytest.raises(IncompleteOutputError, match="allow_incomplete=True"):
        open_result(out.path)
    partial = open_result(out.path, allow_incomplete=True)
    np.testing.assert_array_equal(partial.values[:4], v[:4])
    # resuming: the completed chunks are known, the remainder is written, then it is complete
    again = ZarrOutput.open(out.path)
    assert again.completed_chunks() == chunks[:-1]
    again.write(chunks[-1], v[chunks[-1].slices()])
    again.finalize()
    np.testing.assert_array_equal(open_result(out.path).values, v)


def test_overlapping_completed_chunks_from_a_recut_resume_still_count_as_complete(tmp_path):
    shape = (6, 4, 5)
    v = synthetic_volume(shape)
    out = ZarrOutput.create(tmp_path / "r.zarr", shape)
    for c in [Chunk((0, 0, 0), (4, 4, 5)), Chunk((3, 0, 0), (6, 4, 5))]:
        out.write(c, v[c.slices()])
    assert out.is_complete()


def test_result_carries_the_inputs_coordinates_and_opens_with_plain_xarray_silently(survey, recwarn):
    da = open_result(survey["zarr"])
    np.testing.assert_array_equal(da.values, survey["truth"])
    assert da.iline.values.tolist() == list(range(100, 109))
    np.testing.assert_allclose(da.cdp_x.values, open_segy(survey["il"]).cdp_x.values)
    assert da.attrs["complete"] is True and da.attrs["sample_interval_ms"] == 4.0
    # the .memchunk bookkeeping is a zarr group: zarr lists it without "not recognized" warnings
    ds = xr.open_zarr(survey["zarr"], consolidated=False)
    assert set(ds.data_vars) >= {"data"}
    import zarr

    zarr.open_group(str(survey["zarr"]), mode="r").members(max_depth=None)
    assert not [w for w in recwarn if "not recognized" in str(w.message)]


def test_creating_over_an_existing_store_needs_overwrite(tmp_path):
    ZarrOutput.create(tmp_path / "r.zarr", (2, 2, 2))
    with pytest.raises(OutputPathError, match="ZarrOutput.open"):
        ZarrOutput.create(tmp_path / "r.zarr", (2, 2, 2))
    out = ZarrOutput.create(tmp_path / "r.zarr", (3, 2, 2), overwrite=True)
    assert out.shape == (3, 2, 2) and out.completed_chunks() == []


def test_a_block_of_the_wrong_shape_is_refused(tmp_path):
    out = ZarrOutput.create(tmp_path / "r.zarr", (4, 4, 4))
    with pytest.raises(VolumeError, match=r"shape \(2, 4, 3\)"):
        out.write(Chunk((0, 0, 0), (2, 4, 4)), np.zeros((2, 4, 3)))


# --------------------------------------------------------------------------- SEG-Y export


@pytest.mark.parametrize("template", ["il", "xl"])
def test_to_segy_writes_the_result_with_the_templates_headers(survey, tmp_path, template):
    result = open_result(survey["zarr"])
    out = to_segy(result * 2, tmp_path / "out.sgy", survey[template])
    np.testing.assert_array_equal(open_segy(out).values, survey["truth"] * 2)
    with segyio.open(str(survey[template]), ignore_geometry=True, endian="big" if template == "il" else "little") as s, \
            segyio.open(str(out), ignore_geometry=True, endian="big" if template == "il" else "little") as d:
        assert d.tracecount == s.tracecount and d.text[0] == s.text[0]
        for k in (0, 7, s.tracecount - 1):
            assert dict(d.header[k]) == dict(s.header[k])
        assert d.bin[segyio.BinField.Interval] == s.bin[segyio.BinField.Interval]


def test_to_segy_refuses_a_volume_of_another_shape_and_leaves_no_file(survey, tmp_path):
    with pytest.raises(SegyGeometryError, match=r"shape \(9, 11, 39\)"):
        to_segy(survey["truth"][:, :, :-1], tmp_path / "out.sgy", survey["il"])
    assert not os.path.exists(tmp_path / "out.sgy")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_chunks_trimmed_result_is_written_without_a_copy_of_the_whole_region(tmp_path, monkeypatch, dtype):
    """A chunk cut in crosslines trims its halo to a view that is not contiguous. It goes to zarr as that view
    (zarr copies one storage chunk at a time), not as a contiguous copy of the whole region first: that copy is
    memory the operator never asked for, its size set by where the chunk's edges fall rather than by the block
    (gaussian_smooth, sigma 6, on a 157 x 120 x 100 block cut in crosslines peaked 23.2 MiB with it and 19.0 MiB
    without; an iline slab's trim was already contiguous: ``python -m benchmarks.studies.task_memory``). An operator
    returning another dtype is still written as float32, and the result equals the operator on the whole volume."""
    import inspect

    from memchunk_prefect.run.worker import BlockJob, run_block

    shape = (12, 10, 16)
    truth = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    results = []

    def doubled(block):
        results.append((block * 2).astype(dtype))
        return results[-1]

    written = []
    real_write = ZarrOutput.write

    def spy(self, chunk, data, **kw):
        written.append(data)
        return real_write(self, chunk, data, **kw)

    monkeypatch.setattr(ZarrOutput, "write", spy)
    out = ZarrOutput.create(tmp_path / "out.zarr", shape)
    halo = (2, 3, 0)
    chunks = [Chunk((0, 0, 0), (6, 5, 16)), Chunk((0, 5, 0), (6, 10, 16)), Chunk((6, 0, 0), (12, 10, 16))]
    for c in chunks:
        job = BlockJob(source=ArraySource(truth), chunk=c, halo=halo, volume_shape=shape, output_path=out.path,
                       operator="doubled", operator_key="doubled|float32|cpu", budget_bytes=0, label=c.key())
        run_block(doubled, job, inspect.signature(doubled).bind(job))
    for data, result in zip(written, results):
        assert data.dtype == np.float32
        assert np.shares_memory(data, result) == (dtype == np.float32), "float32 results are written as views"
    if dtype == np.float32:
        assert not written[0].flags.c_contiguous, "the first chunk's trim cuts crosslines: a view, not contiguous"
    got = open_result(out.path, allow_incomplete=True).values
    np.testing.assert_array_equal(got, truth * 2)


def test_a_synthetic_survey_can_be_written_as_the_field_keeps_them_ibm_floats_and_odd_line_steps(tmp_path):
    path = synthetic_survey(tmp_path / "odd.sgy", (7, 9, 50), seed=3, line_step=(2, 4), sample_format=1,
                            first_iline=1001)
    da = open_segy(path)
    assert da.coords["iline"].values.tolist() == list(range(1001, 1015, 2))
    assert da.coords["xline"].values.tolist() == list(range(300, 336, 4))
    import segyio

    with segyio.open(str(path), ignore_geometry=True) as f:
        assert int(f.bin[segyio.BinField.Format]) == 1
    expected = synthetic_volume((7, 9, 50), seed=3)
    assert np.max(np.abs(da.values - expected)) <= 1e-5 * np.max(np.abs(expected))  # IBM's 24-bit mantissa
    with pytest.raises(ValueError, match="sample_format"):
        synthetic_survey(tmp_path / "bad.sgy", (2, 2, 4), sample_format=3)
