"""The chunked map's rules, one table row each: events in, instructions out, no cluster (milliseconds).

The same rules run for real in tests/test_runner.py, test_interruptions.py and
test_faults.py (real workers killed by their nanny, real Ctrl-C, a real lost
scheduler); here each rule is pinned down on its own, including the
interleavings those cluster tests found.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass, field, replace

import pytest

from memchunk_prefect.core.budget import is_memory_kill
from memchunk_prefect.core.chunks import Chunk, covers_exactly
from memchunk_prefect.core.deaths import DeathEvidence
from memchunk_prefect.core.errors import BudgetTooSmallError, ChunkOutOfMemoryError, ClusterLostError
from memchunk_prefect.core.machine import MapMachine, MapStateError
from memchunk_prefect.core.messages import (
    DEFERRED,
    KILLED,
    LOST,
    MEMORY_ERROR,
    OK,
    Cancel,
    ChunkDeferred,
    ChunkDone,
    ChunkEnded,
    ChunkFailed,
    ChunkOutOfMemory,
    ClusterLost,
    Decided,
    Fail,
    Finalize,
    FirstUseExpected,
    MapSpec,
    MarkersRecovered,
    MarkRuns,
    PausesRead,
    ReadPauses,
    Record,
    Rewarded,
    SlotsChanged,
    Start,
    Stop,
    Stopped,
    Submit,
    UpstreamWritten,
    WorkerDied,
    WorkerStands,
)
from memchunk_prefect.core.plans import Plan
from memchunk_prefect.core.records import Observation, Pause, Prediction, Reward
from memchunk_prefect.core.settings import PolicySettings
from memchunk_prefect.core.standing import WorkerStanding
from memchunk_prefect.learn.bandit import ArmLearner
from memchunk_prefect.run.observe import observer_event
from memchunk_prefect.run.taskruns import mark_runs

KEY = "op|float32|cpu"
MiB = 2**20


@dataclass
class Linear:
    """A fake model: ``bytes_per_element`` per element held, the bound 20% above; switchable.

    ``tight``: the tight bound as a multiple of the mean (None: the same as the
    bound, so every arm of the learned policy plans alike); the arm is chosen by
    a real (pure) :class:`ArmLearner`.
    """

    bytes_per_element: float = 100.0
    ready: bool = True
    spe: float | None = 1e-6
    tight: float | None = None
    learner: ArmLearner = field(default_factory=lambda: ArmLearner(KEY))
    touch: float | None = None  # kernel seconds per byte a run pays to grow its worker (None: not learned)

    def predict(self, extents):
        mean = self.bytes_per_element * math.prod(extents)
        return Prediction(mean, 1.2 * mean, 10 if self.ready else 0, self.ready, "" if self.ready else "too little",
                          tight_bytes=None if self.tight is None else self.tight * mean)

    def seconds_per_element(self):
        return self.spe

    def seconds_for(self, elements):
        return None  # time proportional to size

    def joules_for(self, elements):
        return None  # no energy learned: seconds x watts_per_core

    def touch_seconds_per_byte(self):
        return self.touch

    def first_call_seconds(self):
        return None

    def choose_arm(self, groups):
        return self.learner.choose(groups)


def machine(shape=(8, 8, 10), *, knowledge=None, halo=(0, 0, 0), whole_traces=True, incoming=None, gated=False,
            **settings):
    spec = MapSpec(operator="op", operator_key=KEY, shape=shape, halo=halo, whole_traces=whole_traces,
                   output_path="/out.zarr", incoming=incoming, settings=PolicySettings(**settings), gated=gated)
    return MapMachine(spec, knowledge or Linear())


def obs(chunk: Chunk, peak=1000, outcome="ok", censored=False, at=0.0) -> Observation:
    return Observation(KEY, chunk.elements, chunk.shape, chunk.elements * 4, peak, seconds=0.1, outcome=outcome,
                       censored=censored, chunk=chunk.key(), created_at=at)


def of(kind, instructions):
    return [i for i in instructions if isinstance(i, kind)]


def kinds(instructions):
    return [type(i).__name__ for i in instructions]


def answered(m: MapMachine, instructions, pauses=()):
    """``instructions`` and what the machine says to the answer an executor gives to :class:`ReadPauses`."""
    out = list(instructions)
    for ins in of(ReadPauses, instructions):
        out += m.handle(PausesRead(tuple(pauses), at=ins.until))
    return out


def started(m: MapMachine, slots=2, budget=10 * MiB, **start):
    first = m.handle(Start(slots, budget, **start))
    return first, m.advance()


# =========================================================================== starting a map


def test_a_warm_start_decides_once_then_submits_up_to_the_in_flight_cap():
    m = machine((64, 8, 10), max_counts=64)
    # 64 x 8 x 10 x 100 B x 1.2 = 614 KiB whole; a 100 KiB budget forces many chunks.
    first, submitted = started(m, slots=2, budget=100 * 1024)
    (d,) = of(Decided, first)
    assert d.record.decision == "rechunk" and d.record.n_chunks > 4
    assert kinds(submitted) == ["Submit"] * 4, "2 slots: 2 per slot in flight, the rest stays re-plannable"
    assert len(m.queue) == d.record.n_chunks - 4
    assert all(s.upper_bytes <= 100 * 1024 for s in of(Submit, submitted))


def test_fresh_workers_make_a_plan_count_what_growing_their_memory_costs_and_a_touched_worker_does_not():
    """64 x 64 x 100 at 2000 B/element (819 MB whole) on 2 slots, 1 us/element, 0.15 s per task: in 2 chunks the
    compute is least, but each fresh worker grows by 410 MB at 1.5 s/GiB (0.57 s, once); 4 chunks grow 205 MB."""
    knowledge = Linear(bytes_per_element=2000, touch=1.5 / 2**30)
    cold = machine((64, 64, 100), knowledge=knowledge)
    (d,) = of(Decided, started(cold, budget=2 * 2**30, touched_bytes={"w1": 0, "w2": 0})[0])
    assert d.record.n_chunks > 2, d.record.reason
    assert "above the most they have held" in d.record.reason
    # Workers that have held 1 GiB per task already pay nothing: the fewest chunks win again, as without a mark.
    warm = machine((64, 64, 100), knowledge=Linear(bytes_per_element=2000, touch=1.5 / 2**30))
    (dw,) = of(Decided, started(warm, budget=2 * 2**30, touched_bytes={"w1": 2**30, "w2": 2**30})[0])
    unread = machine((64, 64, 100), knowledge=Linear(bytes_per_element=2000, touch=1.5 / 2**30))
    (du,) = of(Decided, started(unread, budget=2 * 2**30)[0])
    assert dw.record.n_chunks == du.record.n_chunks == 2
    assert "above the most" not in dw.record.reason
    # A run's peak raises its worker's mark; the least touched worker is what a plan waits for.
    sid = next(iter(cold.in_flight))  # submitted by started()
    chunk = cold.in_flight[sid].chunk
    cold.handle(ChunkDone(sid, replace(obs(chunk, peak=300 * MiB), worker="w1")))
    assert cold.touched == {"w1": 300 * MiB, "w2": 0}
    assert cold._first_touch().touched_bytes == 0


def test_a_budget_that_forces_thousands_of_tiny_chunks_is_a_warning_naming_the_budget_and_the_fix():
    # 200 x 200 traces of 10 samples at 100 B/element (bound 120): a 12 KiB budget holds ~10 traces a chunk.
    m = machine((200, 200, 10), max_counts=4096, many_chunks=1000)
    first, _ = started(m, slots=2, budget=12 * 1024)
    (d,) = of(Decided, first)
    assert d.record.n_chunks >= 1000
    w = d.record.warning
    assert w and f"{d.record.n_chunks} chunks" in w and "12.0 KiB per task" in w and "more memory" in w, w
    assert observer_event(d)[1].to_dict()["warning"] == w
    again = Plan(chunks=[Chunk((0, 0, 0), (1, 9, 10))] * 2000, chunk_shape=(1, 9, 10), predicted_peak_bytes=1.0,
                 upper_bound_bytes=1.0, budget_bytes=12 * 1024, estimated_seconds=1.0)
    assert m._overhead_warning(again) is None, "said once a map, not at every re-plan"
    # The same map with a budget for large chunks: no warning.
    m = machine((200, 200, 10), max_counts=4096, many_chunks=1000)
    first, _ = started(m, slots=2, budget=100 * MiB)
    assert of(Decided, first)[0].record.warning is None


@pytest.mark.parametrize("slots, per_slot, cap", [(1, 2, 2), (2, 2, 4), (4, 1, 5), (3, 3, 9)])
def test_the_in_flight_cap_is_per_slot_and_at_least_one_more_than_the_slots(slots, per_slot, cap):
    assert PolicySettings(in_flight_per_slot=per_slot).in_flight_cap(slots) == cap


def test_an_incoming_chunking_that_fits_and_is_near_the_best_is_kept():
    incoming = tuple(Chunk((i, 0, 0), (i + 4, 8, 10)) for i in range(0, 8, 4))
    m = machine(incoming=incoming)
    first, submitted = started(m, budget=10 * MiB)
    assert of(Decided, first)[0].record.decision == "continue"
    assert [s.chunk for s in of(Submit, submitted)] == list(incoming)


def test_a_budget_nothing_fits_fails_the_map_before_anything_runs():
    m = machine(knowledge=Linear(bytes_per_element=1e6))
    first, submitted = started(m, budget=1000)
    (fail,) = of(Fail, first)
    assert isinstance(fail.error, BudgetTooSmallError) and submitted == [] and m.finished


def test_a_restart_is_recorded_before_the_chunking_decision():
    first, _ = started(machine(), restarted="it was computed from other task code")
    assert [d.record.decision for d in of(Decided, first)] == ["restart", "rechunk"]
    assert "other task code" in of(Decided, first)[0].record.reason


# =========================================================================== a map over a map still running


def _slabs(n, step, shape=(8, 8, 10)):
    return tuple(Chunk((i, 0, 0), (min(i + step, n), shape[1], shape[2])) for i in range(0, n, step))


def test_a_gated_chunk_runs_once_the_upstream_wrote_every_element_its_block_reads():
    """Planned at once from the upstream's plan; each chunk waits (not on a slot) for the upstream chunks its block
    reads, halo included, and runs as soon as they are written, in whatever order they come."""
    incoming = _slabs(8, 4)  # the upstream's plan: ilines 0:4 and 4:8
    m = machine(incoming=incoming, halo=(1, 0, 0), gated=True)
    first, submitted = started(m, slots=2, budget=10 * MiB)
    assert of(Decided, first)[0].record.decision == "continue"
    assert submitted == [] and m.waiting_upstream, "nothing written upstream: nothing runs, nothing is finished"
    # 0:4 written: chunk 0:4 reads 0:5 (halo 1), not yet covered; 4:8 reads 3:8, not either.
    assert m.handle(UpstreamWritten((incoming[0],))) == [] and m.advance() == []
    # The upstream re-cut its second half (a re-plan, a split): iline 4:5 written -> 0:4 may run.
    m.handle(UpstreamWritten((Chunk((4, 0, 0), (5, 8, 10)),)))
    assert [s.chunk for s in of(Submit, m.advance())] == [incoming[0]]
    m.handle(UpstreamWritten((Chunk((5, 0, 0), (8, 8, 10)),)))
    assert [s.chunk for s in of(Submit, m.advance())] == [incoming[1]], "coverage is by element, any cut"


def test_a_gated_map_finishes_only_after_its_own_chunks_and_opens_when_the_upstream_completes():
    incoming = _slabs(8, 4)
    m = machine(incoming=incoming, halo=(1, 0, 0), gated=True)
    started(m, slots=2, budget=10 * MiB)
    m.handle(UpstreamWritten((), complete=True))
    subs = of(Submit, m.advance())
    assert [s.chunk for s in subs] == list(incoming), "a finished upstream opens the gate for every chunk"
    out = []
    for s in subs:
        out += m.handle(ChunkDone(s.id, obs(s.chunk)))
    assert of(Finalize, m.advance()) and m.finished


def test_a_chained_maps_reward_does_not_count_the_time_it_waited_for_the_upstreams_writes():
    """Seconds with nothing in flight and every queued chunk waiting for the upstream are the upstream's, not the
    plan's: the arm's wall leaves them out, so a plan is not taught it was slow because its input came late."""
    incoming = _slabs(8, 4)
    m = machine(incoming=incoming, gated=True, knowledge=Linear(spe=1e-3))
    m.handle(Start(2, 10 * MiB, at=0.0))
    assert m.advance(0.0) == [] and m.arm is not None
    m.handle(UpstreamWritten((incoming[0],), at=0.0))
    (first,) = of(Submit, m.advance(0.0))
    m.handle(ChunkDone(first.id, obs(first.chunk), at=1.0))
    assert m.advance(1.0) == [] and m.waiting_upstream  # 1 s .. 11 s: the second chunk's input is not written
    m.handle(UpstreamWritten((incoming[1],), complete=True, at=11.0))
    (second,) = of(Submit, m.advance(11.0))
    m.handle(ChunkDone(second.id, obs(second.chunk), at=12.0))
    (r,) = of(Rewarded, answered(m, m.advance(12.0)))
    assert r.reward.wall_seconds == pytest.approx(2.0), "12 s from first submission to last end, 10 s waiting"
    assert r.reward.efficiency == pytest.approx(min(1.0, 640 * 1e-3 / (2 * 2.0)))


def test_an_ungated_map_is_unchanged_by_upstream_events():
    m = machine(incoming=_slabs(8, 4))
    _, submitted = started(m, slots=2, budget=10 * MiB)
    assert len(of(Submit, submitted)) == 2 and not m.waiting_upstream
    assert m.handle(UpstreamWritten((Chunk((0, 0, 0), (1, 8, 10)),))) == []


# =========================================================================== cold start


def test_cold_start_probes_twice_then_plans_every_box_left_once():
    """Cold: a small first wave (one equal probe per slot), a second wave sized from what it measured, then every
    box left planned once."""
    know = Linear(ready=False)
    m = machine((64, 40, 10), knowledge=know)
    budget = 100 * 4 * 4800  # the largest probe an operator needing 100x its input fits: 4,800 elements
    first, probes = started(m, slots=2, budget=budget)
    assert of(Decided, first)[0].record.decision == "probe"
    wave1 = of(Submit, probes)
    assert len(wave1) == 2 and len({s.chunk.elements for s in wave1}) == 1, "one per slot, of one size"
    assert all(s.chunk.elements <= 4800 * 0.125 for s in wave1), "the first wave: an eighth of the largest probe"
    assert m.regions, "the rest waits for the probes"
    out = []
    for s in wave1:  # 100 bytes per element, as the fake model says
        out += m.handle(ChunkDone(s.id, obs(s.chunk, peak=100 * s.chunk.elements)))
        out += m.advance()
    (again,) = [d.record for d in of(Decided, out)]
    wave2 = of(Submit, out)
    assert again.decision == "probe" and len({s.chunk.elements for s in wave2}) == 1
    # As far as would keep the first wave's peak within 0.8 of the budget if memory grew with the square of the
    # block, up to the largest probe: here the largest.
    assert max(s.chunk.elements for s in wave2) > 4 * max(s.chunk.elements for s in wave1)
    know.ready = True  # the two waves taught the model
    out = []
    for s in wave2:
        out += m.handle(ChunkDone(s.id, obs(s.chunk, peak=100 * s.chunk.elements)))
        out += m.advance()
    decided = [d.record for d in of(Decided, out)]
    assert decided and all(r.decision == "rechunk" and r.reason.startswith("after probing: ") for r in decided)
    assert len(decided) == len({r.region for r in decided}), "each box left planned once"
    planned = ([q.chunk for q in m.queue] + [i.chunk for i in m.in_flight.values()]
               + [s.chunk for s in wave1 + wave2])
    assert covers_exactly(planned, (64, 40, 10))


@pytest.mark.parametrize("xlines, second_in", [(104, "the sliver"), (40, "the largest box"), (15, "the largest box")])
def test_the_second_probe_wave_takes_the_sliver_the_first_left_when_that_teaches_the_waves_size(xlines, second_in):
    """A halo too wide for one iline across every xline: the first wave takes part of the first iline. The second
    takes the rest of that iline (work a thin chunk would do after the probes anyway, reading mostly halo) where
    its largest probe reads at least 1.5x the smallest the first wave read (4 x 7 x 10 elements) and at least
    1/1.5 of what the wave's probes would read in the largest box (2,750 elements at 104 xlines: the largest probe,
    as far as the first wave's peaks let the wave grow). A sliver too small for that (40 xlines: probes of 4 x 22 x
    10, under 1/1.5 of the wave's probes in the largest box) is left, and the wave goes into the largest box."""
    know = Linear(ready=False)
    m = machine((32, xlines, 10), knowledge=know, halo=(3, 3, 0))
    # 400 elements per first-wave probe: one iline across every xline reads 4 x 23 x 10 = 920.
    budget = int(100 * 4 * 400 / m.settings.probe_first_share)
    _, probes = started(m, slots=2, budget=budget)
    wave1 = of(Submit, probes)
    assert [s.chunk for s in wave1] == [Chunk((0, 0, 0), (1, 4, 10)), Chunk((0, 4, 0), (1, 8, 10))]
    sliver = Chunk((0, 8, 0), (1, xlines, 10))
    assert sliver in m.regions
    out = []
    for s in wave1:
        out += m.handle(ChunkDone(s.id, obs(s.chunk, peak=100 * s.chunk.elements)))
        out += m.advance()
    wave2 = [s.chunk for s in of(Submit, out)]
    if second_in == "the sliver":
        assert wave2 == [Chunk((0, 8, 0), (1, 56, 10)), Chunk((0, 56, 0), (1, 104, 10))]
        assert m.regions == [Chunk((1, 0, 0), (32, 104, 10))], "one box left: nothing thin to run after the probes"
    else:
        assert all(c.start[0] >= 1 for c in wave2) and sliver in m.regions
    know.ready = True
    out = []
    for c in list(m.in_flight):
        out += m.handle(ChunkDone(c, obs(m.in_flight[c].chunk)))
        out += m.advance()
    planned = [q.chunk for q in m.queue] + [i.chunk for i in m.in_flight.values()] + [s.chunk for s in wave1] + wave2
    assert covers_exactly(planned, (32, xlines, 10))
    if second_in == "the sliver":
        assert [d.record.region for d in of(Decided, out)] == [Chunk((1, 0, 0), (32, 104, 10)).key()]


