"""The monitor's logic through its seam: fake probes give numbers in, figures come out.

No test here allocates more than 64 MiB. The only mock of a library is a fake
``pynvml`` module (no NVIDIA GPU exists on the build machines).
"""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
import types
import warnings

import numpy as np
import pytest

import memchunk_prefect
from memchunk_prefect.core.errors import MeasurementError
from memchunk_prefect.core.records import Observation
from memchunk_prefect.run import gpu_energy, probes
from memchunk_prefect.run import monitor as mon
from memchunk_prefect.run import process_memory as pm
from memchunk_prefect.run.monitor import Measurement, Monitor
from memchunk_prefect.run.probes import MemoryProbe, SamplingProbe, VmHWMProbe
from memchunk_prefect.run.process_memory import SharedMeasurementWarning

MiB = 2**20


class FakeProbe:
    """Process RSS as a number the test moves by hand."""

    method = "fake"

    def __init__(self, rss: int = 100 * MiB) -> None:
        self.rss = rss
        self.peak = rss
        self.resets = 0
        self.open = 0
        self.lock = threading.Lock()

    def start(self) -> None:
        self.open += 1

    def stop(self) -> None:
        self.open -= 1

    def reset_peak(self) -> None:
        self.resets += 1
        self.peak = self.rss

    def current_bytes(self) -> int:
        return self.rss

    def peak_bytes(self) -> int:
        return max(self.peak, self.rss)

    def allocate(self, n: int) -> None:
        with self.lock:
            self.rss += n
            self.peak = max(self.peak, self.rss)

    def free(self, n: int) -> None:
        with self.lock:
            self.rss -= n


@pytest.fixture(autouse=True)
def fresh_process_state(monkeypatch):
    """Each test sees a process that has not warned yet, has no NVML decision cached, and no worker."""
    monkeypatch.setattr(pm, "_WARNED_SHARED", set())
    monkeypatch.setattr(gpu_energy, "_NVML", {})
    monkeypatch.setattr(gpu_energy, "_RAPL", {})
    monkeypatch.setattr(pm, "_dask_nthreads", lambda: None)
    monkeypatch.setattr(pm._ACTIVE, "high_water", None)  # each test's probe is its own process's memory


def quiet_monitor(probe: MemoryProbe, **kw) -> Monitor:
    return Monitor(probe=probe, gpu=False, energy=False, **kw)


# ----------------------------------------------------------------------------- figures through the seam


def test_peak_is_the_highest_rss_above_the_resting_level_before_the_run():
    probe = FakeProbe(rss=100 * MiB)
    with quiet_monitor(probe).track() as run:
        probe.allocate(300 * MiB)
        probe.free(200 * MiB)  # the run ends holding 100 MiB more than it started with
    m = run.measurement
    assert m.peak_bytes == 300 * MiB
    assert m.baseline_bytes == 100 * MiB
    assert m.process_peak_bytes == 400 * MiB
    assert (m.method, m.shared, m.threads, m.error, m.outcome) == ("fake", False, 1, None, "ok")
    assert probe.resets == 1 and probe.open == 0


def test_peak_counts_from_the_reset_not_from_an_earlier_higher_peak():
    probe = FakeProbe(rss=100 * MiB)
    probe.allocate(900 * MiB)
    probe.free(900 * MiB)  # an earlier task peaked at 1000 MiB
    with quiet_monitor(probe).track() as run:
        probe.allocate(10 * MiB)
    assert run.measurement.peak_bytes == 10 * MiB


