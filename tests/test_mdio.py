"""MDIO v1 in and out on real files: SEG-Y imported by mdio itself, run through the runner, opened by mdio again.

The survey is segyio's F3 crop (23 x 18 x 75), imported with ``mdio.segy_to_mdio`` and mdio's own post-stack
template (what ``mdio segy import`` is meant to run; that command fails in multidimio 1.1.3, calling
``segy_to_mdio`` with the arguments of an older API, so the Python API is used).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr
from prefect import flow

from memchunk_prefect import MemoryAwareRunner, chunked, open_segy, operators
from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.errors import MdioError, MdioNotFoundError, OutputPathError, RunnerConfigError
from memchunk_prefect.io.identity import FoundOutput, OutputIdentity, open_output, output_action
from memchunk_prefect.io.mdio import MdioSource, create_mdio_output
from memchunk_prefect.io.source import ArraySource
from memchunk_prefect.io.volume import as_source
from memchunk_prefect.io.zarr_store import ZarrOutput, ZarrSource, open_result
from memchunk_prefect.testing import start_local_cluster

try:
    import mdio
except ImportError as exc:  # pragma: no cover - where multidimio does not install
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):  # the test extra installs it
        raise
    pytest.skip(f"mdio (multidimio 1.1) does not import ({exc}): it needs Python >= 3.11 and pins zarr <= 3.1.6, "
                "fsspec < 2026.2 and pandas < 3; pip install 'memchunk-prefect[mdio]'", allow_module_level=True)

REPO = Path(__file__).resolve().parents[1]
HOWTO = REPO / "docs" / "how-to" / "mdio.md"
MARKER = "<!-- tests/test_mdio.py runs this block as written"


def segy_to_mdio(segy: Path, out: Path) -> Path:
    """``segy`` imported by mdio (SEG-Y rev 1 headers: inline at byte 189, crossline at 193), one import process."""
    from mdio.builder.template_registry import get_template
    from segy.standards import get_segy_standard

    previous = os.environ.get("MDIO__IMPORT__CPU_COUNT")
    os.environ["MDIO__IMPORT__CPU_COUNT"] = "1"  # one spawned header-scan process, not one per core
    try:
        mdio.segy_to_mdio(get_segy_standard(1.0), get_template("PostStack3DTime"), segy, out)
    finally:
        if previous is None:
            os.environ.pop("MDIO__IMPORT__CPU_COUNT", None)
        else:
            os.environ["MDIO__IMPORT__CPU_COUNT"] = previous
    return out


@pytest.fixture(scope="module")
def f3_mdio(segy_dir, tmp_path_factory) -> Path:
    return segy_to_mdio(segy_dir / "f3.sgy", tmp_path_factory.mktemp("mdio") / "f3.mdio")


# --------------------------------------------------------------------------- MDIO in, no cluster


def test_an_mdio_survey_reads_with_its_own_dims_coordinates_and_storage_chunks(f3_mdio, segy_dir):
    ds = mdio.open_mdio(f3_mdio)
    src = as_source(str(f3_mdio))
    assert isinstance(src, MdioSource) and src.variable == "amplitude"
    assert src.dims == ("inline", "crossline", "time") and src.shape == (23, 18, 75)
    c = src.coords()
    np.testing.assert_array_equal(c["iline"], ds.inline.values)
    np.testing.assert_array_equal(c["xline"], ds.crossline.values)
    np.testing.assert_array_equal(c["twt"], ds.time.values)
    np.testing.assert_array_equal(c["cdp_x"], ds.cdp_x.values)
    np.testing.assert_array_equal(c["cdp_y"], ds.cdp_y.values)
    assert c["sample_interval_ms"] == 4.0
    # mdio's import holds exactly the samples segyio reads (int16 in the file, float32 in both)
    np.testing.assert_array_equal(ds.amplitude.values, open_segy(segy_dir / "f3.sgy").values)
    box = Chunk((3, 2, 10), (11, 17, 60))
    np.testing.assert_array_equal(src.read(box), ds.amplitude.values[box.slices()])
    # mdio's 128^3 bricks, cut to the volume: one chunk here
    assert src.chunking() == (Chunk((0, 0, 0), (23, 18, 75)),)
    assert src.identity() == as_source(str(f3_mdio)).identity() and src.identity()["createdOn"]


def test_an_mdio_dataset_is_its_store_while_untouched_and_an_array_once_changed(f3_mdio):
    assert as_source(mdio.open_mdio(f3_mdio)) == MdioSource(f3_mdio)
    assert as_source(mdio.open_mdio(f3_mdio, chunks={})) == MdioSource(f3_mdio)  # dask over the store, as opened
    ds = mdio.open_mdio(f3_mdio)
    changed = as_source(ds.assign(amplitude=ds.amplitude * 2))
    assert isinstance(changed, ArraySource) and changed.dims == ("inline", "crossline", "time")
    np.testing.assert_array_equal(changed.read(Chunk((0, 0, 0), (2, 2, 5))), ds.amplitude.values[:2, :2, :5] * 2)
    sliced = as_source(ds.isel(inline=slice(0, 5)))
    assert isinstance(sliced, ArraySource) and sliced.shape == (5, 18, 75)
    # a DataArray with its dims in another order is read in (inline, crossline, time) order, names kept
    turned = as_source(ds.amplitude.transpose("time", "inline", "crossline"))
    assert turned.dims == ("inline", "crossline", "time") and turned.shape == (23, 18, 75)


def test_an_mdio_store_rewritten_is_a_new_input(f3_mdio, tmp_path):
    copy = Path(shutil.copytree(f3_mdio, tmp_path / "copy.mdio"))
    before = MdioSource(copy).identity()
    os.utime(copy / "amplitude" / "zarr.json", ns=(1, 1))  # mdio rewrites the metadata at every import
    assert MdioSource(copy).identity() != before


def test_bad_mdio_inputs_raise_typed_errors_saying_what_was_found(f3_mdio, tmp_path):
    with pytest.raises(MdioNotFoundError, match=r"nope\.mdio: no such MDIO store"):
        as_source(str(tmp_path / "nope.mdio"))
    plain = tmp_path / "plain.mdio"
    zarr.open_group(str(plain), mode="w").create_array("amplitude", shape=(2, 2, 2), dtype="float32")
    with pytest.raises(MdioError, match=r"not an MDIO v1 dataset .*apiVersion.*ZarrSource"):
        as_source(str(plain))
    with pytest.raises(MdioError, match=r"no variable 'amp'; its 3D variables are \['amplitude'\]"):
        MdioSource(f3_mdio, variable="amp")
    with pytest.raises(MdioError, match=r"'trace_mask' has dims \('inline', 'crossline'\) and shape \(23, 18\)"):
        MdioSource(f3_mdio, variable="trace_mask")
    with pytest.raises(MdioError, match=r"no data variable 'amplitude' \(its data variables: \['trace_mask'\]\)"):
        as_source(mdio.open_mdio(f3_mdio)[["trace_mask"]])
    with pytest.raises(RunnerConfigError, match="output_format='segy'.*'zarr', 'mdio'"):
        chunked(str(f3_mdio), output_format="segy")
    with pytest.raises(RunnerConfigError, match="ending .mdio is read back as an MDIO dataset"):
        chunked(str(f3_mdio), output=tmp_path / "o.mdio", output_format="zarr")
    assert chunked(str(f3_mdio), output=tmp_path / "o.mdio").output_format == "mdio"
    assert chunked(str(f3_mdio)).output_format == "zarr"


# --------------------------------------------------------------------------- MDIO out, no cluster


def test_an_mdio_output_is_filled_by_region_and_finalized_like_zarr(f3_mdio, tmp_path):
    src = MdioSource(f3_mdio)
    path = tmp_path / "out.mdio"
    out = create_mdio_output(path, src.shape, src.coords(), dims=src.dims, attrs={"operator": "double"},
                             carry_from=src.path)
    assert ZarrOutput.open(path) == out and out.name == "amplitude"
    whole = src.read(Chunk((0, 0, 0), src.shape))
    first = Chunk((0, 0, 0), (12, 18, 75))
    out.write(first, whole[first.slices()] * 2)
    with pytest.raises(Exception, match="not marked complete"):
        open_result(path)
    assert [c for c in out.completed_chunks()] == [first] and not out.is_complete()
    rest = Chunk((12, 0, 0), (23, 18, 75))
    out.write(rest, whole[rest.slices()] * 2)
    out.finalize()
    ds = mdio.open_mdio(path)
    np.testing.assert_array_equal(ds.amplitude.values, whole * 2)
    theirs = mdio.open_mdio(f3_mdio)
    for k in ("inline", "crossline", "time", "cdp_x", "cdp_y", "trace_mask"):
        np.testing.assert_array_equal(ds[k].values, theirs[k].values)
    assert ds.headers.values.tobytes() == theirs.headers.values.tobytes()  # the trace headers, as imported
    assert ds.attrs["attributes"]["defaultVariableName"] == "amplitude" and ds.attrs["complete"] is True
    assert open_result(path).dims == ("inline", "crossline", "time")


def test_an_output_of_the_other_format_is_replaced_not_resumed():
    want = OutputIdentity("envelope|float32|cpu", {"kind": "mdio", "path": "/s.mdio"}, "c", "p", (0, 0, 0))
    zarr_there = FoundOutput(memchunk=True, shape=(4, 4, 8), operator_key=want.operator_key, identity=want.to_json())
    assert output_action("/o", zarr_there, want, (4, 4, 8)).action == "resume"
    act = output_action("/o", zarr_there, want, (4, 4, 8), output_format="mdio")
    assert act.action == "restart" and act.reason == "it was written as zarr, and mdio is asked for"


def test_an_mdio_survey_named_as_an_output_is_refused_and_left_as_it_was(f3_mdio):
    before = sorted((p.relative_to(f3_mdio), p.stat().st_mtime_ns) for p in f3_mdio.rglob("*"))
    want = OutputIdentity("envelope|float32|cpu", {"kind": "mdio", "path": str(f3_mdio)}, "c", "p", (0, 0, 0))
    for replace_any in (False, True):
        with pytest.raises(OutputPathError, match="not a store written by memchunk; refusing to replace it"):
            open_output(str(f3_mdio), want, (23, 18, 75), {}, operator="envelope", output_format="mdio",
                        replace_any=replace_any)
    assert sorted((p.relative_to(f3_mdio), p.stat().st_mtime_ns) for p in f3_mdio.rglob("*")) == before


def test_writing_mdio_without_mdio_says_which_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mdio", None)  # as where multidimio is not installed
    with pytest.raises(MdioError, match=r"needs mdio.*pip install 'memchunk-prefect\[mdio\]'.*Or write zarr"):
        create_mdio_output(tmp_path / "o.mdio", (2, 2, 4))
    assert not (tmp_path / "o.mdio").exists()


def test_a_seismic_depth_array_becomes_an_mdio_depth_dataset(tmp_path):
    data = np.arange(4 * 3 * 5, dtype=np.float32).reshape(4, 3, 5)
    da = xr.DataArray(data, dims=("iline", "xline", "depth"),
                      coords={"iline": [10, 11, 12, 13], "xline": [5, 6, 7], "depth": [0.0, 2.5, 5.0, 7.5, 10.0]})
    src = as_source(da)
    out = create_mdio_output(tmp_path / "d.mdio", src.shape, src.coords(), dims=src.dims)
    out.write(Chunk((0, 0, 0), src.shape), data)
    out.finalize()
    ds = mdio.open_mdio(tmp_path / "d.mdio")
    assert ds.amplitude.dims == ("inline", "crossline", "depth") and ds.attrs["name"] == "PostStack3DDepth"
    np.testing.assert_array_equal(ds.depth.values, [0.0, 2.5, 5.0, 7.5, 10.0])  # not cut to whole numbers
    np.testing.assert_array_equal(ds.inline.values, [10, 11, 12, 13])
    np.testing.assert_array_equal(ds.amplitude.values, data)


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def cluster():
    c = start_local_cluster(n_workers=2, memory_limit="1GiB")
    yield c
    c.close()


def howto_block() -> str:
    (block,) = re.findall(re.escape(MARKER) + r"[^\n]*\n```python\n(.*?)```", HOWTO.read_text(), flags=re.S)
    return block


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_segy_to_mdio_to_the_runner_to_mdio_exact_in_both_conventions(cluster, f3_mdio, segy_dir, tmp_path):
    runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"),
                               output_dir=str(tmp_path / "default"))
    survey = mdio.open_mdio(f3_mdio).amplitude.values
    seismic = open_segy(segy_dir / "f3.sgy")

    # The how-to's flow as written: MDIO in, an MDIO output, then a zarr output of it.
    namespace: dict = {}
    exec(compile(howto_block(), str(HOWTO), "exec"), namespace)
    env, smooth = namespace["attributes"].with_options(task_runner=runner)(str(f3_mdio), str(tmp_path / "howto"))
    out = mdio.open_mdio(tmp_path / "howto" / "envelope.mdio")
    whole = operators.envelope.fn(survey)
    np.testing.assert_array_equal(out.amplitude.values, whole)
    theirs = mdio.open_mdio(f3_mdio)
    for k in ("inline", "crossline", "time", "cdp_x", "cdp_y"):
        np.testing.assert_array_equal(out[k].values, theirs[k].values)
    assert out.headers.values.tobytes() == theirs.headers.values.tobytes()
    assert env.dims == ("inline", "crossline", "time") and smooth.dims == ("inline", "crossline", "time")
    np.testing.assert_array_equal(smooth.values, operators.gaussian_smooth.fn(whole, sigma=(1, 1, 1)))
    np.testing.assert_array_equal(smooth.cdp_x.values, theirs.cdp_x.values)

    # segysak's names in (SEG-Y and its DataArray), MDIO out: MDIO's names, the SEG-Y file's numbers; and an
    # MDIO Dataset in, a default output asked as MDIO.
    @flow(task_runner=runner)
    def both(ds: xr.Dataset):
        a = operators.envelope.map(chunked(str(segy_dir / "f3.sgy"), output=tmp_path / "segy.mdio"))
        b = operators.envelope.map(chunked(seismic, output=tmp_path / "da.zarr"))
        c = operators.envelope.map(chunked(ds, output_format="mdio"))
        d = operators.convert.map(chunked(str(segy_dir / "f3.sgy"), output=tmp_path / "converted.mdio"))
        return a.result(), b.result(), c.output_path, c.summary(), d.result()

    a, b, c_path, c_summary, converted = both(mdio.open_mdio(f3_mdio))
    # SEG-Y converted to MDIO as a step of the flow: the samples exactly, with the file's numbers and coordinates.
    np.testing.assert_array_equal(mdio.open_mdio(tmp_path / "converted.mdio").amplitude.values, seismic.values)
    np.testing.assert_array_equal(converted.values, seismic.values)
    np.testing.assert_array_equal(converted.inline.values, seismic.iline.values)
    np.testing.assert_allclose(converted.cdp_y.values, seismic.cdp_y.values)
    # The store's chunking (one 128^3 brick cut to the volume) is the incoming chunking the runner weighs (kept or
    # re-cut); only a model not ready yet probes instead.
    assert c_summary["decisions"][0] == "probe" or "incoming" in c_summary["reasons"][0], c_summary
    from_segy = mdio.open_mdio(tmp_path / "segy.mdio")
    assert from_segy.amplitude.dims == ("inline", "crossline", "time")
    np.testing.assert_array_equal(from_segy.amplitude.values, operators.envelope.fn(seismic.values))
    np.testing.assert_array_equal(from_segy.inline.values, seismic.iline.values)
    np.testing.assert_array_equal(from_segy.time.values, seismic.twt.values)
    np.testing.assert_allclose(from_segy.cdp_x.values, seismic.cdp_x.values)
    assert a.dims == ("inline", "crossline", "time") and b.dims == ("iline", "xline", "twt")
    np.testing.assert_array_equal(b.values, operators.envelope.fn(seismic.values))
    assert c_path.endswith(".mdio") and Path(c_path).parent.parent == tmp_path / "default"
    np.testing.assert_array_equal(mdio.open_mdio(c_path).amplitude.values, whole)


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_a_resumed_mdio_run_keeps_the_chunks_it_completed(cluster, f3_mdio, tmp_path):
    runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"),
                               output_dir=str(tmp_path / "default"))
    path = tmp_path / "env.mdio"

    @flow(task_runner=runner)
    def env():
        res = operators.envelope.map(chunked(str(f3_mdio), output=path))
        return res.summary(), [Chunk.from_key(o.chunk) for o in res.observations if o.outcome == "ok"]

    first, _ = env()
    assert first["tasks"] >= 2, first  # a cold start probes with several chunks
    out = ZarrOutput.open(path)
    done = out.completed_chunks()
    # A run stopped part way: the store not complete, one chunk's marker and samples gone, the others kept.
    lost, kept = done[-1], done[:-1]
    g = zarr.open_group(str(path), mode="r+")
    g.attrs["complete"] = False
    g["amplitude"][lost.slices()] = np.nan
    shutil.rmtree(path / ".memchunk" / "done" / lost.key())
    written = {c: json.loads((path / ".memchunk" / "done" / c.key() / "zarr.json").read_text()) for c in kept}

    again, computed = env()
    assert again["decisions"][0] == "resume" and computed, again
    assert not any(c.intersect(k) for c in computed for k in kept), f"a completed chunk was recomputed: {computed}"
    for c in kept:  # not rewritten: the same marker, written by the first run
        assert json.loads((path / ".memchunk" / "done" / c.key() / "zarr.json").read_text()) == written[c]
    np.testing.assert_array_equal(mdio.open_mdio(path).amplitude.values,
                                  operators.envelope.fn(mdio.open_mdio(f3_mdio).amplitude.values))
    assert ZarrOutput.open(path).is_complete() and ZarrSource(path).identity()["completed_at"]
