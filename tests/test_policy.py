"""The policy's decisions, as tables: shapes, budgets and predictions in; chunkings and decisions out."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memchunk_prefect.core.budget import task_budget_bytes
from memchunk_prefect.core.chunks import Chunk, covers_exactly, extents_with_halo, with_halo
from memchunk_prefect.core.errors import BudgetError, BudgetTooSmallError
from memchunk_prefect.core.estimates import Estimates, FirstTouch
from memchunk_prefect.core.plans import CONTINUE, PROBE, RECHUNK
from memchunk_prefect.core.policy import decide, plan, split_chunk
from memchunk_prefect.core.probe import probe_plan
from memchunk_prefect.core.records import Prediction
from memchunk_prefect.core.replan import remaining_boxes
from memchunk_prefect.core.settings import PolicySettings


def linear(multiple: float, overhead: float = 0.0, ready: bool = True, spread: float = 1.1):
    """A model whose peak is overhead + multiple x input bytes (float32), bound = spread x mean."""

    def predict(ext):
        n = math.prod(ext)
        mean = overhead + multiple * 4 * n
        return Prediction(mean_bytes=mean, upper_bytes=spread * mean, n_observations=10 if ready else 0,
                          ready=ready)

    return predict


MiB = 2**20


@pytest.mark.parametrize(
    "shape, multiple, budget, slots, expect_chunks",
    [
        # Light operator, everything fits: one chunk per slot (never fewer chunks than slots).
        ((64, 64, 100), 2, 1000 * MiB, 2, 2),
        ((64, 64, 100), 2, 1000 * MiB, 4, 4),
        # Heavy operator: 64*64*100*4 B = 1.56 MiB input; x60 = 94 MiB (x1.1 bound = 103 MiB) in one piece.
        ((64, 64, 100), 60, 40 * MiB, 1, 3),
        ((64, 64, 100), 60, 40 * MiB, 2, 4),
    ],
)
def test_plan_picks_fewest_balanced_chunks_that_fit_and_fill_slots(shape, multiple, budget, slots, expect_chunks):
    p = plan(shape, budget_bytes=budget, estimates=linear(multiple), slots=slots)
    assert p.n_chunks == expect_chunks
    assert covers_exactly(p.chunks, shape)
    assert p.upper_bound_bytes <= budget
    assert all(c.shape[2] == shape[2] for c in p.chunks), "whole traces are kept by default"
    sizes = [c.elements for c in p.chunks]
    assert max(sizes) - min(sizes) <= max(sizes) // 4 + shape[1] * shape[2], "chunks are balanced"


def test_a_plan_counts_growing_fresh_workers_memory_once_and_takes_smaller_chunks_where_that_costs_more():
    """192 x 192 x 100 at 160 B/element on 2 slots, 1 us/element: 2 chunks compute in the least time, but each
    fresh worker grows ~295 MB for them at 1.5 s/GiB (0.41 s); smaller chunks grow less and overlap it."""
    shape, spe, spb = (192, 192, 100), 1e-6, 1.5 / 2**30
    s = PolicySettings(seconds_per_element=spe, per_task_overhead_seconds=0.05)
    none = plan(shape, budget_bytes=4 * 2**30, estimates=linear(40), slots=2, settings=s)
    fresh = plan(shape, budget_bytes=4 * 2**30, estimates=Estimates(predict=linear(40), first_touch=FirstTouch(touched_bytes=0, seconds_per_byte=spb)), slots=2, settings=s)
    held = plan(shape, budget_bytes=4 * 2**30, estimates=Estimates(predict=linear(40), first_touch=FirstTouch(touched_bytes=2**30, seconds_per_byte=spb)), slots=2, settings=s)
    assert none.n_chunks == held.n_chunks == 2
    assert held.estimated_seconds == pytest.approx(none.estimated_seconds)
    assert fresh.n_chunks > 2, fresh.reason
    grow = fresh.predicted_peak_bytes * spb
    assert fresh.estimated_seconds == pytest.approx(
        math.ceil(fresh.n_chunks / 2) * (0.05 + spe * math.prod(fresh.chunk_shape)) + grow)
    assert fresh.estimated_seconds < none.estimated_seconds + 160 * math.prod(none.chunk_shape) * spb
    assert "above the most they have held" in fresh.reason and "above the most" not in held.reason
    # Energy: the kernel's growing time is busy on each slot the first wave fills.
    e = PolicySettings(seconds_per_element=spe, per_task_overhead_seconds=0.05, objective="energy")
    touch = FirstTouch(touched_bytes=0, seconds_per_byte=spb)
    joules = plan(shape, budget_bytes=4 * 2**30, estimates=Estimates(predict=linear(40), first_touch=touch), slots=2, settings=e)
    flat = plan(shape, budget_bytes=4 * 2**30, estimates=linear(40), slots=2, settings=e)
    assert joules.n_chunks > flat.n_chunks == 2
    two = flat.estimated_joules + 2 * touch.seconds(flat.predicted_peak_bytes) * e.watts_per_core
    assert joules.estimated_joules < two


def test_plan_counts_the_halo_against_the_budget():
    shape = (64, 64, 100)
    no_halo = plan(shape, budget_bytes=40 * MiB, estimates=linear(60), slots=1)
    with_h = plan(shape, budget_bytes=40 * MiB, estimates=linear(60), slots=1, halo=(8, 8, 0))
    assert with_h.n_chunks > no_halo.n_chunks
    for c in with_h.chunks:
        read, _ = with_halo(c, (8, 8, 0), shape)
        assert linear(60)(read.shape).upper_bytes <= 40 * MiB


def test_per_task_overhead_makes_one_chunk_per_slot_win_when_memory_allows():
    shape = (256, 256, 100)
    p = plan(shape, budget_bytes=10_000 * MiB, estimates=linear(2), slots=2,
             settings=PolicySettings(per_task_overhead_seconds=10.0, seconds_per_element=1e-9))
    assert p.n_chunks == 2
    assert p.estimated_seconds == pytest.approx(10.0 + 128 * 256 * 100 * 1e-9)


def test_operator_that_may_cut_traces_gets_twt_cuts_only_when_needed():
    shape = (2, 2, 100_000)
    p = plan(shape, budget_bytes=4 * 60 * 50_000, estimates=linear(50, spread=1.0), slots=1, whole_traces=False)
    assert p.n_chunks >= 4
    assert any(c.shape[2] < shape[2] for c in p.chunks)
    with pytest.raises(BudgetTooSmallError, match="whole traces"):
        plan(shape, budget_bytes=4 * 60 * 50_000, estimates=linear(50, spread=1.0), slots=1, whole_traces=True)


def test_impossible_budget_is_a_clear_error_naming_the_figures():
    with pytest.raises(BudgetTooSmallError) as err:
        plan((10, 10, 1000), budget_bytes=1000, estimates=linear(60), slots=1)
    msg = str(err.value)
    assert "1000 B" in msg or "1000" in msg
    assert "budget" in msg and "memory_limit" in msg


@pytest.mark.parametrize("bad", [0, -5, None])
def test_non_positive_budget_is_refused(bad):
    with pytest.raises(BudgetError):
        plan((4, 4, 4), budget_bytes=bad, estimates=linear(1), slots=1)


def test_no_history_gives_a_wave_of_equal_probes_one_per_slot_and_a_plannable_remainder():
    shape = (50, 40, 200)
    p = plan(shape, budget_bytes=200 * MiB, estimates=linear(5, ready=False), slots=3)
    assert p.probe and p.decision == PROBE
    widths = [c.shape[1] for c in p.chunks]
    assert len(p.chunks) == 3 and max(widths) - min(widths) <= 1, "one per slot, of one size (to a trace)"
    assert len({c.shape[0] for c in p.chunks}) == 1
    assert covers_exactly(p.chunks + p.remainder, shape)
    # The first wave: an eighth of the largest block an operator needing 100x its input fits.
    assert all(100 * 4 * c.elements <= 200 * MiB * 0.125 for c in p.chunks)
    assert all(100 * 4 * c.elements > 200 * MiB * 0.125 / 2 for c in p.chunks), "as large as that allows"


@pytest.mark.parametrize("on_gpu", [False, True], ids=["host", "gpu"])
def test_a_probe_is_never_a_size_the_model_already_bounds_over_the_budget(on_gpu):
    """Found on an H100: a run after one whose chunks ran out of the GPU's memory, still short of history,
    probed again with chunks of the size that had run out. A block at least as large as one that ran out is
    bounded above the budget (the model's out-of-memory floor); the probes stay below that size."""
    from memchunk_prefect.core.estimates import GpuLimit

    shape, budget, failed_at = (50, 40, 200), 200 * MiB, 2000  # blocks of >= 2000 elements ran out

    def with_floor(ext):
        n = math.prod(ext)
        upper = 3 * budget if n >= failed_at else 4.0 * n
        return Prediction(mean_bytes=upper, upper_bytes=upper, n_observations=2, ready=False)

    unknown = linear(5, ready=False)
    free = plan(shape, budget_bytes=budget, estimates=unknown, slots=2)
    assert max(c.elements for c in free.chunks) >= failed_at, "without the floor the probes are larger"
    p = (plan(shape, budget_bytes=budget, estimates=Estimates(predict=unknown, gpu=GpuLimit(with_floor, budget)), slots=2) if on_gpu
         else plan(shape, budget_bytes=budget, estimates=with_floor, slots=2))
    assert p.probe and len(p.chunks) >= 2
    assert max(c.elements for c in p.chunks) < failed_at
    assert covers_exactly(p.chunks + p.remainder, shape)


@given(shape=st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(1, 50)),
       budget=st.integers(10_000, 10_000_000), slots=st.integers(1, 8), whole=st.booleans(),
       halo=st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3)))