@pytest.mark.parametrize("first_peak_share, grows", [
    (0.001, "to the largest probe"),   # a light operator: the second wave as large as any unknown one may be
    (0.05, "by sqrt(0.8 / 0.05) = 4x"),  # memory quadratic in the block would still fit
    (0.6, "1.5x smaller"),             # heavy already: a smaller second size, never a riskier one
    (0.0, "a quarter"),                # every probe ran out of memory: nothing measured
])
def test_the_second_probe_wave_grows_as_far_as_memory_quadratic_in_the_block_would_still_fit(first_peak_share, grows):
    m = machine((4, 4000, 10), knowledge=Linear(ready=False))  # a long row: room for both waves
    budget = 100 * 4 * 16_000
    m.handle(Start(2, budget))
    m.advance()
    m.probe_peak = int(first_peak_share * budget)
    first = m.settings.probe_first_share
    expected = {"to the largest probe": 1.0, "by sqrt(0.8 / 0.05) = 4x": first * 4,
                "1.5x smaller": first / 1.5, "a quarter": first / 4}[grows]
    assert m._next_probe_scale() == pytest.approx(expected)


def test_a_probe_that_was_its_workers_first_use_of_a_library_sizes_the_next_wave_by_its_block():
    """The first probe on each worker loaded a library it kept (150 MiB): the next wave is sized by what the
    block needed, not shrunk to a sliver by the library (on an H100 a GPU map's second probes were 1 x 1 traces)."""
    budget = 100 * 4 * 16_000
    scales = []
    for left in (0, 150 * MiB):
        m = machine((4, 4000, 10), knowledge=Linear(ready=False))
        m.handle(Start(2, budget))
        wave = of(Submit, m.advance())
        for s in wave:
            o = obs(s.chunk, peak=int(0.05 * budget) + left)
            o.retained_bytes = left
            m.handle(ChunkDone(s.id, o))
        scales.append(m._next_probe_scale())
    assert scales[1] == scales[0] == pytest.approx(m.settings.probe_first_share * 4)


