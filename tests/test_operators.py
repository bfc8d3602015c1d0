"""The operators in ``tasks/``: declarations, shapes, value ranges, known answers, bad input.

Exactness under chunking is in ``test_operators_exactness.py``.
"""

from __future__ import annotations

import importlib.util
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from prefect import Task

from memchunk_prefect import operators
from memchunk_prefect.core.errors import VolumeError
from memchunk_prefect.operators import operator_key, spec_of
from memchunk_prefect.operators.instantaneous import _phase32


def _load_sibling(name: str):
    """Import a sibling test module by path (pytest runs with --import-mode=importlib: tests/ is not on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"_memchunk_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


layered_volume = _load_sibling("test_operators_exactness").layered_volume

PI32 = np.float32(np.pi)
ALL = sorted(operators.OPERATORS)


# --------------------------------------------------------------------------- declarations


def test_every_operator_is_a_prefect_task_exported_by_name():
    expected = {"envelope", "instantaneous_phase", "instantaneous_frequency", "cosine_phase", "gaussian_smooth",
                "gst3d_dip", "gst3d_azimuth", "semblance", "trace_correlation", "convert"}
    assert set(operators.OPERATORS) == expected
    for name, op in operators.OPERATORS.items():
        assert isinstance(op, Task) and op.name == name and getattr(operators, name) is op


@pytest.mark.parametrize("name, params, halo, whole_traces", [
    ("envelope", {}, (0, 0, 0), True),
    ("instantaneous_phase", {}, (0, 0, 0), True),
    ("instantaneous_frequency", {"sample_interval_ms": 2.0}, (0, 0, 0), True),
    ("cosine_phase", {}, (0, 0, 0), True),
    ("gaussian_smooth", {}, (4, 4, 4), False),
    ("gaussian_smooth", {"sigma": (3, 0, 1.5)}, (12, 0, 6), False),
    ("gaussian_smooth", {"sigma": 1, "truncate": 3.0}, (3, 3, 3), False),
    ("gst3d_dip", {}, (12, 12, 12), False),
    ("gst3d_dip", {"sigma_gradient": (1, 1, 0.5), "sigma_tensor": (2, 1, 0)}, (12, 8, 2), False),
    ("gst3d_azimuth", {"sigma_gradient": 2, "sigma_tensor": 1}, (12, 12, 12), False),
    ("semblance", {}, (1, 1, 4), False),
    ("semblance", {"window": (2, 3, 7)}, (2, 3, 7), False),
    ("trace_correlation", {}, (1, 1, 0), True),
    ("trace_correlation", {"radius": (3, 2)}, (3, 2, 0), True),
    ("convert", {}, (0, 0, 0), True),
])
def test_operators_declare_their_halo_from_their_parameters(name, params, halo, whole_traces):
    spec = spec_of(operators.OPERATORS[name])
    assert spec.halo_for(params) == halo
    assert spec.whole_traces is whole_traces


def test_memory_parameters_go_into_the_model_key_and_others_do_not():
    assert operator_key(operators.gaussian_smooth, {"sigma": (3, 3, 3)}) == "gaussian_smooth[sigma=3,3,3]|float32|cpu"
    assert operator_key(operators.gaussian_smooth, {"truncate": 3.0}) == operator_key(operators.gaussian_smooth)
    assert operator_key(operators.gst3d_dip) == "gst3d_dip[sigma_gradient=1;sigma_tensor=2]|float32|cpu"
    assert operator_key(operators.semblance, {"window": 2}) == "semblance[window=2]|float32|cpu"
    assert operator_key(operators.envelope) == "envelope|float32|cpu"


# --------------------------------------------------------------------------- shapes, dtypes, ranges


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16])
def test_output_is_float32_of_the_input_shape(name, dtype):
    volume = (layered_volume((5, 4, 48), seed=1) * 1000).astype(dtype)
    out = operators.OPERATORS[name].fn(volume)
    assert out.shape == volume.shape and out.dtype == np.float32
    assert np.isfinite(out).all()


@pytest.mark.parametrize("shape", [(1, 1, 30), (1, 7, 30), (6, 1, 30), (3, 3, 1)])
@pytest.mark.parametrize("name", ALL)
def test_degenerate_but_valid_shapes_work(name, shape):
    out = operators.OPERATORS[name].fn(layered_volume(shape, seed=2))
    assert out.shape == shape and out.dtype == np.float32


def test_values_stay_in_their_documented_ranges():
    volume = layered_volume((14, 12, 80), seed=3, noise=0.3)
    assert (operators.envelope.fn(volume) >= 0).all()
    phase = operators.instantaneous_phase.fn(volume)
    assert (phase > -PI32).all() and (phase <= PI32).all()
    assert (np.abs(operators.cosine_phase.fn(volume)) <= 1).all()
    dip = operators.gst3d_dip.fn(volume, sigma_tensor=1.0)
    assert (dip >= 0).all() and (dip <= 90).all()
    azimuth = operators.gst3d_azimuth.fn(volume, sigma_tensor=1.0)
    assert (azimuth >= 0).all() and (azimuth < 360).all()
    semblance = operators.semblance.fn(volume)
    assert (semblance >= 0).all() and (semblance <= 1).all()
    correlation = operators.trace_correlation.fn(volume)
    assert (np.abs(correlation) <= 1 + 1e-6).all()


def test_phase_of_exactly_minus_pi_is_reported_as_plus_pi():
    z = np.array([complex(-1.0, -0.0), complex(-1.0, 0.0), complex(0.0, 0.0)])
    assert np.angle(z[0]) == -np.pi  # numpy's own convention includes -pi
    assert _phase32(z).tolist() == [PI32, PI32, 0.0]


# --------------------------------------------------------------------------- known answers


def cosine_traces(frequency_hz=25.0, sample_interval_ms=4.0, n_t=250, phase=0.3):
    t = np.arange(n_t) * sample_interval_ms / 1000.0
    trace = np.cos(2 * np.pi * frequency_hz * t + phase)
    return np.broadcast_to(trace, (2, 3, n_t)).astype(np.float32), 2 * np.pi * frequency_hz * t + phase


def test_complex_trace_attributes_of_a_pure_cosine():
    volume, phase = cosine_traces()
    middle = slice(50, 200)  # away from the FFT's wrap-around at the trace ends
    np.testing.assert_allclose(operators.envelope.fn(volume)[..., middle], 1.0, atol=0.02)
    wrapped = np.angle(np.exp(1j * phase))[middle]
    got = operators.instantaneous_phase.fn(volume)[..., middle]
    np.testing.assert_allclose(np.angle(np.exp(1j * (got - wrapped))), 0.0, atol=0.02)
    cosine = operators.cosine_phase.fn(volume)[..., middle]
    np.testing.assert_allclose(cosine, np.broadcast_to(np.cos(phase[middle]), cosine.shape), atol=0.02)
    frequency = operators.instantaneous_frequency.fn(volume, sample_interval_ms=4.0)[..., middle]
    np.testing.assert_allclose(frequency, 25.0, rtol=0.01)


@pytest.mark.parametrize("frequency_hz", [5.0, 60.0, 110.0])
def test_instantaneous_frequency_of_a_pure_tone_up_to_near_nyquist(frequency_hz):
    volume, _ = cosine_traces(frequency_hz=frequency_hz, n_t=500)
    frequency = operators.instantaneous_frequency.fn(volume, sample_interval_ms=4.0)[..., 100:400]
    np.testing.assert_allclose(frequency, frequency_hz, rtol=0.02)


def test_instantaneous_frequency_scales_with_the_sample_interval():
    volume, _ = cosine_traces()
    at_4ms = operators.instantaneous_frequency.fn(volume, sample_interval_ms=4.0)
    at_2ms = operators.instantaneous_frequency.fn(volume, sample_interval_ms=2.0)
    np.testing.assert_allclose(at_2ms, 2 * at_4ms, rtol=1e-5)


def plane_wave(p_il, p_xl, shape=(32, 32, 64), period=9.0):
    """Reflectors ``twt = t0 + p_il * iline + p_xl * xline`` (samples), i.e. a known dip in sample units."""
    il, xl, t = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    return np.cos(2 * np.pi * (t - p_il * il - p_xl * xl) / period).astype(np.float32)


@pytest.mark.parametrize("p_il, p_xl, azimuth", [
    (0.5, 0.0, 0.0),    # deepens toward +iline
    (0.0, 0.5, 90.0),   # deepens toward +xline
    (-0.5, 0.0, 180.0),
    (0.0, -0.5, 270.0),
    (-0.3, -0.4, np.degrees(np.arctan2(-0.4, -0.3)) % 360),
    (0.3, -0.4, np.degrees(np.arctan2(-0.4, 0.3)) % 360),
])
def test_gst_dip_and_azimuth_of_a_plane_wave(p_il, p_xl, azimuth):
    volume = plane_wave(p_il, p_xl)
    inner = (slice(12, 20), slice(12, 20), slice(16, 48))  # beyond the halo: no edge effects
    dip = operators.gst3d_dip.fn(volume)[inner]
    np.testing.assert_allclose(dip, np.degrees(np.arctan(np.hypot(p_il, p_xl))), atol=0.5)
    got = operators.gst3d_azimuth.fn(volume)[inner]
    np.testing.assert_allclose(np.angle(np.exp(1j * np.radians(got - azimuth)), deg=True), 0.0, atol=0.5)


def test_gst_dip_of_flat_reflectors_is_zero_and_of_constant_data_is_nan():
    flat = plane_wave(0.0, 0.0, shape=(8, 8, 40))
    np.testing.assert_allclose(operators.gst3d_dip.fn(flat), 0.0, atol=1e-3)
    constant = np.full((5, 5, 20), 3.0, np.float32)
    assert np.isnan(operators.gst3d_dip.fn(constant)).all()
    assert np.isnan(operators.gst3d_azimuth.fn(constant)).all()


def test_gaussian_smooth_keeps_a_constant_and_sigma_zero_is_the_identity():
    np.testing.assert_allclose(operators.gaussian_smooth.fn(np.full((4, 5, 30), 2.5, np.float32), sigma=2), 2.5, rtol=1e-6)
    volume = layered_volume((4, 5, 30), seed=4)
    np.testing.assert_array_equal(operators.gaussian_smooth.fn(volume, sigma=0), volume)
    smooth = operators.gaussian_smooth.fn(volume, sigma=(0, 0, 2))
    assert np.abs(np.diff(smooth, axis=2)).mean() < np.abs(np.diff(volume, axis=2)).mean()
    np.testing.assert_array_equal(smooth[:, 1], operators.gaussian_smooth.fn(volume[:, 1:2], sigma=(0, 0, 2))[:, 0])


def test_semblance_is_one_for_identical_traces_and_low_for_noise():
    volume, _ = cosine_traces()
    np.testing.assert_allclose(operators.semblance.fn(volume), 1.0, atol=1e-6)
    noise = np.random.default_rng(5).standard_normal((16, 16, 60)).astype(np.float32)
    assert np.mean(operators.semblance.fn(noise, window=(1, 1, 4))) < 0.25  # ~1/9 for 9 independent traces


def test_semblance_drops_across_a_fault():
    volume = plane_wave(0.0, 0.0, shape=(6, 12, 60), period=10.0)
    volume[:, 6:] = np.roll(volume[:, 6:], 5, axis=2)  # half a period of throw at xline 6
    s = operators.semblance.fn(volume, window=(1, 1, 3))[:, :, 10:50]
    assert s[:, 5:7].mean() < 0.7 and s[:, :4].min() > 0.99


def test_trace_correlation_is_one_for_identical_traces_and_near_zero_for_noise():
    volume, _ = cosine_traces()
    np.testing.assert_allclose(operators.trace_correlation.fn(volume), 1.0, atol=1e-6)
    noise = np.random.default_rng(6).standard_normal((10, 10, 400)).astype(np.float32)
    assert abs(float(np.mean(operators.trace_correlation.fn(noise)))) < 0.05


def test_trace_correlation_memory_grows_faster_than_its_input():
    """Its dense (traces x traces) Gram matrix makes peak/input grow with the chunk's lateral size."""
    def peak_per_input_byte(shape):
        volume = layered_volume(shape, seed=8, noise=0.0)
        tracemalloc.start()
        try:
            operators.trace_correlation.fn(volume)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        return peak / volume.nbytes

    small, large = peak_per_input_byte((8, 8, 50)), peak_per_input_byte((32, 32, 50))
    assert large > 4 * small