@settings(max_examples=60, deadline=None)
def test_probe_and_remainder_always_tile_the_volume(shape, budget, slots, whole, halo):
    try:
        p = probe_plan(shape, budget_bytes=budget, slots=slots, whole_traces=whole, halo=halo)
    except BudgetTooSmallError:
        # Refused only when the smallest block allowed, with its halo, cannot hold its input and output.
        smallest = extents_with_halo((1, 1, shape[2] if whole else 1), halo, shape)
        assert 2 * 4 * math.prod(smallest) > budget
        return
    assert covers_exactly(p.chunks + p.remainder, shape)


@given(shape=st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 60)),
       multiple=st.floats(1, 80), budget_mib=st.floats(0.05, 50), slots=st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_any_plan_tiles_the_volume_and_fits_or_refuses(shape, multiple, budget_mib, slots):
    budget = int(budget_mib * MiB)
    try:
        p = plan(shape, budget_bytes=budget, estimates=linear(multiple), slots=slots)
    except BudgetTooSmallError:
        one_trace = linear(multiple)((1, 1, shape[2])).upper_bytes
        assert one_trace > budget
        return
    assert covers_exactly(p.chunks, shape)
    assert p.upper_bound_bytes <= budget


def test_decide_continues_when_incoming_chunking_fits_and_is_near_best():
    shape = (64, 64, 100)
    incoming = plan(shape, budget_bytes=1000 * MiB, estimates=linear(2), slots=2).chunks
    d = decide(shape, incoming, budget_bytes=1000 * MiB, estimates=linear(3), slots=2)
    assert d.decision == CONTINUE
    assert d.plan.chunks == incoming