# =========================================================================== mid-map re-plan


def _running_with_queue(knowledge, slots=1):
    m = machine((64, 8, 10), knowledge=knowledge, max_counts=64)
    started(m, slots=slots, budget=100 * 1024)
    assert m.queue
    return m


def test_workers_joining_mid_map_raise_the_in_flight_cap_at_once_and_leaving_lowers_it():
    m = machine((256, 8, 10), max_counts=256)
    _, submitted = started(m, slots=1, budget=100 * 1024)
    assert len(of(Submit, submitted)) == 2 and len(m.queue) > 8, "1 slot: a cap of 2"
    assert m.handle(SlotsChanged(4)) == []
    more = m.advance()
    assert len(of(Submit, more)) == 6 and len(m.in_flight) == 8, "4 slots: a cap of 8, at once"
    m.handle(SlotsChanged(2))  # two jobs reached their walltime: nothing is cancelled, nothing new until under 4
    sid = next(iter(m.in_flight))
    assert not of(Submit, m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk))) + m.advance())
    assert len(m.in_flight) == 7


def test_slot_counts_that_change_nothing_are_ignored():
    m = machine((64, 8, 10), max_counts=64)
    assert m.handle(SlotsChanged(4)) == [] and m.slots == 0, "before the map started: its Start reads the slots"
    started(m, slots=2, budget=100 * 1024)
    for n in (2, 0, -1):
        assert m.handle(SlotsChanged(n)) == [] and m.slots == 2
    assert not of(Decided, m.advance())


def test_a_queue_planned_for_one_slot_is_replanned_for_the_slots_that_joined_when_that_is_faster():
    # 1 ms per element: two queued chunks of 64 ilines are ~5 s each, and 16 slots could share them.
    m = machine((256, 8, 10), knowledge=Linear(spe=1e-3), max_counts=256)
    started(m, slots=1, budget=600 * 1024)
    queued = sum(q.chunk.elements for q in m.queue)
    n_before = len(m.queue)
    m.handle(SlotsChanged(16))
    out = m.advance()
    replans = [d.record for d in of(Decided, out)]
    assert replans and all(r.reason.startswith("mid-map re-plan: the cluster's slots went from 1 to 16")
                           for r in replans)
    assert len(m.queue) + len(of(Submit, out)) > n_before, "smaller chunks for more slots"
    assert sum(q.chunk.elements for q in m.queue) + sum(s.chunk.elements for s in of(Submit, out)) == queued


def test_more_slots_keep_a_queue_whose_re_plan_would_not_be_faster():
    # 1 us per element: the queued chunk is 7 ms of compute; cutting it for 16 slots would only add overhead.
    m = machine((256, 8, 10), max_counts=256)
    started(m, slots=1, budget=1 * MiB)
    queued = [q.chunk for q in m.queue]
    m.handle(SlotsChanged(16))
    out = m.advance()
    assert not of(Decided, out) and [s.chunk for s in of(Submit, out)] == queued


def test_the_remainder_is_replanned_when_the_bound_moved_more_than_the_threshold():
    know = Linear()
    m = _running_with_queue(know)
    n_before = len(m.queue)
    know.bytes_per_element = 50.0  # the model moved: half what was planned with
    sid = next(iter(m.in_flight))
    chunk = m.in_flight[sid].chunk
    # A run past the bound it was submitted with: the model was wrong about this map, so its plan is remade.
    out = m.handle(ChunkDone(sid, obs(chunk, peak=2 * 120 * chunk.elements))) + m.advance()
    replans = [d.record for d in of(Decided, out)]
    assert replans and all(r.reason.startswith("mid-map re-plan: the upper bound moved") for r in replans)
    assert len(m.queue) < n_before, "larger chunks now fit"


def test_a_map_planned_from_history_keeps_its_plan_while_every_run_stays_inside_its_bound():
    """The same survey and store give the same plan: a bound that moves while the runs stay within what they were
    submitted with is the model refining, not a reason to cut again mid-map."""
    know = Linear()
    m = _running_with_queue(know)
    queued = [q.chunk for q in m.queue]
    know.bytes_per_element = 50.0  # the model moved by half
    sid = next(iter(m.in_flight))
    out = m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk))) + m.advance()
    assert not of(Decided, out)
    assert [q.chunk for q in m.queue] == queued[len(of(Submit, out)):]


def test_a_bound_within_the_threshold_keeps_the_planned_chunks():
    know = Linear()
    m = _running_with_queue(know)
    queued = [q.chunk for q in m.queue]
    know.bytes_per_element = 110.0  # +10%: under the 20% threshold
    sid = next(iter(m.in_flight))
    out = m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk))) + m.advance()
    assert not of(Decided, out)
    assert [q.chunk for q in m.queue] == queued[len(of(Submit, out)):]


def test_a_replan_that_would_not_save_time_keeps_the_queued_chunks():
    # No per-task overhead on one slot: any cut of the same box takes the same time, so a bound that
    # halved changes nothing (a re-plan must pay for itself by replan_gain).
    know = Linear()
    m = machine((64, 8, 10), knowledge=know, max_counts=64, per_task_overhead_seconds=0.0)
    started(m, slots=1, budget=100 * 1024)
    queued = [q.chunk for q in m.queue]
    know.bytes_per_element = 50.0
    sid = next(iter(m.in_flight))
    out = m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk))) + m.advance()
    assert not of(Decided, out)
    assert [q.chunk for q in m.queue] == queued[len(of(Submit, out)):]


def test_queued_chunks_that_no_longer_fit_are_replanned_whatever_the_time():
    know = Linear()
    m = machine((64, 8, 10), knowledge=know, max_counts=64, per_task_overhead_seconds=0.0)
    started(m, slots=1, budget=100 * 1024)
    know.bytes_per_element = 150.0  # measured: half as much again as planned with
    sid = next(iter(m.in_flight))
    out = m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk))) + m.advance()
    (d,) = of(Decided, out)
    assert "no longer fit" in d.record.reason
    assert all(know.predict(q.chunk.shape).upper_bytes <= 100 * 1024 for q in m.queue)


def test_queued_chunks_whose_bound_crept_over_the_budget_by_less_than_the_threshold_are_replanned():
    """A bound that moved by less than the 20% threshold keeps the plan, unless it no longer fits: submitted, such
    a chunk would be planned past the kill line (its worker then refuses it, ChunkDeferred, again and again)."""
    know = Linear()
    m = machine((64, 8, 10), knowledge=know, max_counts=64)
    started(m, slots=1, budget=80 * 1024)  # chunks of 8 x 8 x 10: 76.8 KiB bounds, just under the budget
    assert all(know.predict(q.chunk.shape).upper_bytes <= 80 * 1024 for q in m.queue)
    know.bytes_per_element = 110.0  # +10%: 84.5 KiB, over the budget
    sid = next(iter(m.in_flight))
    out = m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk))) + m.advance()
    decided = of(Decided, out)
    assert decided and "is over the budget 80.0 KiB" in decided[0].record.reason
    assert all(know.predict(q.chunk.shape).upper_bytes <= 80 * 1024 for q in m.queue)


def test_a_chunk_that_finds_no_room_twice_is_split_and_an_unsplittable_one_then_runs_unchecked():
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(1, 100 * 1024, headroom_bytes=100 * 1024))
    sub = of(Submit, m.advance(0.0))[0]
    assert sub.check_room

    def deferred(s):
        return m.handle(ChunkDeferred(s.id, "w1", process_bytes=300 * MiB, above_bytes=1024,
                                      upper_bytes=int(s.upper_bytes), kill_bytes=310 * MiB, at=1.0))

    assert not of(Decided, deferred(sub)), "the first time, it goes back as it was"
    (again,) = [s for s in of(Submit, m.advance(1.0)) if s.chunk == sub.chunk]
    (split,) = of(Decided, deferred(again))
    assert "found no room where it began 2 times" in split.record.reason and split.record.chunk == sub.chunk.key()
    halves = [q.chunk for q in m.queue][:2]
    assert sum(h.elements for h in halves) == sub.chunk.elements and all(sub.chunk.contains(h) for h in halves)
    tiny = machine((1, 1, 10), max_counts=64)  # one trace: it cannot be split
    tiny.handle(Start(1, 100 * 1024, headroom_bytes=100 * 1024))
    s = of(Submit, tiny.advance(0.0))[0]
    for _ in range(2):
        tiny.handle(ChunkDeferred(s.id, "w1", 300 * MiB, 1024, int(s.upper_bytes or 0), 310 * MiB, at=1.0))
        (s,) = of(Submit, tiny.advance(1.0))
    assert not s.check_room, "past the limit its worker no longer checks it: the nanny decides, as for any chunk"


def test_no_replan_while_split_pieces_wait_their_turn():
    know = Linear()
    m = _running_with_queue(know)
    sid = next(iter(m.in_flight))
    m.handle(ChunkOutOfMemory(sid, obs(m.in_flight[sid].chunk, peak=200 * 1024, outcome="memory_error",
                                      censored=True)))
    know.bytes_per_element = 10.0
    other = next(iter(m.in_flight))
    out = m.handle(ChunkDone(other, obs(m.in_flight[other].chunk))) + m.advance()
    assert not [d for d in of(Decided, out) if "re-plan" in d.record.reason]


# =========================================================================== out of memory


