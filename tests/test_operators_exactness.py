"""Exactness under chunking: the property the project lives on.

For every operator in ``operators.OPERATORS`` and any chunking — one chunk, one
inline per chunk, uneven chunks, chunks along both iline and xline, and ``twt``
cuts for operators that allow them — computing each chunk from a block read with
the operator's declared halo (clipped at the volume's edges by
:func:`memchunk_prefect.core.chunks.with_halo`), trimming, and assembling gives the
whole-volume result to ``max |error| <= 1e-5 * max |value|``, with NaN in the
same places.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memchunk_prefect import operators
from memchunk_prefect.core.chunks import Chunk, with_halo
from memchunk_prefect.operators import spec_of

RELATIVE_TOLERANCE = 1e-5


# --------------------------------------------------------------------------- volumes and chunkings


def layered_volume(shape, seed: int = 0, noise: float = 0.05) -> np.ndarray:
    """Smooth layered float32 data: dipping, folded reflectors (Ricker wavelets), a fault, noise.

    Deterministic by ``seed``; never constant along a trace (so dips are meaningful).
    """
    rng = np.random.default_rng(seed)
    n_il, n_xl, n_t = shape
    il, xl, t = np.meshgrid(np.arange(n_il), np.arange(n_xl), np.arange(n_t), indexing="ij")
    p_il, p_xl = rng.uniform(-0.6, 0.6, size=2)  # dip in samples per trace
    fold = rng.uniform(0.5, 2.0) * np.sin(2 * np.pi * il / max(n_il, 6) + rng.uniform(0, 6))
    throw = np.where(xl > n_xl // 2, rng.uniform(1.0, 3.0), 0.0)  # a fault along one crossline
    shift = p_il * il + p_xl * xl + fold + throw
    volume = np.zeros(shape)
    period = rng.uniform(5.0, 9.0)  # samples between reflectors
    a = (np.pi / rng.uniform(4.0, 6.0)) ** 2  # Ricker width
    for k, tau in enumerate(np.arange(-period * 3, n_t + period * 3, period)):
        arg = a * (t - tau - shift) ** 2
        volume += rng.uniform(-1.0, 1.0) * (1 - 2 * arg) * np.exp(-arg)
    volume += noise * rng.standard_normal(shape)
    return volume.astype(np.float32)


def cuts(draw, n: int, mode: str) -> list[int]:
    """Interior cut positions along an axis of length ``n``."""
    if mode == "whole" or n == 1:
        return []
    if mode == "each":
        return list(range(1, n))
    return sorted(draw(st.sets(st.integers(1, n - 1), min_size=1, max_size=min(4, n - 1))))


def chunks_from_cuts(shape, il_cuts, xl_cuts, t_cuts) -> list[Chunk]:
    edges = [[0, *c, n] for c, n in zip((il_cuts, xl_cuts, t_cuts), shape)]
    return [Chunk((i0, x0, t0), (i1, x1, t1))
            for i0, i1 in zip(edges[0], edges[0][1:])
            for x0, x1 in zip(edges[1], edges[1][1:])
            for t0, t1 in zip(edges[2], edges[2][1:])]


@st.composite
def chunkings(draw, shape, cut_twt: bool) -> list[Chunk]:
    """One chunk, one inline per chunk, uneven iline cuts, iline x xline cuts, and twt cuts where allowed."""
    il_mode = draw(st.sampled_from(["whole", "each", "random"]))
    xl_mode = draw(st.sampled_from(["whole", "each", "random"]))
    t_mode = draw(st.sampled_from(["whole", "random"])) if cut_twt else "whole"
    return chunks_from_cuts(shape, cuts(draw, shape[0], il_mode), cuts(draw, shape[1], xl_mode),
                            cuts(draw, shape[2], t_mode))


def run_chunked(op, volume: np.ndarray, chunks: list[Chunk], params: dict) -> np.ndarray:
    """Run ``op`` per chunk the way the runner does: read with halo, apply, trim, write the region."""
    halo = spec_of(op).halo_for(params)
    out = np.full(volume.shape, -12345.0, dtype=np.float32)
    written = np.zeros(volume.shape, dtype=np.int8)
    for chunk in chunks:
        read, trim = with_halo(chunk, halo, volume.shape)
        result = op.fn(volume[read.slices()], **params)
        assert result.shape == read.shape and result.dtype == np.float32
        out[chunk.slices()] = result[trim]
        written[chunk.slices()] += 1
    assert (written == 1).all(), "the chunks must tile the volume exactly once"
    return out


def assert_same(chunked: np.ndarray, whole: np.ndarray, what: str) -> None:
    nan_whole, nan_chunked = ~np.isfinite(whole), ~np.isfinite(chunked)
    assert np.array_equal(nan_whole, nan_chunked), f"{what}: NaN at different places"
    assert np.array_equal(whole[nan_whole], chunked[nan_whole], equal_nan=True), f"{what}: other non-finite values"
    if nan_whole.all():
        return
    scale = float(np.max(np.abs(whole[~nan_whole])))
    error = float(np.max(np.abs(chunked[~nan_whole].astype(np.float64) - whole[~nan_whole])))
    assert error <= RELATIVE_TOLERANCE * scale, f"{what}: max abs error {error:.3g} > 1e-5 x {scale:.3g}"


# --------------------------------------------------------------------------- parameters per operator


def _triple(elements):
    return st.tuples(elements, elements, elements)


PARAMS = {
    "convert": st.just({}),
    "envelope": st.just({}),
    "instantaneous_phase": st.just({}),
    "cosine_phase": st.just({}),
    "instantaneous_frequency": st.fixed_dictionaries({"sample_interval_ms": st.sampled_from([1.0, 2.0, 4.0])}),
    "gaussian_smooth": st.fixed_dictionaries({
        "sigma": st.one_of(st.sampled_from([0.0, 0.7, 1.0, 2.0]), _triple(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.5])))
    }),
    "gst3d_dip": st.fixed_dictionaries({
        "sigma_gradient": st.one_of(st.sampled_from([0.7, 1.0]), _triple(st.sampled_from([0.5, 1.0, 1.5]))),
        "sigma_tensor": st.one_of(st.sampled_from([0.0, 1.0, 2.0]), _triple(st.sampled_from([0.0, 0.5, 1.5]))),
    }),
    "semblance": st.fixed_dictionaries({
        "window": st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 5)))
    }),
    "trace_correlation": st.fixed_dictionaries({
        "radius": st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 2), st.integers(0, 2)))
    }),
}
PARAMS["gst3d_azimuth"] = PARAMS["gst3d_dip"]

SHAPES = st.tuples(st.integers(1, 9), st.integers(1, 9), st.integers(4, 40))


def test_every_operator_has_a_parameter_strategy():
    assert set(PARAMS) == set(operators.OPERATORS)


@pytest.mark.parametrize("name", sorted(operators.OPERATORS))
@settings(deadline=None, max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_chunked_equals_whole_volume(name, data):
    op = operators.OPERATORS[name]
    shape = data.draw(SHAPES, label="shape")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    params = data.draw(PARAMS[name], label="params")
    chunks = data.draw(chunkings(shape, cut_twt=not spec_of(op).whole_traces), label="chunks")
    volume = layered_volume(shape, seed)

    whole = op.fn(volume, **params)
    assert_same(run_chunked(op, volume, chunks, params), whole, f"{name}{params} on {len(chunks)} chunks")


@pytest.mark.parametrize("name", sorted(operators.OPERATORS))
@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_chunked_equals_whole_volume_with_nan_and_inf_samples(name, data):
    op = operators.OPERATORS[name]
    shape = data.draw(SHAPES, label="shape")
    params = data.draw(PARAMS[name], label="params")
    chunks = data.draw(chunkings(shape, cut_twt=not spec_of(op).whole_traces), label="chunks")
    volume = layered_volume(shape, data.draw(st.integers(0, 2**16), label="seed"))
    flat = volume.reshape(-1)
    bad = data.draw(st.lists(st.integers(0, flat.size - 1), min_size=1, max_size=3), label="bad samples")
    flat[bad] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]), label="value")

    whole = op.fn(volume, **params)
    assert not np.isfinite(whole).all()  # NaN where an attribute met a bad sample; convert keeps them as they are
    assert_same(run_chunked(op, volume, chunks, params), whole, f"{name}{params} with non-finite samples")


LAYOUTS = ["one chunk", "one inline per chunk", "uneven inlines", "iline x xline", "twt cuts"]


@pytest.mark.parametrize(
    "name, layout",
    # twt cuts only for operators that allow them: the planner never cuts traces of whole-trace operators.
    [(n, lay) for n in sorted(operators.OPERATORS) for lay in LAYOUTS
     if lay != "twt cuts" or not spec_of(operators.OPERATORS[n]).whole_traces],
)
def test_named_chunkings_on_a_realistic_volume(name, layout):
    """The chunkings the issue names, on a fixed 12 x 10 x 64 volume with default parameters."""
    op = operators.OPERATORS[name]
    shape = (12, 10, 64)
    chunks = {
        "one chunk": chunks_from_cuts(shape, [], [], []),
        "one inline per chunk": chunks_from_cuts(shape, list(range(1, 12)), [], []),
        "uneven inlines": chunks_from_cuts(shape, [1, 6, 7], [], []),
        "iline x xline": chunks_from_cuts(shape, [5], [3, 4, 9], []),
        "twt cuts": chunks_from_cuts(shape, [7], [5], [10, 31, 33]),
    }[layout]
    volume = layered_volume(shape, seed=7)
    assert_same(run_chunked(op, volume, chunks, {}), op.fn(volume), f"{name} on {layout}")


@pytest.mark.parametrize("name", sorted(operators.OPERATORS))
def test_chunked_equals_whole_on_the_synthetic_survey_volume(name):
    """The package's own synthetic survey (folds, a fault, Ricker wavelet), cut along iline and xline."""
    from memchunk_prefect.io.synthetic import synthetic_volume

    op = operators.OPERATORS[name]
    shape = (16, 14, 80)
    volume = synthetic_volume(shape, seed=3)
    t_cuts = [] if spec_of(op).whole_traces else [27, 50]
    chunks = chunks_from_cuts(shape, [3, 4, 11], [6, 13], t_cuts)
    assert_same(run_chunked(op, volume, chunks, {}), op.fn(volume), f"{name} on the synthetic survey")