def test_decide_rechunks_for_a_heavy_operator_after_a_light_one():
    shape = (64, 64, 100)
    incoming = plan(shape, budget_bytes=40 * MiB, estimates=linear(2), slots=2).chunks
    d = decide(shape, incoming, budget_bytes=40 * MiB, estimates=linear(60), slots=2)
    assert d.decision == RECHUNK
    assert "over the budget" in d.reason
    assert d.plan.upper_bound_bytes <= 40 * MiB


def test_decide_rechunks_when_incoming_is_much_slower_than_best():
    shape = (64, 64, 100)
    tiny = [Chunk((i, 0, 0), (i + 1, 64, 100)) for i in range(64)]
    d = decide(shape, tiny, budget_bytes=1000 * MiB, estimates=linear(2), slots=2)
    assert d.decision == RECHUNK and "estimated" in d.reason


def test_decide_probes_without_history():
    d = decide((16, 16, 50), None, budget_bytes=100 * MiB, estimates=linear(2, ready=False), slots=2)
    assert d.decision == PROBE


@pytest.mark.parametrize(
    "chunk, whole, expect",
    [
        (Chunk((0, 0, 0), (8, 4, 100)), True, [((0, 0, 0), (4, 4, 100)), ((4, 0, 0), (8, 4, 100))]),
        (Chunk((0, 0, 0), (1, 4, 100)), True, [((0, 0, 0), (1, 2, 100)), ((0, 2, 0), (1, 4, 100))]),
        (Chunk((0, 0, 0), (1, 1, 100)), True, []),
        (Chunk((0, 0, 0), (1, 1, 100)), False, [((0, 0, 0), (1, 1, 50)), ((0, 0, 50), (1, 1, 100))]),
        (Chunk((0, 0, 0), (1, 1, 1)), False, []),
    ],
)
def test_split_halves_along_the_longest_allowed_axis(chunk, whole, expect):
    assert [(c.start, c.stop) for c in split_chunk(chunk, whole_traces=whole)] == expect