def test_a_memory_error_records_the_censored_peak_and_resubmits_both_halves_first():
    m = _running_with_queue(Linear())
    sid, item = next(iter(m.in_flight.items()))
    censored = obs(item.chunk, peak=150 * 1024, outcome="memory_error", censored=True)
    out = m.handle(ChunkOutOfMemory(sid, censored))
    assert kinds(out) == ["Record", "ChunkEnded", "Decided"]
    assert out[0].observation is censored and out[1].outcome == MEMORY_ERROR
    assert out[2].record.decision == "retry-smaller" and out[2].record.chunk == item.chunk.key()
    halves = [q.chunk for q in m.queue[:2]]
    assert covers_exactly(halves, item.chunk.shape) or sum(c.elements for c in halves) == item.chunk.elements
    assert all(q.decision == "retry-smaller" and q.attempt == 1 for q in m.queue[:2])
    nxt = of(Submit, m.advance())
    assert [s.chunk for s in nxt] == halves[:len(nxt)], "the pieces go first"


def test_a_memory_error_the_worker_could_not_report_is_recorded_as_needing_more_than_the_budget():
    m = _running_with_queue(Linear())
    sid = next(iter(m.in_flight))
    out = m.handle(ChunkOutOfMemory(sid, None, at=123.0))
    rec = of(Record, out)[0].observation
    assert (rec.outcome, rec.censored, rec.peak_bytes, rec.method, rec.created_at) == (
        "memory_error", True, 100 * 1024, "flow", 123.0)


def test_a_chunk_that_cannot_be_split_fails_the_map_and_stays_in_flight_to_be_settled():
    m = machine((1, 1, 10))
    started(m, slots=1, budget=10 * MiB)
    (sid,) = m.in_flight
    out = m.handle(ChunkOutOfMemory(sid, None))
    (fail,) = of(Fail, out)
    assert isinstance(fail.error, ChunkOutOfMemoryError) and "cannot be split" in str(fail.error)
    assert fail.error.chunk == Chunk((0, 0, 0), (1, 1, 10))
    assert (fail.error.device, fail.error.budget_bytes) == ("host", 10 * MiB)
    assert sid in m.in_flight
    stop = m.handle(Stop("ChunkOutOfMemoryError", interrupted=False))
    assert of(MarkRuns, stop)[0].marks[0][0] == sid


# =========================================================================== a worker dies mid-map


@pytest.mark.parametrize(
    "upper, headroom, attempt, memory_kill",
    [(None, 1000, 0, True),      # no ready bound: assume memory
     (600.0, 1000, 0, True),     # above half the kill headroom: it may have crossed the kill line
     (500.0, 1000, 0, False),    # at half: taken as lost for another reason
     (100.0, 1000, 0, False),    # far below the kill line: a node lost, a SIGKILL
     (100.0, 1000, 1, True)],    # the same chunk died before: memory after all
)
def test_the_memory_kill_rule(upper, headroom, attempt, memory_kill):
    assert is_memory_kill(upper, headroom, attempt) is memory_kill


def test_a_worker_killed_after_writing_its_chunk_keeps_the_chunk_and_its_measurement():
    m = _running_with_queue(Linear())
    sid, item = next(iter(m.in_flight.items()))
    out = m.handle(WorkerDied(sid, "KilledWorker", written=True, kill_headroom_bytes=500 * 1024))
    assert kinds(out) == ["MarkRuns", "RecoverMarkers", "ChunkEnded"]
    assert out[0].marks == ((sid, "Crashed", f"worker died after op[{item.chunk.label((64, 8, 10))}] was written; "
                                            "the chunk is kept"),)
    assert out[1].chunks == (item.chunk,) and out[2].outcome == LOST and out[2].kept
    assert item.chunk in m.done and item.chunk not in [q.chunk for q in m.queue]
    assert not of(Record, out), "nothing learned from the death itself"


def test_a_worker_killed_running_a_chunk_near_the_kill_line_is_out_of_memory_split_and_learned():
    m = _running_with_queue(Linear())
    sid, item = next(iter(m.in_flight.items()))
    out = m.handle(WorkerDied(sid, "KilledWorker", kill_headroom_bytes=150 * 1024))
    assert kinds(out) == ["MarkRuns", "Record", "ChunkEnded", "Decided"]
    assert "treated as out of memory" in out[0].marks[0][2]
    rec = out[1].observation
    assert (rec.outcome, rec.censored, rec.peak_bytes) == ("killed", True, 150 * 1024)
    assert out[2].outcome == KILLED and out[3].record.decision == "retry-smaller"
    assert m.queue[0].decision == "retry-smaller" and sid not in m.in_flight


def test_a_worker_lost_running_a_small_chunk_runs_the_same_chunk_again_once_then_splits_it():
    m = _running_with_queue(Linear())
    sid, item = next(iter(m.in_flight.items()))
    out = m.handle(WorkerDied(sid, "KilledWorker", kill_headroom_bytes=100 * MiB))
    assert kinds(out) == ["MarkRuns", "Record", "ChunkEnded"]
    assert "resubmitting the same chunk" in out[0].marks[0][2]
    assert of(Record, out)[0].observation.outcome == "error" and out[2].outcome == LOST
    assert (m.queue[0].chunk, m.queue[0].attempt) == (item.chunk, 1)
    (again,) = [s for s in of(Submit, m.advance()) if s.chunk == item.chunk]
    out = m.handle(WorkerDied(again.id, "KilledWorker", kill_headroom_bytes=100 * MiB))
    assert of(ChunkEnded, out)[0].outcome == KILLED, "a second death of the same chunk is memory"


def test_a_chunk_only_queued_on_a_worker_that_died_runs_again_as_it_was_and_nothing_is_learned():
    # Dask fails every task assigned to a dying worker (allowed-failures 0), the queued ones too: a chunk that had
    # not begun there says nothing about its memory, even beside a kill the nanny logged as memory.
    m = _running_with_queue(Linear())
    sid, item = next(iter(m.in_flight.items()))
    out = m.handle(WorkerDied(sid, "KilledWorker", kill_headroom_bytes=150 * 1024, worker="tcp://w:1",
                              evidence=DeathEvidence(nanny_memory_kill=True), started=False))
    assert kinds(out) == ["MarkRuns", "ChunkEnded"]
    assert out[0].marks == ((sid, "Crashed", f"worker tcp://w:1 died (KilledWorker) before "
                                            f"op[{item.chunk.label((64, 8, 10))}], queued there, began: "
                                            "resubmitting the same chunk"),)
    assert out[1].outcome == LOST and out[1].observation is None and not out[1].kept
    assert (m.queue[0].chunk, m.queue[0].attempt, m.queue[0].decision) == (item.chunk, 0, item.decision)
    assert sid not in m.in_flight
    # The same death read for the chunk that was running there is the memory kill it was.
    sid2, _ = next(iter(m.in_flight.items()))
    out = m.handle(WorkerDied(sid2, "KilledWorker", kill_headroom_bytes=150 * 1024, worker="tcp://w:1",
                              evidence=DeathEvidence(nanny_memory_kill=True), started=True))
    assert of(ChunkEnded, out)[0].outcome == KILLED and of(Record, out)[0].observation.censored


def test_a_worker_death_with_no_readable_kill_line_is_judged_against_the_budget():
    m = _running_with_queue(Linear())
    sid = next(iter(m.in_flight))
    out = m.handle(WorkerDied(sid, "KilledWorker", kill_headroom_bytes=None))
    assert of(Record, out)[0].observation.peak_bytes == 100 * 1024


def test_a_lost_scheduler_fails_the_map_naming_what_is_kept_and_leaves_its_chunk_to_be_settled():
    m = _running_with_queue(Linear())
    sid = next(iter(m.in_flight))
    cause = OSError("Timed out trying to connect")
    (fail,) = m.handle(ClusterLost(sid, cause, address="tcp://s:8786", written_chunks=3))
    assert isinstance(fail.error, ClusterLostError) and fail.error.__cause__ is cause
    assert "tcp://s:8786" in str(fail.error) and "the 3 chunks written so far are kept in /out.zarr" in str(fail.error)
    assert sid in m.in_flight and m.finished


def test_the_operators_own_error_fails_the_map_as_it_is():
    m = _running_with_queue(Linear())
    sid = next(iter(m.in_flight))
    err = ValueError("bad sigma")
    assert m.handle(ChunkFailed(sid, err)) == [Fail(err)]


# =========================================================================== stopping early


def test_an_interrupt_cancels_what_runs_and_marks_its_task_runs_cancelled_looking_again_for_late_ones():
    m = _running_with_queue(Linear())
    ids = list(m.in_flight)
    out = m.handle(Stop("KeyboardInterrupt", interrupted=True))
    assert kinds(out) == ["Cancel", "MarkRuns", "RecoverMarkers", "Stopped"]
    assert out[0].ids == tuple(ids)
    assert {mark[1] for mark in out[1].marks} == {"Cancelled"} and out[1].look_again
    assert "interrupted or cancelled" in out[1].marks[0][2]
    assert not m.in_flight and m.finished and m.advance() == [], "nothing is finalized: the output stays resumable"


def test_an_error_marks_the_task_runs_in_flight_crashed():
    m = _running_with_queue(Linear())
    out = m.handle(Stop("ClusterLostError", interrupted=False))
    assert {mark[1] for mark in of(MarkRuns, out)[0].marks} == {"Crashed"}
    assert "the chunked map stopped (ClusterLostError)" in of(MarkRuns, out)[0].marks[0][2]


def test_a_chunk_whose_result_arrived_as_the_interrupt_did_is_kept_not_cancelled():
    m = _running_with_queue(Linear())
    ids = list(m.in_flight)
    done = m.in_flight[ids[0]].chunk
    out = m.handle(Stop("KeyboardInterrupt", interrupted=True, finished=((ids[0], obs(done)),)))
    assert kinds(out)[:2] == ["Record", "ChunkEnded"] and of(ChunkEnded, out)[0].outcome == OK
    assert ids[0] not in of(Cancel, out)[0].ids and done in m.done
    assert of(Stopped, out)[0].kept == 1


def test_a_stop_before_the_map_started_settles_nothing():
    assert kinds(machine().handle(Stop("KeyboardInterrupt", interrupted=True))) == ["Stopped"]