# --------------------------------------------------------------------------- bad input


def test_convert_keeps_every_sample_as_it_is_non_finite_ones_included():
    volume = layered_volume((4, 5, 30), seed=2)
    volume[1, 1, 3], volume[2, 2, 4], volume[3, 3, 5] = np.nan, np.inf, -np.inf
    out = operators.convert.fn(volume)
    assert out.dtype == np.float32 and out.tobytes() == volume.tobytes()


@pytest.mark.parametrize("name", [n for n in ALL if n != "convert"])  # attributes: NaN where input is not finite
def test_nan_and_inf_samples_do_not_crash_and_stay_local(name):
    volume = layered_volume((12, 12, 60), seed=9)
    volume[6, 6, 30] = np.nan
    volume[1, 2, 5] = np.inf
    volume[10, 3, 50] = -np.inf
    op = operators.OPERATORS[name]
    out = op.fn(volume)
    assert out.shape == volume.shape and out.dtype == np.float32
    assert np.isnan(out[6, 6, 30]) and np.isnan(out[1, 2, 5]) and np.isnan(out[10, 3, 50])
    assert not np.isinf(out).any()
    halo = spec_of(op).halo_for({})
    expected = np.zeros(volume.shape, bool)
    for i, x, t in [(6, 6, 30), (1, 2, 5), (10, 3, 50)]:
        if name == "trace_correlation":  # a whole-trace attribute: the bad trace, left out of its neighbours
            expected[i, x, :] = True
        else:  # the outputs whose halo box holds the bad sample (just the sample for per-trace ones)
            expected[max(0, i - halo[0]):i + halo[0] + 1, max(0, x - halo[1]):x + halo[1] + 1,
                     max(0, t - halo[2]):t + halo[2] + 1] = True
    np.testing.assert_array_equal(np.isnan(out), expected)