def test_a_run_that_takes_the_process_above_the_most_it_held_says_by_how_much():
    """Growth is counted from the process's high-water mark (earlier runs, and what it held between them),
    not from the run's start: memory held before and freed costs no first touch when held again."""
    probe = FakeProbe(rss=100 * MiB)
    monitor = quiet_monitor(probe)
    grew = []
    for hold in (300, 300, 200, 500):
        with monitor.track() as run:
            probe.allocate(hold * MiB)
            probe.free(hold * MiB)
        grew.append(run.measurement.grew_bytes // MiB)
        assert run.measurement.observation_fields()["grew_bytes"] == run.measurement.grew_bytes
    probe.allocate(700 * MiB)  # between runs (an untracked task, a large import): the process held 800 MiB
    probe.free(700 * MiB)
    with monitor.track() as run:
        probe.allocate(650 * MiB)
        probe.free(650 * MiB)
    assert grew == [300, 0, 0, 200] and run.measurement.grew_bytes == 0


def test_a_run_says_what_it_left_held_in_the_process_and_nothing_when_it_freed_everything():
    probe = FakeProbe(rss=100 * MiB)
    monitor = quiet_monitor(probe)
    with monitor.track() as first:
        probe.allocate(150 * MiB)  # a library's first use: kept for the process's life
        probe.allocate(40 * MiB)  # the block's working memory, freed
        probe.free(40 * MiB)
    with monitor.track() as later:
        probe.allocate(40 * MiB)
        probe.free(40 * MiB)
    assert (first.measurement.peak_bytes, first.measurement.retained_bytes) == (190 * MiB, 150 * MiB)
    assert (later.measurement.peak_bytes, later.measurement.retained_bytes) == (40 * MiB, 0)
    assert later.measurement.baseline_bytes == 250 * MiB
    assert first.measurement.observation_fields()["retained_bytes"] == 150 * MiB


def test_a_run_that_frees_below_its_start_has_zero_peak_not_a_negative_one():
    probe = FakeProbe(rss=100 * MiB)
    with quiet_monitor(probe).track() as run:
        probe.free(50 * MiB)
    assert run.measurement.peak_bytes == 0


def test_wall_and_thread_cpu_seconds():
    probe = FakeProbe()
    with quiet_monitor(probe).track() as sleeping:
        time.sleep(0.1)
    with quiet_monitor(probe).track() as busy:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            pass
    assert 0.1 <= sleeping.measurement.seconds < 0.5
    assert sleeping.measurement.cpu_seconds < 0.05
    assert busy.measurement.cpu_seconds > 0.05
    assert busy.measurement.process_cpu_seconds >= busy.measurement.cpu_seconds * 0.9


@pytest.mark.skipif(not hasattr(__import__("resource"), "RUSAGE_THREAD"), reason="no per-thread rusage (Linux only)")
def test_kernel_time_is_where_faulting_in_fresh_memory_lands_and_a_busy_loop_has_little():
    """The time model learns a run that grew its worker less its ``sys_seconds``: that must be the run's own
    thread's kernel time, large for memory touched for the first time and small for pure computation."""
    probe = FakeProbe()
    with quiet_monitor(probe).track() as touching:
        a = np.ones(256 * MiB, np.uint8)  # a fresh mapping: every page faulted in and zeroed by the kernel
        del a
    with quiet_monitor(probe).track() as busy:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.1:
            pass
    t, b = touching.measurement, busy.measurement
    assert t.sys_seconds is not None and b.sys_seconds is not None
    assert t.sys_seconds > 0.005 and t.sys_seconds <= t.cpu_seconds + 0.01
    assert b.sys_seconds < 0.5 * b.cpu_seconds
    assert t.observation_fields()["sys_seconds"] == t.sys_seconds


# ----------------------------------------------------------------------------- failures keep their figures


def test_a_memory_error_still_gives_a_censored_measurement_attached_to_the_exception():
    probe = FakeProbe(rss=100 * MiB)
    with pytest.raises(MemoryError) as info:
        with quiet_monitor(probe).track() as run:
            probe.allocate(700 * MiB)
            raise MemoryError("Unable to allocate 8.0 GiB")
    m = run.measurement
    assert m is not None and info.value.memchunk_measurement is m
    assert m.peak_bytes == 700 * MiB
    assert m.outcome == "memory_error" and m.censored
    assert "Unable to allocate 8.0 GiB" in m.error
    assert m.observation_fields()["censored"] is True


def test_measure_reraises_the_original_exception_with_the_measurement_attached():
    probe = FakeProbe()
    boom = ValueError("bad block (3, 0, 7)")

    def fails():
        probe.allocate(5 * MiB)
        raise boom

    with pytest.raises(ValueError) as info:
        quiet_monitor(probe).measure(fails)
    assert info.value is boom
    m = info.value.memchunk_measurement
    assert (m.outcome, m.peak_bytes, m.censored) == ("error", 5 * MiB, False)
    # The figure survives the trip from a worker to the flow process.
    back = pickle.loads(pickle.dumps(info.value))
    assert back.memchunk_measurement == m


def test_numpy_allocation_failure_is_a_memory_error_outcome():
    with pytest.raises(MemoryError) as info:
        memchunk_prefect.measure(np.empty, 2**60, dtype=np.uint8)
    assert info.value.memchunk_measurement.outcome == "memory_error"


def test_measure_passes_every_keyword_to_the_function():
    def fn(a, *, method, interval, tracemalloc):
        return a, method, interval, tracemalloc

    result, m = quiet_monitor(FakeProbe()).measure(fn, 1, method="m", interval=2, tracemalloc="t")
    assert result == (1, "m", 2, "t")
    result, m = memchunk_prefect.measure(fn, 1, method="m", interval=2, tracemalloc="t")
    assert result == (1, "m", 2, "t") and isinstance(m, Measurement)


# ----------------------------------------------------------------------------- several threads in one process


def test_two_threads_tracking_at_once_are_both_marked_shared_and_neither_resets_the_others_peak():
    probe = FakeProbe(rss=100 * MiB)
    monitor = quiet_monitor(probe)
    a_open, b_done = threading.Event(), threading.Event()
    out = {}

    def task_a():
        with monitor.track() as run:
            probe.allocate(500 * MiB)  # A's spike...
            probe.free(500 * MiB)
            a_open.set()
            b_done.wait(5)
        out["a"] = run.measurement

    def task_b():
        a_open.wait(5)
        with monitor.track() as run:  # ...must not be wiped by B starting: no reset while A is open
            probe.allocate(20 * MiB)
        out["b"] = run.measurement
        b_done.set()

    with pytest.warns(SharedMeasurementWarning, match="One thread per worker process"):
        threads = [threading.Thread(target=task_a), threading.Thread(target=task_b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
    assert probe.resets == 1
    assert out["a"].peak_bytes == 500 * MiB  # A's own spike is never lost
    # B only added 20 MiB, but the process peak it can see includes A's spike: an upper bound, flagged.
    assert out["b"].peak_bytes == 500 * MiB
    assert out["a"].shared and out["b"].shared
    assert out["a"].threads == 2 and out["b"].threads == 2
    assert out["a"].retained_bytes is None and out["b"].retained_bytes is None, "the other's memory is not its own"
    records = [Observation("k", 1, (1, 1, 1), 4, **out[name].observation_fields()) for name in "ab"]
    assert [o.alone for o in records] == [False, False], "the memory model sets overlapped peaks aside"


def test_a_run_started_beside_another_records_what_the_other_held_and_the_resting_level_stays_the_idle_one(recwarn):
    probe = FakeProbe(rss=100 * MiB)
    monitor = quiet_monitor(probe)
    with monitor.track() as a:
        probe.allocate(300 * MiB)  # A mid-peak when B starts
        assert pm.process_resting_bytes(probe.rss) == 100 * MiB  # the level before A, not A's memory
        assert pm.process_resting_bytes(probe.rss, grown_bytes=5 * MiB) == 105 * MiB  # plus known growth
        with monitor.track() as b:
            probe.allocate(10 * MiB)
        probe.free(310 * MiB)
    assert a.measurement.others_bytes == 0 and a.measurement.baseline_bytes == 100 * MiB
    assert b.measurement.others_bytes == 300 * MiB and b.measurement.baseline_bytes == 400 * MiB
    assert b.measurement.observation_fields()["others_bytes"] == 300 * MiB
    assert pm.process_resting_bytes(probe.rss) == 100 * MiB  # nothing open: the RSS is the level


def test_shared_warning_is_said_once_per_process(recwarn):
    probe = FakeProbe()
    monitor = quiet_monitor(probe)
    for _ in range(3):
        with monitor.track():
            with monitor.track() as inner:  # nested = two runs open at once
                pass
        assert inner.measurement.shared
    assert len([w for w in recwarn if w.category is SharedMeasurementWarning]) == 1


def test_a_run_alone_after_shared_runs_is_clean_again(recwarn):
    probe = FakeProbe()
    monitor = quiet_monitor(probe)
    with monitor.track():
        with monitor.track():
            pass
    with monitor.track() as alone:
        probe.allocate(MiB)
    assert not alone.measurement.shared and alone.measurement.threads == 1
    assert alone.measurement.peak_bytes == MiB


def test_a_dask_worker_with_several_threads_marks_every_run_shared(monkeypatch):
    monkeypatch.setattr(pm, "_dask_nthreads", lambda: 4)
    monitor = quiet_monitor(FakeProbe())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = []
        for _ in range(3):
            with monitor.track() as run:
                pass
            runs.append(run.measurement)
    assert all(m.shared and m.threads == 4 for m in runs)
    assert [w.category for w in caught] == [SharedMeasurementWarning]
    assert "4 threads" in str(caught[0].message)


def test_a_run_alone_on_a_worker_with_several_threads_still_says_what_it_left_held(monkeypatch):
    """A first use (a library loaded and kept) on a 2-thread worker is told apart when its run had the process to
    itself; its peak is then flagged shared (another run could have started) but what it left is its own."""
    monkeypatch.setattr(pm, "_dask_nthreads", lambda: 2)
    probe = FakeProbe(rss=100 * MiB)
    monitor = quiet_monitor(probe)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SharedMeasurementWarning)
        with monitor.track() as first:
            probe.allocate(150 * MiB)  # kept for the process's life
            probe.allocate(40 * MiB)
            probe.free(40 * MiB)
        with monitor.track() as later:
            probe.allocate(40 * MiB)
            probe.free(40 * MiB)
    assert first.measurement.shared and first.measurement.retained_bytes == 150 * MiB
    assert later.measurement.retained_bytes == 0
    records = [Observation("k", 1, (1, 1, 1), 4, **r.measurement.observation_fields()) for r in (first, later)]
    assert [o.alone for o in records] == [True, True], "its peak is its own: the memory model learns it"


def test_a_dask_worker_with_one_thread_gives_clean_figures(monkeypatch):
    monkeypatch.setattr(pm, "_dask_nthreads", lambda: 1)
    with quiet_monitor(FakeProbe()).track() as run:
        pass
    assert not run.measurement.shared


# ----------------------------------------------------------------------------- settings and real probes


def test_settings_are_checked_and_errors_quote_the_values():
    with pytest.raises(ValueError, match="'vmhwn'"):
        Monitor(method="vmhwn")
    with pytest.raises(ValueError, match="interval_seconds.*0.0"):
        Monitor(interval_seconds=0.0)
    with pytest.raises(ValueError, match="5"):
        SamplingProbe(interval_seconds=5)
    with pytest.raises(TypeError, match="MemoryProbe.*object"):
        Monitor(probe=object())


def test_vmhwm_is_refused_where_clear_refs_is_not_writable(monkeypatch):
    monkeypatch.setattr(probes, "_CLEAR_REFS_OK", {os.getpid(): False})
    with pytest.raises(MeasurementError, match="clear_refs.*method='psutil'"):
        VmHWMProbe()
    assert probes.make_probe("auto").method == "psutil"


def test_configure_replaces_the_default_monitor_and_restores_it():
    try:
        assert mon.configure(method="psutil").method == "psutil"
        _, m = memchunk_prefect.measure(sum, [1, 2])
        assert m.method == "psutil"
    finally:
        mon.configure()
    assert mon.default_monitor() == Monitor()


needs_vmhwm = pytest.mark.skipif(not probes.clear_refs_writable(), reason="/proc/self/clear_refs not writable here")


@needs_vmhwm
def test_vmhwm_sees_a_64_mib_numpy_spike_already_freed_and_tracemalloc_agrees():
    n = 64 * MiB

    def spike():
        a = np.ones(n // 8)  # allocated and touched, then freed before the run ends
        return float(a[-1])

    _, m = Monitor(method="vmhwm", tracemalloc=True, gpu=False).measure(spike)
    assert m.method == "vmhwm"
    assert abs(m.peak_bytes - n) / n < 0.05, m
    assert abs(m.python_heap_peak_bytes - n) / n < 0.05, m


def test_vmhwm_counts_a_real_numpy_block_held_for_the_first_time_as_growth_and_again_as_none():
    n = 256 * MiB

    def spike(size):
        a = np.ones(size // 8)
        return float(a[-1])

    monitor = Monitor(method="vmhwm", gpu=False, energy=False)
    _, first = monitor.measure(spike, n)
    _, again = monitor.measure(spike, n)
    _, larger = monitor.measure(spike, 2 * n)
    # The first 256 MiB block may reuse some of what earlier tests in this process freed; it cannot be all new.
    assert first.grew_bytes <= first.peak_bytes
    assert again.grew_bytes < 0.05 * n, again
    assert abs(larger.grew_bytes - n) < 0.1 * n, larger


def test_vmhwm_sees_a_real_numpy_block_a_run_keeps_as_left_held_and_one_it_frees_as_not():
    n = 128 * MiB
    kept: list = []

    def run(keep):
        a = np.ones(n // 8)
        if keep:
            kept.append(a)
        return float(a[-1])

    monitor = Monitor(method="vmhwm", gpu=False, energy=False)
    _, freed = monitor.measure(run, False)
    _, held = monitor.measure(run, True)
    assert freed.retained_bytes < 0.05 * n, freed
    assert abs(held.retained_bytes - n) < 0.05 * n, held
    kept.clear()


def test_the_sampling_thread_ends_with_the_run():
    with Monitor(method="psutil", gpu=False).track() as run:
        assert any(t.name == "memchunk-rss-sampler" for t in threading.enumerate())
    assert not any(t.name == "memchunk-rss-sampler" for t in threading.enumerate())
    assert run.measurement.method == "psutil"



def test_a_run_that_allocates_first_peaks_early_and_one_that_allocates_last_peaks_late():
    n = 64 * MiB

    def run(early):
        time.sleep(0.0 if early else 0.6)
        a = np.ones(n // 8)  # faulting 64 MiB in takes 0.02-0.2 s here
        time.sleep(0.6 if early else 0.1)
        return float(a[-1])

    monitor = Monitor(gpu=False, energy=False)
    _, first = monitor.measure(run, True)
    _, last = monitor.measure(run, False)
    assert 0 <= first.rise_50 <= first.rise_90 < 0.5, first
    assert 0.6 < last.rise_50 <= last.rise_90 < 0.95, last
    assert (first.observation_fields()["rise_90"], last.observation_fields()["rise_50"]) == (first.rise_90,
                                                                                              last.rise_50)
    assert not any(t.name == "memchunk-rise" for t in threading.enumerate())


# The nested runs share their process on purpose: the warning that says so (once per process, so only where no
# earlier test in the process said it) is not this test's subject.
@pytest.mark.filterwarnings("ignore::memchunk_prefect.run.process_memory.SharedMeasurementWarning")
def test_no_rise_for_a_short_run_a_substitute_probe_runs_beside_another_or_when_turned_off():
    _, short = Monitor(gpu=False, energy=False).measure(np.ones, MiB)
    _, faked = Monitor(gpu=False, energy=False, probe=FakeProbe()).measure(time.sleep, 0.3)
    _, off = Monitor(gpu=False, energy=False, rise=False).measure(time.sleep, 0.3)
    monitor = Monitor(gpu=False, energy=False)
    with monitor.track() as outer:
        with monitor.track() as inner:
            time.sleep(0.3)
    assert [m.rise_90 for m in (short, faked, off, outer.measurement, inner.measurement)] == [None] * 5


def test_rise_shares_time_the_first_samples_at_half_and_most_of_the_peak_and_refuse_what_they_cannot_tell():
    from memchunk_prefect.run.rise import MIN_SAMPLES, rise_shares

    climb = [(0.01 * i, 100 + i) for i in range(100)]  # memory rising 1 byte per 10 ms for 1 s
    assert rise_shares(climb, 100, 1.0) == pytest.approx((0.5, 0.89), abs=0.011)
    assert rise_shares(climb[:MIN_SAMPLES - 1], 100, 1.0) is None  # too few samples
    assert rise_shares([(0.01 * i, 100) for i in range(50)], 100, 0.5) is None  # nothing above the baseline
    assert rise_shares(climb, 100, 1.0, exact_peak=200) is None  # the peak fell between two samples
    assert rise_shares(climb, 100, 1.0, exact_peak=100) is not None


def test_reads_thin_out_as_a_run_goes_on_so_a_long_run_costs_few_of_them(monkeypatch):
    from memchunk_prefect.run import rise

    monkeypatch.setattr(rise, "SAMPLES_PER_RUN", 10)
    watch = rise.RiseWatch(interval_seconds=0.001)
    watch.start()
    time.sleep(0.4)  # 400 intervals of 1 ms; after the first 10 ms, a read every tenth of the time so far
    watch.stop(0, 0.4)
    times = [t for t, _ in watch.samples]
    assert rise.MIN_SAMPLES <= len(times) < 80 and times[-1] > 0.2, times
    assert times[-1] - times[-2] >= 0.02, times


# ----------------------------------------------------------------------------- GPU: NVML absent, NVML faked


def test_no_nvml_module_gives_empty_gpu_fields_and_no_warning(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, m = Monitor(method="psutil").measure(lambda: None)
    assert (m.gpu_peak_bytes, m.gpu_name) == (None, None)


class FakeNVMLError(Exception):
    pass


def fake_pynvml(*, init_fails=False, processes=None, energy_mj=None, names=("Fake GPU 0", "Fake GPU 1")):
    """A stand-in for the nvidia-ml-py module: two devices, processes and energy from mutable state."""
    state = types.SimpleNamespace(inits=0, processes=processes or {0: [], 1: []}, energy_mj=energy_mj or [0, 0])
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.state = state

    def nvmlInit():
        state.inits += 1
        if init_fails:
            raise FakeNVMLError("NVML Shared Library Not Found")

    m.nvmlInit = nvmlInit
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: names[h]
    m.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in state.processes[h]
    ]
    m.nvmlDeviceGetTotalEnergyConsumption = lambda h: state.energy_mj[h]
    return m


def test_nvml_init_failure_gives_empty_gpu_fields_decided_once_per_process(monkeypatch):
    fake = fake_pynvml(init_fails=True)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            _, m = Monitor(method="psutil").measure(lambda: None)
            assert (m.gpu_peak_bytes, m.gpu_name, m.energy_source) == (None, None, None)
    assert fake.state.inits == 1


def test_fake_gpu_reports_this_process_peak_and_the_energy_counter_difference(monkeypatch):
    n = 3 * 2**30
    me, other = os.getpid(), os.getpid() + 1
    fake = fake_pynvml(processes={0: [(other, 8 * 2**30)], 1: []}, energy_mj=[1_000, 50_000])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monitor = Monitor(probe=FakeProbe(), gpu=True, gpu_interval_seconds=0.002, energy=True)

    with monitor.track() as run:
        fake.state.processes[1] = [(me, n)]      # this process grabs N bytes on device 1...
        time.sleep(0.1)                           # ...holds them for 50 sampling intervals...
        fake.state.processes[1] = [(me, n // 4)]  # ...and frees most before the run ends
        fake.state.energy_mj = [1_000 + 2_500, 50_000 + 500]
    m = run.measurement
    assert m.gpu_peak_bytes == n  # the other process's 8 GiB on device 0 is not ours
    assert m.gpu_name == "Fake GPU 1"
    assert m.energy_joules == pytest.approx(3.0)  # (2500 + 500) mJ
    assert m.energy_source == "nvml"
    assert not any(t.name == "memchunk-gpu-sampler" for t in threading.enumerate())


def test_fake_gpu_unused_by_this_process_reports_zero_bytes(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    _, m = Monitor(probe=FakeProbe()).measure(lambda: None)
    assert m.gpu_peak_bytes == 0 and m.gpu_name == "Fake GPU 0, Fake GPU 1"


# ----------------------------------------------------------------------------- CPU energy: RAPL counters


def write_zone(root, name, energy_uj, max_uj=1_000_000):
    zone = root / name
    zone.mkdir()
    (zone / "energy_uj").write_text(f"{energy_uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def test_rapl_energy_sums_packages_handles_wrap_around_and_skips_subzones(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    p0 = write_zone(tmp_path, "intel-rapl:0", 990_000)
    p1 = write_zone(tmp_path, "intel-rapl:1", 100)
    sub = write_zone(tmp_path, "intel-rapl:0:0", 5)  # core sub-zone of package 0: already counted in it
    monkeypatch.setattr(gpu_energy, "_RAPL_GLOB", str(tmp_path / "intel-rapl:*"))
    with Monitor(probe=FakeProbe()).track() as run:
        (p0 / "energy_uj").write_text("20000\n")  # wrapped: 10_000 + 20_000 µJ
        (p1 / "energy_uj").write_text("1000100\n")  # +1_000_000 µJ
        (sub / "energy_uj").write_text("999999\n")
    assert run.measurement.energy_joules == pytest.approx(1.03)
    assert run.measurement.energy_source == "rapl"


def test_unreadable_rapl_gives_no_energy(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    zone = tmp_path / "intel-rapl:0"
    zone.mkdir()  # a zone with no readable counter (as for non-root users on Linux >= 5.10)
    monkeypatch.setattr(gpu_energy, "_RAPL_GLOB", str(tmp_path / "intel-rapl:*"))
    _, m = Monitor(probe=FakeProbe()).measure(lambda: None)
    assert (m.energy_joules, m.energy_source) == (None, None)