@pytest.mark.parametrize("answers, expect_missing", [
    (["set"], []),                                  # marked at once
    (["final"], []),                                # already final: left alone
    (["missing", "missing", "set"], []),            # a run created after the cancellation: found on a later look
    (["missing"] * 50, ["r"]),                      # never started: given up after the deadline
])
def test_runs_created_after_a_cancellation_are_looked_for_again_until_a_deadline(answers, expect_missing):
    calls = iter(answers)
    now = [0.0]

    def sleep(s):
        now[0] += s

    missing = mark_runs([("r", "Cancelled", "why")], look_again_seconds=2.0, poll_seconds=0.25,
                        set_state=lambda *a: next(calls), clock=lambda: now[0], sleep=sleep)
    assert missing == expect_missing


# =========================================================================== resume, recover, finalize


def test_a_resumed_output_plans_only_the_boxes_its_completed_chunks_leave():
    done = (Chunk((0, 0, 0), (4, 8, 10)),)
    m = machine()
    first, out = started(m, completed=done)
    assert kinds(first) == ["RecoverMarkers", "Decided"]
    assert first[1].record.decision == "resume" and "1 chunks already written; 1 boxes left" in first[1].record.reason
    assert all(d.record.reason.startswith("the part a resumed output lacks: ") for d in of(Decided, out))
    assert not any(Chunk((0, 0, 0), (4, 8, 10)).contains(s.chunk) for s in of(Submit, out))


def test_a_resumed_output_that_is_complete_finalizes_without_running_anything():
    m = machine()
    first, out = started(m, completed=(Chunk.whole((8, 8, 10)),))
    assert "nothing left" in of(Decided, first)[0].record.reason
    assert out == [Finalize(settle_runs=False), ReadPauses(0.0, 0.0)]


def test_recovered_marker_measurements_are_recorded_for_this_operator_only():
    m = machine()
    started(m)
    mine = obs(Chunk((0, 0, 0), (1, 1, 10)))
    theirs = Observation("other|float32|cpu", 10, (1, 1, 10), 40, 1000)
    assert m.handle(MarkersRecovered((mine, theirs))) == [Record(mine)]


def test_the_map_finalizes_when_every_chunk_is_written_and_settles_runs_after_a_death():
    for died in (False, True):
        m = machine((2, 8, 10))
        started(m, slots=2)
        out = []
        if died:
            sid = next(iter(m.in_flight))
            out += m.handle(WorkerDied(sid, "KilledWorker", written=True))
        while m.in_flight:
            sid, item = next(iter(m.in_flight.items()))
            out += m.handle(ChunkDone(sid, obs(item.chunk)))
            out += m.advance()
        assert out[-2] == Finalize(settle_runs=died) and isinstance(out[-1], ReadPauses)
        assert covers_exactly(m.done, (2, 8, 10))


# =========================================================================== the machine itself


def test_events_that_make_no_sense_are_refused():
    m = machine()
    with pytest.raises(MapStateError):
        m.handle(ChunkDone(0, obs(Chunk((0, 0, 0), (1, 1, 1)))))  # before Start
    started(m)
    with pytest.raises(MapStateError, match="not in flight"):
        m.handle(ChunkDone(999, obs(Chunk((0, 0, 0), (1, 1, 1)))))
    with pytest.raises(MapStateError):
        m.handle(Start(1, 1))
    with pytest.raises(MapStateError):
        m.handle("chunk finished")  # type: ignore[arg-type]


def test_the_same_events_give_the_same_instructions():
    def replay():
        m = machine((32, 8, 10), knowledge=Linear(), max_counts=32)
        out = m.handle(Start(2, 60 * 1024, at=1.0)) + m.advance(1.0)
        t = 2.0
        while m.in_flight:
            sid, item = min(m.in_flight.items())
            ev = (WorkerDied(sid, "KilledWorker", kill_headroom_bytes=10, at=t) if sid == 1
                  else ChunkDone(sid, obs(item.chunk, at=t), at=t))
            out += answered(m, m.handle(ev) + m.advance(t))
            t += 1.0
        return out

    first = replay()
    assert first == replay() and [type(i) for i in first[-3:]] == [Finalize, ReadPauses, Rewarded]


# =========================================================================== the learned policy's arms


def run_all(m: MapMachine, *, at=1.0, peak=1000, pauses=()):
    """Finish every submitted chunk at time ``at`` (+1 s per chunk); return every instruction (``pauses``: the
    workers' pauses the executor reads at the end)."""
    out = []
    t = at
    for _ in range(1000):
        out += answered(m, m.advance(t), pauses)
        if m.finished:
            break
        for sub in list(m.in_flight):
            item = m.in_flight[sub]
            t += 1.0
            out += m.handle(ChunkDone(sub, obs(item.chunk, peak=peak), at=t))
    return out


def test_the_first_plan_is_made_under_each_arm_and_a_new_operator_plays_the_bold_one_first():
    # 64 x 8 x 10 elements x 100 B: 512 KB mean whole; the bound is 1.2 x, the tight bound 1.05 x: two chunks
    # fit 300 KB with the tight bound (269 KB each), not with the full one (307 KB).
    m = machine((64, 8, 10), knowledge=Linear(tight=1.05), max_counts=64)
    first, _ = started(m, slots=2, budget=300_000)
    (d,) = of(Decided, first)
    assert d.record.arm == "bold" and "learned policy: arm bold" in d.record.reason and "no reward yet" in d.record.reason
    safe = machine((64, 8, 10), knowledge=Linear(tight=1.05), max_counts=64, learned_policy=False)
    (ds,) = of(Decided, started(safe, slots=2, budget=300_000)[0])
    assert ds.record.arm == "safe" and "fixed heuristic" in ds.record.reason
    # Bold fits the tight bound (1.05 x mean) to the budget, the heuristic the full bound: fewer, larger chunks.
    assert d.record.n_chunks < ds.record.n_chunks
    assert d.record.upper_bound_bytes <= 300_000 < 1.2 * d.record.predicted_peak_bytes


def test_no_arm_plans_past_the_budget_with_its_own_bound_and_none_fits_below_the_tight_bound():
    m = machine((8, 8, 10), knowledge=Linear(tight=1.05))
    _, submitted = started(m, slots=2, budget=1_000_000)
    assert all(s.upper_bytes <= 1_000_000 for s in of(Submit, submitted))
    # One trace (10 elements, 1000 B mean, 1050 B tight) cannot fit 1000 B under any arm: the map fails.
    tiny = machine((8, 8, 10), knowledge=Linear(tight=1.05))
    first = tiny.handle(Start(2, 1000))
    assert kinds(first) == ["Fail"] and isinstance(first[0].error, BudgetTooSmallError)


def test_arms_that_give_the_same_plan_are_one_choice_and_all_are_taught():
    m = machine((8, 8, 10), knowledge=Linear())  # no tight bound: every arm plans alike
    first, _ = started(m, slots=2, budget=10 * MiB)
    (d,) = of(Decided, first)
    assert d.record.arm == "bold" and "same plan as mid, safe" in d.record.reason and "only plan" in d.record.reason
    out = run_all(m)
    (r,) = of(Rewarded, out)
    assert r.reward.arms == ("bold", "mid", "safe")
    assert kinds(out)[-3:] == ["Finalize", "ReadPauses", "Rewarded"], "taught only once the output is finalized"


def _first_plan(m, budget=10 * MiB):
    (d,) = of(Decided, m.handle(Start(2, budget)))
    return d.record


def test_granularity_arms_plan_a_neighbour_of_the_safe_chunking_and_are_each_measured_once():
    # 64 x 8 x 10 at 1 ms per element: safe cuts 2 chunks of 2,560 elements (one wave); finer must read at most
    # 2,560 / 1.5 (4 chunks, two waves: the model expects the same compute plus one task's overhead, 0.15 s of
    # 2.71 s); coarser at least 3,840: one chunk, estimated at 5.3 s, 1.9x safe's, past the 1.5x a neighbour may be.
    k = Linear(spe=1e-3)  # no tight bound: bold and mid plan as safe does
    played = []
    for _ in range(3):
        m = machine((64, 8, 10), knowledge=k, granularity_arms=True)
        record = _first_plan(m)
        played.append((record.arm, record.chunk_shape))
        (r,) = of(Rewarded, run_all(m))  # each chunk 1 s after the last: 4 chunks take twice 2's time
        k.learner.learn(r.reward)
    assert [a for a, _ in played] == ["bold", "finer", "bold"], "burn-in: each differing plan once, then the best"
    assert played[0][1] == (32, 8, 10) and math.prod(played[1][1]) <= 2560 / 1.5
    assert [a["pulls"] for a in k.learner.summary()] == [2, 2, 2, 1, 0], "coarser was never offered"
    heuristic = machine((64, 8, 10), knowledge=Linear(spe=1e-3), learned_policy=False, granularity_arms=True)
    assert _first_plan(heuristic).chunk_shape == (32, 8, 10)
    default = machine((64, 8, 10), knowledge=k)  # granularity arms off (the default): finer is never offered
    assert _first_plan(default).arm == "bold"


def test_a_finer_arm_that_measured_faster_is_played_with_blocks_in_its_range():
    k = Linear(spe=1e-3)
    for arm, arms, value in [("bold", ("bold", "mid", "safe"), 0.5), ("finer", ("finer",), 0.7)]:
        k.learner.learn(Reward(KEY, arm, arms, value, value, 100, 1.0, 2))
    m = machine((64, 8, 10), knowledge=k, granularity_arms=True)
    record = _first_plan(m)
    assert record.arm == "finer" and "expected reward 0.70" in record.reason
    assert m._read_range() == (0.0, 2560 / 1.5)
    queued = list(m.queue)
    assert len(queued) == 4 and all(math.prod(m.spec.read_extents(p.chunk)) <= 2560 / 1.5 for p in queued)