def test_an_all_nan_block_gives_all_nan_without_crashing():
    volume = np.full((3, 3, 20), np.nan, np.float32)
    for name in ALL:
        assert np.isnan(operators.OPERATORS[name].fn(volume)).all(), name


@pytest.mark.parametrize("name", ALL)
def test_dead_data_does_not_crash(name):
    out = operators.OPERATORS[name].fn(np.zeros((3, 4, 20), np.float32))
    assert out.shape == (3, 4, 20) and not np.isinf(out).any()


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("block", [np.zeros((4, 20)), np.zeros((0, 3, 20)), np.zeros((2, 2, 0))],
                         ids=["2d", "no inlines", "no samples"])
def test_a_block_that_is_not_a_nonempty_3d_volume_is_refused(name, block):
    with pytest.raises(VolumeError, match=name):
        operators.OPERATORS[name].fn(block)


@pytest.mark.parametrize("call, message", [
    (lambda v: operators.gaussian_smooth.fn(v, sigma=-1), "sigma"),
    (lambda v: operators.gaussian_smooth.fn(v, sigma=(1, 2)), "sigma"),
    (lambda v: operators.gst3d_dip.fn(v, sigma_gradient=0), "sigma_gradient"),
    (lambda v: operators.gst3d_dip.fn(v, sigma_tensor=np.nan), "sigma_tensor"),
    (lambda v: operators.semblance.fn(v, window=1.5), "window"),
    (lambda v: operators.trace_correlation.fn(v, radius=(1, 1, 1)), "radius"),
    (lambda v: operators.instantaneous_frequency.fn(v, sample_interval_ms=0), "sample_interval_ms"),
])
def test_bad_parameters_are_refused_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call(np.ones((2, 2, 10), np.float32))