@pytest.mark.parametrize(
    "limit, threads, fraction, resting, expect",
    [(4 * 2**30, 1, 0.75, 0, 3 * 2**30), (4 * 2**30, 2, 0.75, 0, int(1.5 * 2**30)),
     (4 * 2**30, 1, 0.5, 2**30, 2**30),
     # The resting memory is the process's, paid once: (3 GiB - 1 GiB) / 2 threads, not 1.5 GiB - 1 GiB each.
     (4 * 2**30, 2, 0.75, 2**30, 2**30)],
)
def test_task_budget_from_worker_memory(limit, threads, fraction, resting, expect):
    assert task_budget_bytes(limit, threads, target_fraction=fraction, resting_bytes=resting) == expect


def test_budget_with_no_memory_limit_says_what_to_do():
    with pytest.raises(BudgetError, match="memory_limit"):
        task_budget_bytes(0, 1)
    with pytest.raises(BudgetTooSmallError):
        task_budget_bytes(2**30, 1, resting_bytes=2**30)


def test_remaining_boxes_merge_full_bands_and_keep_partial_ones():
    shape = (12, 10, 5)
    p = plan(shape, budget_bytes=10 * MiB, estimates=linear(1), slots=1)
    full = [Chunk((i, 0, 0), (i + 2, 5, 5)) for i in range(0, 12, 2)] + [
        Chunk((i, 5, 0), (i + 2, 10, 5)) for i in range(0, 12, 2)]
    pending = [c for c in full if not (c.start[0] == 0 and c.start[1] == 0)]
    boxes, kept = remaining_boxes(pending)
    assert boxes == [Chunk((2, 0, 0), (12, 10, 5))]
    assert kept == [Chunk((0, 5, 0), (2, 10, 5))]
    assert p.n_chunks >= 1


def test_without_history_a_budget_smaller_than_one_trace_in_and_out_is_refused_before_probing():
    # 1 x 1 x 1000 float32 trace = 4000 B; input + output = 8000 B > 6000 B.
    with pytest.raises(BudgetTooSmallError, match="one trace"):
        plan((10, 10, 1000), budget_bytes=6000, estimates=linear(1, ready=False), slots=1)
    assert plan((10, 10, 1000), budget_bytes=9000, estimates=linear(1, ready=False), slots=1).probe


def test_an_operator_whose_time_grows_with_the_square_of_the_chunk_is_cut_finer_than_one_slot_each():
    from memchunk_prefect.core.policy import plan as make_plan

    shape = (64, 64, 100)
    cheap = lambda ext: Prediction(mean_bytes=10.0 * math.prod(ext), upper_bytes=12.0 * math.prod(ext),  # noqa: E731
                                   n_observations=10, ready=True)
    proportional = make_plan(shape, budget_bytes=10**9, estimates=Estimates(cheap, seconds_per_element=1e-6),
                             slots=2)
    quadratic = make_plan(shape, budget_bytes=10**9, slots=2,
                          estimates=Estimates(cheap, seconds_per_element=1e-6, seconds_for=lambda e: 1e-11 * e * e))
    assert proportional.n_chunks == 2, "time proportional to size: one chunk per slot is best"
    assert quadratic.n_chunks > 2, "time quadratic in size: smaller chunks are cheaper per element"
    assert quadratic.estimated_seconds < 2 * (1e-11 * (32 * 64 * 100) ** 2 + 0.15)