def test_the_reward_is_the_arms_slot_efficiency_less_a_penalty_per_out_of_memory_chunk():
    k = Linear(tight=1.05, spe=1e-3)
    m = machine((4, 8, 10), knowledge=k, max_counts=64)  # 320 elements x 100 B: 32 KB mean
    m.handle(Start(2, 20_000, at=0.0))
    subs = of(Submit, m.advance(0.0))
    assert subs and m.arm is not None
    # The first chunk runs out of memory; its halves inherit the arm; the rest finish.
    m.handle(ChunkOutOfMemory(subs[0].id, obs(subs[0].chunk, peak=30_000, outcome="memory_error", censored=True),
                              at=1.0))
    out = run_all(m, at=1.0)
    (r,) = of(Rewarded, out)
    assert r.reward.out_of_memory == 1 and r.reward.elements == 320
    wall = r.reward.wall_seconds
    assert wall == pytest.approx(m.arm_ended - 0.0)
    assert r.reward.efficiency == pytest.approx(min(1.0, 320 * 1e-3 / (2 * wall)))
    assert r.reward.reward == pytest.approx(r.reward.efficiency - 1.0)


def test_worker_pauses_while_the_plan_ran_cost_their_share_of_its_slot_time():
    def reward(pauses):
        m = machine((4, 8, 10), knowledge=Linear(tight=1.05, spe=1e-3), max_counts=64)
        m.handle(Start(2, 10 * MiB, at=0.0))
        (r,) = of(Rewarded, run_all(m, at=0.0, pauses=pauses))
        return r.reward

    clean = reward(())
    # One pause of 1 s inside the plan's time, one before the map started (not the plan's doing).
    paused = reward((Pause("tcp://w1", clean.wall_seconds / 2, clean.wall_seconds / 2 + 1.0),
                     Pause("tcp://w2", -10.0, -5.0)))
    assert (paused.pauses, paused.paused_seconds) == (1, pytest.approx(1.0))
    assert paused.efficiency == clean.efficiency, "pauses do not change what the chunks needed"
    assert paused.reward == pytest.approx(clean.reward - 1.0 / (2 * clean.wall_seconds))


def test_pauses_are_read_only_once_the_map_is_finished():
    m = machine()
    started(m)
    with pytest.raises(MapStateError):
        m.handle(PausesRead(()))


def test_a_map_that_stops_early_or_probes_only_teaches_nothing():
    m = machine((8, 8, 10), knowledge=Linear(tight=1.05))
    _, submitted = started(m, slots=2, budget=10 * MiB)
    sid = of(Submit, submitted)[0].id
    m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk), at=1.0))
    assert not of(Rewarded, m.handle(Stop("KeyboardInterrupt", True)))
    cold = machine((8, 8, 10), knowledge=Linear(ready=False))
    assert not of(Rewarded, run_all_cold(cold))


def test_a_map_that_probed_teaches_nothing_though_its_remainder_was_planned_under_an_arm():
    k = Linear(ready=False)
    m = machine((512, 64, 100), knowledge=k)  # 330 MB at 100 B per element: probes of a 10 MiB budget leave most
    m.handle(Start(2, 10 * MiB))
    probes = of(Submit, m.advance(1.0))
    assert probes and all(p.decision == "probe" for p in probes)
    k.ready = True  # the probes taught the model enough to plan the rest
    out = []
    for p in probes:
        out += m.handle(ChunkDone(p.id, obs(m.in_flight[p.id].chunk), at=2.0))
    out += run_all(m, at=2.0)
    assert m.finished and any(d.record.arm for d in of(Decided, out)), "the remainder was planned under an arm"
    assert not of(Rewarded, out)


def run_all_cold(m: MapMachine):
    m.handle(Start(2, 10 * MiB))
    out = []
    for _ in range(100):
        out += answered(m, m.advance(1.0))
        if m.finished:
            break
        for sid in list(m.in_flight):
            out += m.handle(ChunkDone(sid, obs(m.in_flight[sid].chunk), at=2.0))
    return out


def test_the_learner_turns_away_from_an_arm_that_ran_out_of_memory():
    k = Linear(tight=1.05)
    value_of = {"bold": -0.3, "mid": 0.5, "safe": 0.4, "finer": 0.3, "coarser": 0.2}
    for arm, value in value_of.items():  # every arm played once (the burn-in is over)
        k.learner.learn(Reward(KEY, arm, (arm,), value, max(value, 0.0), 100, 1.0, 2, out_of_memory=int(value < 0)))
    chosen = []
    for _ in range(20):  # epsilon-greedy: mostly the best arm, sometimes a random one
        m = machine((64, 8, 10), knowledge=k, max_counts=64)
        (d,) = of(Decided, m.handle(Start(2, 280_000)))  # bold: 2 chunks; mid and safe: 4
        chosen.append(d.record.arm)
        k.learner.learn(Reward(KEY, d.record.arm, (d.record.arm,), value_of[d.record.arm], 0.5, 100, 1.0, 2))
    assert chosen.count("mid") >= 15 and "expected reward" in d.record.reason


def test_memory_errors_that_splitting_does_not_cure_stop_the_map_saying_it_is_not_chunk_size():
    # Every piece raises MemoryError though the model puts it far under the budget (an address-space limit,
    # thread pools reserving memory): after memory_error_splits (4) splits the map stops, typed, not at 3 x 3
    # traces after dozens of splits.
    from memchunk_prefect.core.errors import MemoryNotChunkSizeError

    m = _running_with_queue(Linear())
    sid = next(iter(m.in_flight))
    for _ in range(10):
        item = m.in_flight[sid]
        out = m.handle(ChunkOutOfMemory(sid, obs(item.chunk, peak=1024, outcome="memory_error", censored=True)))
        if of(Fail, out):
            break
        sid = of(Submit, m.advance())[0].id  # the first piece goes first
    (fail,) = of(Fail, out)
    assert isinstance(fail.error, MemoryNotChunkSizeError) and isinstance(fail.error, MemoryError)
    assert item.attempt == 4 and fail.error.chunk == item.chunk
    assert "not the chunk's size" in str(fail.error) and "OMP_NUM_THREADS=1" in str(fail.error)


def test_gpu_memory_errors_split_until_the_chunk_fits_or_cannot_be_split_saying_it_was_the_gpu():
    # The host model says nothing of GPU memory: the "not the chunk's size" stop above must not fire for a GPU
    # out-of-memory, and a chunk that cannot be split further says what to do on a GPU.
    from memchunk_prefect.core.errors import ChunkOutOfMemoryError, MemoryNotChunkSizeError

    m = machine((64, 8, 10), knowledge=OnGpu(gpu_per_element=1.0), max_counts=64)
    started(m, slots=1, budget=100 * 1024, gpu_budget_bytes=6 * MiB)
    sid = next(iter(m.in_flight))
    for _ in range(40):
        item = m.in_flight[sid]
        o = obs(item.chunk, peak=1024, outcome="memory_error", censored=True)
        o.gpu_peak_bytes = 7 * MiB
        out = m.handle(ChunkOutOfMemory(sid, o, gpu=True))
        if of(Fail, out):
            break
        assert "GPU out of memory, needed more than 7.0 MiB" in of(Decided, out)[0].record.reason
        sid = of(Submit, m.advance())[0].id
    (fail,) = of(Fail, out)
    assert type(fail.error) is ChunkOutOfMemoryError and not isinstance(fail.error, MemoryNotChunkSizeError)
    assert item.attempt > 4 and item.chunk.shape[:2] == (1, 1), "split past memory_error_splits, to one trace"
    assert "7.0 MiB of GPU memory" in str(fail.error) and "device='cpu'" in str(fail.error)
    # Its figures are the GPU's: what the chunk needed there against the GPU budget, not the host's 100 KiB.
    assert (fail.error.device, fail.error.budget_bytes, fail.error.needed_bytes) == ("gpu", 6 * MiB, 7 * MiB)
    again = pickle.loads(pickle.dumps(fail.error))  # as it crosses from the flow to a caller's process
    assert (again.device, again.budget_bytes, again.needed_bytes) == ("gpu", 6 * MiB, 7 * MiB)


def test_memory_errors_at_sizes_the_model_puts_near_the_budget_keep_splitting():
    # The model puts the pieces above half the budget: a MemoryError there may well be the chunk's size.
    m = machine((64, 8, 10), max_counts=64, memory_error_splits=0)
    started(m, slots=1, budget=100 * 1024)
    sid, item = next(iter(m.in_flight.items()))
    assert m._upper_for(item.chunk) > 0.5 * m.budget_bytes
    out = m.handle(ChunkOutOfMemory(sid, obs(item.chunk, peak=1024, outcome="memory_error", censored=True)))
    assert not of(Fail, out) and of(Decided, out)[0].record.decision == "retry-smaller"


# =========================================================================== the budget follows the workers


def drifted(chunk: Chunk, worker: str, above_resting: int, peak=1000) -> Observation:
    """A run on ``worker`` that began ``above_resting`` bytes above the resting memory the map's budget read."""
    o = obs(chunk, peak)
    o.worker, o.resting_bytes, o.baseline_bytes = worker, 200 * MiB, 200 * MiB + above_resting
    return o


def test_the_workers_drift_comes_off_the_kill_headroom_not_off_a_smaller_cap():
    kill = machine((64, 8, 10), max_counts=64)
    kill.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024, drift_bytes=30 * 1024))
    assert kill.budget_bytes == 70 * 1024, "no cap: the headroom less the drift expected from recent runs"
    capped = machine((64, 8, 10), max_counts=64)
    capped.handle(Start(2, 50 * 1024, headroom_bytes=100 * 1024, drift_bytes=30 * 1024))
    assert capped.budget_bytes == 50 * 1024, "a cap below headroom - drift: the task's own use is what is capped"
    unknown = machine((64, 8, 10), max_counts=64)
    unknown.handle(Start(2, 50 * 1024, drift_bytes=30 * 1024))
    assert unknown.budget_bytes == 50 * 1024, "no kill line known: nothing to take the drift off"


