"""Workers slow rather than dead: the pure rule (here) and a real duty-cycled worker (tests/test_interruptions.py)."""

import pytest

from memchunk_prefect.core.errors import RunnerConfigError
from memchunk_prefect.core.records import Observation
from memchunk_prefect.core.settings import PolicySettings
from memchunk_prefect.core.stragglers import slow_workers


def runs(worker, *seconds, elements=100_000, outcome="ok"):
    return [Observation("k", elements, (1, 1, elements), 4 * elements, 1, seconds=s, worker=worker, outcome=outcome)
            for s in seconds]


RULE = dict(factor=4.0, min_runs=2, min_seconds=1.0)


def test_a_worker_ten_times_slower_over_two_chunks_is_found_with_its_figures():
    (w,) = slow_workers(runs("slow", 3.0, 3.2) + runs("a", 0.3, 0.31, 0.29) + runs("b", 0.3, 0.32), **RULE)
    assert w.worker == "slow" and w.runs == 2
    assert w.ratio == pytest.approx(3.1 / 0.3, rel=0.01)
    assert "slow ran 2 chunk(s) 10.3x slower per element" in w.describe()


def test_one_slow_first_run_is_the_kernel_paying_for_new_memory_not_a_slow_worker():
    # benchmarks.studies.first_touch: a process's first large call took up to 1.42 s where later ones took 0.30 s.
    assert slow_workers(runs("fresh", 1.42) + runs("a", 0.3, 0.3, 0.3), **RULE) == []
    assert slow_workers(runs("fresh", 1.42, 0.30) + runs("a", 0.3, 0.3, 0.3), **RULE) == []


def test_seconds_are_compared_per_element_so_a_larger_chunk_is_not_a_slower_worker():
    big = runs("big", 3.0, 3.0, elements=1_000_000)
    assert slow_workers(big + runs("a", 0.3, 0.3), **RULE) == []


def test_a_difference_of_less_than_min_seconds_a_chunk_is_not_worth_a_warning():
    assert slow_workers(runs("slow", 0.5, 0.5) + runs("a", 0.05, 0.05), **RULE) == []
    assert [w.worker for w in slow_workers(runs("slow", 0.5, 0.5) + runs("a", 0.05, 0.05),
                                           **{**RULE, "min_seconds": 0.2})] == ["slow"]


def test_runs_that_did_not_finish_and_a_lone_worker_say_nothing():
    assert slow_workers(runs("slow", 9.0, 9.0, outcome="memory_error") + runs("a", 0.3, 0.3), **RULE) == []
    assert slow_workers(runs("only", 9.0, 9.0, 9.0), **RULE) == [], "nobody to be slower than"


def test_a_factor_at_or_below_one_is_refused_with_what_to_pass_instead():
    with pytest.raises(RunnerConfigError, match=r"slow_worker_factor.*above 1.*None to never look for slow workers.*got 0.5"):
        PolicySettings(slow_worker_factor=0.5)
    assert PolicySettings(slow_worker_factor=None).slow_worker_factor is None


def test_the_look_at_a_maps_end_names_a_worker_whose_second_vote_came_within_a_second_of_the_last_look():
    """A slow worker's chunks are often a map's last: its second run can finish just after a look, with none after."""
    import time
    from types import SimpleNamespace

    from memchunk_prefect.run.executor import ChunkedMap, _SlowWatch

    said = []
    watch = _SlowWatch(finished_runs=runs("slow", 3.0, 3.2) + runs("a", 0.3, 0.31, 0.29), slow_checked=time.monotonic())
    cmap = SimpleNamespace(ctx=SimpleNamespace(policy=PolicySettings()), slow_watch=watch, name="op",
                           observers=SimpleNamespace(emit=lambda event, w: said.append((event, w.worker))))
    ChunkedMap.look_for_slow_workers(cmap)
    assert said == [], "looked again within a second of the last look"
    ChunkedMap.look_for_slow_workers(cmap, final=True)
    assert said == [("on_slow_worker", "slow")]
    ChunkedMap.look_for_slow_workers(cmap, final=True)
    assert said == [("on_slow_worker", "slow")], "a worker is named once per map"