# --------------------------------------------------------------------------- docs and the memory table


def test_operator_memory_table_measures_each_operator_in_a_fresh_process(tmp_path):
    from benchmarks.studies import operator_memory

    out = tmp_path / "rows.json"
    assert operator_memory.main(["--shape", "6", "5", "40", "--operators", "gaussian_smooth,semblance",
                                 "--markdown", "--json", str(out)]) == 0
    rows = __import__("json").loads(out.read_text())
    assert [r["operator"] for r in rows] == ["gaussian_smooth", "semblance"]
    for r in rows:
        assert r["input_bytes"] == 6 * 5 * 40 * 4 and r["peak_bytes"] >= 0 and r["seconds"] > 0
    table = operator_memory.format_table(rows, markdown=True)
    assert table.splitlines()[0] == "| operator | input MiB | peak MiB | multiple | seconds |"
    assert len(table.splitlines()) == 4


def test_operator_memory_measures_with_the_parameters_given_and_refuses_params_that_are_not_an_object(tmp_path):
    from benchmarks.studies import operator_memory

    out = tmp_path / "rows.json"
    assert operator_memory.main(["--shape", "6", "5", "40", "--operators", "gaussian_smooth",
                                 "--params", '{"sigma": [2, 2, 2]}', "--json", str(out)]) == 0
    (row,) = __import__("json").loads(out.read_text())
    assert "sigma=2" in row["key"] and row["peak_bytes"] >= 0
    for bad in ("[6, 6, 6]", "{sigma: 6}"):
        with pytest.raises(SystemExit):
            operator_memory.main(["--operators", "gaussian_smooth", "--params", bad])


def test_operator_memory_puts_each_operator_on_the_cpu_and_the_gpu_side_by_side(tmp_path, monkeypatch):
    """On the (fake) GPU each row has the device's own peak beside the host's; the CPU row has none."""
    from benchmarks.studies import operator_memory

    monkeypatch.setenv("MEMCHUNK_FAKE_GPU_BYTES", str(1 << 30))  # the children inherit it
    out = tmp_path / "rows.json"
    assert operator_memory.main(["--shape", "8", "8", "60", "--operators", "gst3d_dip", "--device", "both",
                                 "--json", str(out)]) == 0
    cpu, gpu = __import__("json").loads(out.read_text())
    assert (cpu["device"], gpu["device"]) == ("cpu", "cuda") and gpu["key"].endswith("|cuda")
    assert "gpu_peak_bytes" not in cpu and gpu["gpu_peak_bytes"] > gpu["input_bytes"]
    assert gpu["gpu_multiple"] == gpu["gpu_peak_bytes"] / gpu["input_bytes"]
    table = operator_memory.format_table([cpu, gpu], markdown=True)
    assert table.splitlines()[0].endswith("| GPU peak MiB | GPU multiple |") and "| cuda |" in table