def test_a_map_whose_workers_creep_up_replans_what_no_longer_fits_and_runs_what_does():
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    subs = of(Submit, m.advance(0.0))
    planned = max(s.upper_bytes for s in subs)
    assert planned > 60 * 1024, "planned for the whole headroom"
    # Each worker now starts its tasks 40 KiB above the resting memory read at the start (Prefect's per-task-run
    # memory on a Dask worker, or another flow's leftovers): the queued chunks no longer fit what is left.
    out = m.handle(ChunkDone(subs[0].id, drifted(subs[0].chunk, "w1", 40 * 1024), at=1.0))
    out += m.handle(ChunkDone(subs[1].id, drifted(subs[1].chunk, "w2", 40 * 1024), at=1.0))
    assert m.budget_bytes == 60 * 1024
    out = m.advance(1.0)
    (d,) = of(Decided, out)
    assert d.record.decision == "rechunk" and "the budget moved" in d.record.reason and "40.0 KiB" in d.record.reason
    assert all(s.upper_bytes <= 60 * 1024 for s in of(Submit, out))
    # The memory is given back (a worker restarted): nothing is re-planned back and forth for it.
    sub = of(Submit, out)[0]
    m.handle(ChunkDone(sub.id, drifted(sub.chunk, "w1", 0), at=2.0))
    assert m.budget_bytes == 60 * 1024, "the worst worker still stands 40 KiB up"


def test_what_a_first_use_left_held_on_a_worker_comes_off_the_headroom_before_its_next_run_says_so():
    """A worker's first chunk left 40 KiB held (a CUDA context, a library): its next chunk starts there, so the
    queued chunks are planned for what is left now, not after that next chunk has run over it."""
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    subs = of(Submit, m.advance(0.0))
    first = drifted(subs[0].chunk, "w1", 0)
    first.retained_bytes = 40 * 1024
    m.handle(ChunkDone(subs[0].id, first, at=1.0))
    assert m.budget_bytes == 60 * 1024
    nxt = drifted(subs[1].chunk, "w1", 40 * 1024)  # the next run on it starts where the first left it
    nxt.retained_bytes = 0
    m.handle(ChunkDone(subs[1].id, nxt, at=2.0))
    assert m.budget_bytes == 60 * 1024, "counted once: the worker stands 40 KiB up, not 80"


def test_where_another_map_left_a_worker_comes_off_the_headroom_and_replans_the_queue():
    """Maps of a chained flow share their workers: another operator's first use on w1 (a library it imports, 40 KiB
    here) is where this map's next chunk on w1 starts. Heard of, the budget follows at once and the queued chunks
    planned for the whole headroom are re-planned before the next submission; this map's own next run on w1 then
    reads the same standing, counted once. A lower report than what the map knows changes nothing."""
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    subs = of(Submit, m.advance(0.0))
    assert max(s.upper_bytes for s in subs) > 60 * 1024, "planned for the whole headroom"
    out = m.handle(ChunkDone(subs[0].id, drifted(subs[0].chunk, "w2", 0), at=1.0))
    out += m.handle(WorkerStands("w1", 40 * 1024, at=1.0))
    assert m.budget_bytes == 60 * 1024
    out = m.advance(1.0)
    (d,) = of(Decided, out)
    assert d.record.decision == "rechunk" and "the budget moved" in d.record.reason
    assert all(s.upper_bytes <= 60 * 1024 for s in of(Submit, out))
    m.handle(ChunkDone(subs[1].id, drifted(subs[1].chunk, "w1", 40 * 1024), at=2.0))
    assert m.budget_bytes == 60 * 1024, "counted once: w1 stands 40 KiB up, not 80"
    m.handle(WorkerStands("w1", 10 * 1024, at=3.0))
    assert m.budget_bytes == 60 * 1024, "a late or low report never lowers what the map knows"


def test_another_maps_first_use_still_to_come_on_a_worker_keeps_room_there_until_that_map_runs_there():
    """Regression (``python -m benchmarks.family --scale 4``, w2: 2 workers x 600 MiB x 2 threads): the first-use
    operator's first chunk on w1 left 100 MiB held. Its first chunk on w2 came later, after a 314 MiB Gram chunk
    planned without it had been submitted there: the worker died. Told of a first use on one worker, a map keeps
    room for it on the others, through its own runs there (which cannot show it yet), until the other map
    reports from that worker."""
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    subs = of(Submit, m.advance(0.0))
    m.handle(FirstUseExpected("w2", "map-b", 40 * 1024, at=1.0))
    assert m.budget_bytes == 60 * 1024
    m.handle(ChunkDone(subs[0].id, drifted(subs[0].chunk, "w2", 0), at=2.0))
    assert m.budget_bytes == 60 * 1024, "this map's own run on w2 cannot show a first use still to come"
    m.handle(WorkerStands("w2", 40 * 1024, at=3.0, source="map-b"))
    assert m.budget_bytes == 60 * 1024 and m.standing.pending == {"w2": {}}, "paid once, counted once"
    m.handle(ChunkDone(subs[1].id, drifted(subs[1].chunk, "w1", 0), at=4.0))
    assert m.standing.worst() == 40 * 1024


def test_a_first_use_still_expected_of_a_map_that_ended_without_running_there_gives_its_room_back():
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    m.handle(FirstUseExpected("w2", "map-b", 40 * 1024, at=1.0))
    m.handle(FirstUseExpected("w2", "map-c", 10 * 1024, at=1.0))
    assert m.budget_bytes == 50 * 1024
    m.handle(FirstUseExpected("w2", "map-b", 0, at=2.0))  # map-b ended (StandingBoard.leave)
    assert m.budget_bytes == 90 * 1024 and m.standing.pending == {"w2": {"map-c": 10 * 1024}}


def test_a_chunk_that_found_no_room_where_it_began_is_planned_again_for_what_the_worker_holds():
    """Regression (``python -m benchmarks.family --scale 4``, w2: 2 workers x 600 MiB): a 1.3 M-element Gram chunk
    planned at 310 MiB was submitted before the first-use operator's 100 MiB library landed on its worker; it began
    there at 266 MiB and the worker died. Checked where it begins, it starts nothing: the worker's standing is
    raised to what it found, and what is queued, itself first, is planned again before anything is submitted."""
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    subs = of(Submit, m.advance(0.0))
    big = subs[0]
    out = m.handle(ChunkDeferred(big.id, "w1", process_bytes=260 * MiB, above_bytes=60 * 1024,
                                 upper_bytes=int(big.upper_bytes), kill_bytes=570 * MiB, at=1.0))
    assert kinds(out) == ["ChunkEnded"], "its task run ended Failed on the worker, saying why"
    assert out[0].outcome == DEFERRED and out[0].observation is None, "nothing is learned about its memory"
    assert m.budget_bytes == 40 * 1024 and m.queue[0].chunk == big.chunk and big.id not in m.in_flight
    again = m.advance(2.0)
    decided = of(Decided, again)
    assert decided and all(d.record.decision == "rechunk" and "budget moved from 100.0 KiB to 40.0 KiB" in
                           d.record.reason for d in decided), "re-planned before submitting"
    assert of(Submit, again) and all(s.upper_bytes <= 40 * 1024 for s in of(Submit, again))
    assert m.deaths == 0


def test_the_standing_a_map_hears_of_shifts_the_readings_it_has_of_a_shared_worker():
    """On a worker of several threads a map takes the least of its last readings; memory another map's run left
    there since raises every one of them."""
    s = WorkerStanding(estimate=5)
    for above in (30, 10, 20):
        o = obs(Chunk((0, 0, 0), (1, 1, 1)), 1000)
        o.worker, o.resting_bytes, o.baseline_bytes, o.shared = "w1", 100, 100 + above, True
        s.follow(o)
    assert s.worst() == 10
    s.heard("w1", 160)
    s.heard("w9", 12)
    assert s.drift == {"w1": 160, "w9": 12} and s.worst() == 160
    o = obs(Chunk((0, 0, 0), (1, 1, 1)), 1000)
    o.worker, o.resting_bytes, o.baseline_bytes, o.shared = "w1", 100, 100 + 170, True
    s.follow(o)
    assert s.worst() == 160, "the least of the last readings, each raised by what was heard since"


def test_the_map_log_keeps_how_close_the_model_was_at_the_chunks_it_ran():
    """Per chunk the runner chose, the model's mean and bound when it was submitted against the measured peak:
    the demo and the benchmarks report them (the bound over the peak at the chunk size chosen)."""
    from memchunk_prefect.run.observe import MapLog

    log = MapLog()
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024))
    subs = of(Submit, m.advance())
    for s in subs:
        log.on_submit(observer_event(s)[1])
    # Each peak is the fake model's mean (100 bytes per element); its bound is 1.2x that.
    for s in subs[:2]:
        for ended in of(ChunkEnded, m.handle(ChunkDone(s.id, obs(s.chunk, peak=100 * s.chunk.elements)))):
            log.on_chunk_end(observer_event(ended)[1])
    summary = log.summary(operator="op", operator_key=KEY, chunks=[], output="/out.zarr")
    assert summary["bound_over_peak"] == pytest.approx(1.2) and summary["mean_error"] == pytest.approx(0.0)
    assert len(log.predicted) == 2
    # A chunk that was its worker's first use of a library is scored on its block's peak: the 150 MiB it left
    # held are the worker's, budgeted apart.
    s = subs[2]
    first = obs(s.chunk, peak=100 * s.chunk.elements + 150 * MiB)
    first.retained_bytes = 150 * MiB
    for ended in of(ChunkEnded, m.handle(ChunkDone(s.id, first))):
        log.on_chunk_end(observer_event(ended)[1])
    assert log.predicted[-1][-1] == 100 * s.chunk.elements


# =========================================================================== a map on the GPU: two budgets


@dataclass
class OnGpu(Linear):
    """A fake model of a map on the GPU: host memory as :class:`Linear`, GPU memory ``gpu_per_element`` per
    element held (bound 20% above), ready like the host's."""

    gpu_per_element: float = 400.0

    def predict_gpu(self, extents):
        mean = self.gpu_per_element * math.prod(extents)
        return Prediction(mean, 1.2 * mean, 10, self.ready, "gpu")