def test_a_slab_is_bounded_by_the_block_it_reads_with_its_halo_clipped_at_the_volume_edges():
    from memchunk_prefect.core.policy import plan as make_plan

    # 128 ilines in two slabs read 64 + 12 ilines each (halo on one side); an interior 64-iline chunk
    # would read 88. The budget holds the first and not the second.
    per = lambda ext: Prediction(mean_bytes=100.0 * math.prod(ext), upper_bytes=100.0 * math.prod(ext),  # noqa: E731
                                 n_observations=10, ready=True)
    budget = 100 * 80 * 8 * 10
    p = make_plan((128, 8, 10), budget_bytes=budget, estimates=per, halo=(12, 12, 0), slots=2, whole_traces=False)
    assert p.n_chunks == 2 and p.upper_bound_bytes == 100.0 * 76 * 8 * 10


# --------------------------------------------------------------------------- a granularity arm's range


def test_a_read_range_keeps_plans_to_blocks_of_that_size_and_says_when_none_fits():
    from memchunk_prefect.core.plans import NoPlanInRangeError

    lin = lambda ext: Prediction(8.0 * math.prod(ext), 10.0 * math.prod(ext), 10, True)  # noqa: E731
    free = plan((64, 64, 100), budget_bytes=10**9, estimates=lin, slots=2)
    largest = max(c.elements for c in free.chunks)
    finer = plan((64, 64, 100), budget_bytes=10**9, estimates=lin, slots=2, read_range=(0.0, largest / 1.5))
    assert max(c.elements for c in finer.chunks) <= largest / 1.5 < largest
    coarser = plan((64, 64, 100), budget_bytes=10**9, estimates=lin, slots=4, read_range=(largest * 1.5, math.inf))
    assert min(c.elements for c in coarser.chunks) >= largest * 1.5 / 2  # balanced pieces of a larger block
    with pytest.raises(NoPlanInRangeError) as info:
        plan((64, 64, 100), budget_bytes=10**9, estimates=lin, slots=2, read_range=(10.0**9, math.inf))
    assert "fit the budget" in str(info.value) and "1,000,000,000" in str(info.value)


def test_incoming_chunks_outside_the_read_range_are_rechunked_not_kept():
    lin = lambda ext: Prediction(8.0 * math.prod(ext), 10.0 * math.prod(ext), 10, True)  # noqa: E731
    incoming = [Chunk((0, 0, 0), (32, 64, 100)), Chunk((32, 0, 0), (64, 64, 100))]
    kept = decide((64, 64, 100), incoming, budget_bytes=10**9, estimates=lin, slots=2)
    assert kept.decision == CONTINUE
    d = decide((64, 64, 100), incoming, budget_bytes=10**9, estimates=lin, slots=2, read_range=(0.0, 32 * 64 * 100 / 1.5))
    assert d.decision == RECHUNK and "outside the" in d.reason and len(d.plan.chunks) > 2


def test_a_bound_over_the_budget_where_the_mean_fits_is_too_little_known_so_it_probes_instead_of_failing():
    """Few or noisy runs (a worker of several threads measures its tasks mixed) can bound even one trace over the
    budget while its mean fits: that is not too little memory. Probe with chunks sized for the budget; fail only
    on the mean."""
    wide = lambda ext: Prediction(mean_bytes=100.0 * math.prod(ext), upper_bytes=400.0 * math.prod(ext),  # noqa: E731
                                  n_observations=5, ready=True)
    p = plan((16, 16, 10), budget_bytes=300 * 10, estimates=wide, slots=2)
    assert p.probe and "too little known" in p.reason and "its mean" in p.reason
    with pytest.raises(BudgetTooSmallError, match="even the smallest chunk"):
        plan((16, 16, 10), budget_bytes=90 * 10, estimates=wide, slots=2)