def test_a_map_on_the_gpu_plans_chunks_that_fit_the_gpu_budget_as_well_as_the_hosts():
    # 64 x 8 x 10: the host (120 B bound per element) fits one chunk of the whole in 1 MiB; the GPU (480 B per
    # element) in 200 KiB fits at most 426 elements, so the GPU budget is what cuts.
    m = machine((64, 8, 10), knowledge=OnGpu(), max_counts=64)
    first, submitted = started(m, slots=2, budget=MiB, gpu_budget_bytes=200 * 1024)
    (d,) = of(Decided, first)
    assert d.record.decision == "rechunk"
    gpu_bounds = [480 * math.prod(s.read_extents) for s in of(Submit, submitted)]
    assert gpu_bounds and max(gpu_bounds) <= 200 * 1024
    # The same map on the CPU (no GPU budget): the host's budget alone, fewer chunks.
    cpu = machine((64, 8, 10), knowledge=OnGpu(), max_counts=64)
    (c,) = of(Decided, started(cpu, slots=2, budget=MiB)[0])
    assert c.record.n_chunks < d.record.n_chunks


def test_a_gpu_too_small_for_one_trace_fails_the_map_saying_so_and_what_to_do():
    m = machine((4, 4, 10), knowledge=OnGpu(gpu_per_element=1e6))  # one trace: 12 MB bound of GPU memory
    first, _ = started(m, slots=1, budget=10 * MiB, gpu_budget_bytes=MiB)
    (fail,) = of(Fail, first)
    assert isinstance(fail.error, BudgetTooSmallError)
    text = str(fail.error)
    assert "of GPU memory" in text and "GPU budget of 1.0 MiB" in text and "device='cpu'" in text, text


def test_a_gpu_out_of_memory_is_recorded_as_one_of_the_gpu_even_when_its_worker_sent_no_record():
    m = machine((4, 4, 10), knowledge=OnGpu(gpu_per_element=1.0))
    _, submitted = started(m, slots=1, budget=10 * MiB, gpu_budget_bytes=MiB)
    sid = of(Submit, submitted)[0].id
    out = m.handle(ChunkOutOfMemory(sid, None, gpu=True))
    (rec,) = of(Record, out)
    assert rec.observation.gpu_out_of_memory and rec.observation.outcome == MEMORY_ERROR
    assert rec.observation.gpu_budget_bytes == MiB


# =========================================================================== a GPU context broken by a CUDA error


def test_a_chunk_that_breaks_its_workers_gpu_context_restarts_that_worker_and_runs_once_more():
    from memchunk_prefect.core.errors import GpuContextError
    from memchunk_prefect.core.messages import GpuContextLost, RestartWorker

    m = machine((4, 4, 10), knowledge=OnGpu(gpu_per_element=1.0))
    _, submitted = started(m, slots=1, budget=10 * MiB, gpu_budget_bytes=MiB)
    first = of(Submit, submitted)[0]
    err = GpuContextError("op[...] hit a CUDA error", "tcp://w:1")
    out = m.handle(GpuContextLost(first.id, "tcp://w:1", err))
    (restart,) = of(RestartWorker, out)
    assert restart.address == "tcp://w:1" and "left its GPU context unusable" in restart.reason
    (ended,) = of(ChunkEnded, out)
    assert ended.outcome == LOST and of(Record, out)[0].observation.outcome == "error", "nothing learned of memory"
    again = [s for s in of(Submit, m.advance()) if s.chunk == first.chunk]
    assert again, "the same chunk runs again, first"
    # The same chunk breaking a context again fails the map with the error, saying why it is not retried.
    (fail,) = of(Fail, m.handle(GpuContextLost(again[0].id, "tcp://w:2", GpuContextError("again", "tcp://w:2"))))
    assert isinstance(fail.error, GpuContextError) and "not retried: it did so again after a restart" in str(fail.error)
    assert "device='cpu'" in str(fail.error) and "a rerun resumes" in str(fail.error)


def test_a_chunk_that_failed_on_a_worker_another_chunk_broke_runs_again_restarting_and_counting_nothing():
    from memchunk_prefect.core.errors import GpuContextError
    from memchunk_prefect.core.messages import GpuContextLost, RestartWorker

    m = machine((8, 8, 10), knowledge=OnGpu(gpu_per_element=1.0), gpu_context_restarts=1, max_counts=64)
    _, submitted = started(m, slots=2, budget=4 * 1024, gpu_budget_bytes=MiB)
    a, b = of(Submit, submitted)[:2]
    assert of(RestartWorker, m.handle(GpuContextLost(a.id, "tcp://w:1", GpuContextError("a", "tcp://w:1"))))
    # b was queued on the same worker and ran there before the restart: the context it met was already broken.
    out = m.handle(GpuContextLost(b.id, "tcp://w:1", GpuContextError("b", "tcp://w:1")))
    assert not of(RestartWorker, out) and not of(Fail, out), "one restart, and within gpu_context_restarts=1"
    assert of(ChunkEnded, out)[0].outcome == LOST
    assert {s.chunk for s in of(Submit, m.advance())} >= {a.chunk, b.chunk}, "both run again"


def test_a_map_restarts_at_most_gpu_context_restarts_workers_then_fails():
    from memchunk_prefect.core.errors import GpuContextError
    from memchunk_prefect.core.messages import GpuContextLost, RestartWorker

    m = machine((8, 8, 10), knowledge=OnGpu(gpu_per_element=1.0), gpu_context_restarts=2, max_counts=64)
    _, submitted = started(m, slots=2, budget=4 * 1024, gpu_budget_bytes=MiB)
    subs = of(Submit, submitted)
    assert len(subs) >= 3
    restarts = []
    for i, s in enumerate(subs[:2]):  # each on a worker of its own (a restarted worker comes back at a new address)
        w = f"tcp://w:{i}"
        restarts += of(RestartWorker, m.handle(GpuContextLost(s.id, w, GpuContextError("x", w))))
    assert len(restarts) == 2
    (fail,) = of(Fail, m.handle(GpuContextLost(subs[2].id, "tcp://w:9", GpuContextError("x", "tcp://w:9"))))
    assert "gpu_context_restarts=2" in str(fail.error)


def test_a_worker_of_several_threads_stands_where_the_least_of_its_recent_starts_says():
    """Runs that share their process start above what the other threads hold or just freed: one high start must
    not take the whole headroom (it left a 600 MiB worker no room for one trace), a lasting one does."""
    m = machine((64, 8, 10), max_counts=64)
    m.handle(Start(2, 100 * 1024, headroom_bytes=100 * 1024))
    subs = of(Submit, m.advance(0.0))

    def shared(chunk, above):
        o = drifted(chunk, "w1", above)
        o.shared = True
        return o

    m.handle(ChunkDone(subs[0].id, shared(subs[0].chunk, 10 * 1024), at=1.0))
    m.handle(ChunkDone(subs[1].id, shared(subs[1].chunk, 95 * 1024), at=1.0))  # the other thread's memory
    assert m.budget_bytes == 90 * 1024, "one high start of a shared process is not where the worker stands"
    running = list(m.in_flight)
    for k in range(4):  # four more runs, each starting 30 KiB up
        sid = running.pop(0) if running else of(Submit, m.advance(2.0 + k))[0].id
        m.handle(ChunkDone(sid, shared(m.in_flight[sid].chunk, 30 * 1024), at=2.0 + k))
        running = [s for s in m.in_flight if s not in running] + running
    assert m.budget_bytes == 70 * 1024, "every recent start 30 KiB up or more: the worker holds that"


def test_a_gated_queue_looks_again_only_after_a_write_or_a_new_chunk_and_then_finds_what_became_ready():
    from memchunk_prefect.core.plan_queue import Gate, Pending, PlanQueue

    spec = MapSpec(operator="op", operator_key=KEY, shape=(4, 4, 4), halo=(0, 0, 0), whole_traces=True, gated=True)
    gate = Gate(spec)
    first, second = Chunk((0, 0, 0), (2, 4, 4)), Chunk((2, 0, 0), (4, 4, 4))
    queue = PlanQueue(spec, [Pending(second, "continue"), Pending(first, "continue")])
    assert queue.pop_first(gate) is None  # nothing written yet
    seen = []
    gate.ready = lambda chunk: seen.append(chunk) or Gate.ready(gate, chunk)  # type: ignore[method-assign]
    assert queue.pop_first(gate) is None and seen == []  # nothing changed: not looked at again
    gate.add([first], complete=False)
    assert queue.pop_first(gate).chunk == first and len(queue) == 1  # the write is looked for
    assert queue.pop_first(gate) is None
    queue.push_front([Pending(first, "retry-smaller")])  # a chunk queued again: looked for
    assert queue.pop_first(gate).chunk == first
    gate.add([second], complete=False)
    assert queue.pop_first(gate).chunk == second and len(queue) == 0


def test_a_gate_finds_each_chunk_ready_exactly_when_the_writes_cover_its_block_whatever_the_two_cuts():
    """The gate finds the writes a block meets through a grid over the line axes: checked against covers() over
    every write, for two unrelated cuts of one volume (a halo of 2, chunks cut in time too), writes in random order."""
    import random

    from memchunk_prefect.core.chunks import covers, with_halo
    from memchunk_prefect.core.plan_queue import Gate

    def cut(rng, shape):
        edges = [sorted({0, s, *rng.sample(range(1, s), k)}) for s, k in zip(shape, (5, 4, 1))]
        return [Chunk((a0, b0, c0), (a1, b1, c1)) for a0, a1 in zip(edges[0], edges[0][1:])
                for b0, b1 in zip(edges[1], edges[1][1:]) for c0, c1 in zip(edges[2], edges[2][1:])]

    shape = (300, 200, 50)
    for seed in range(3):
        rng = random.Random(seed)
        spec = MapSpec(operator="op", operator_key=KEY, shape=shape, halo=(2, 2, 0), whole_traces=False, gated=True)
        gate, upstream, mine = Gate(spec), cut(rng, shape), cut(rng, shape)
        rng.shuffle(upstream)
        written = []
        for w in upstream:
            gate.add([w], complete=False)
            written.append(w)
            for c in mine:
                assert gate.ready(c) == covers(written, with_halo(c, spec.halo, shape)[0]), (seed, c, len(written))
        assert all(gate.ready(c) for c in mine)
