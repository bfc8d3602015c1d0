"""Fuzzing: bad files and nonsense arguments end in a typed error, never anything else (issue 8).

Three surfaces, each with the same contract — nothing but a
:class:`~memchunk_prefect.core.errors.MemchunkError` subclass may escape:

- the SEG-Y reader (:func:`open_segy` and reading values), on the real files in
  ``shared/data/segy`` with header fields overwritten, bytes flipped, the file
  cut short, and on random garbage; a separate subprocess canary runs a seeded
  batch so a crash inside segyio (a segfault) fails one test instead of killing
  the test session;
- the chunk arithmetic (:mod:`memchunk_prefect.core.chunks`) and the planner
  (:mod:`memchunk_prefect.core.policy`): valid inputs give tilings that cover the
  volume exactly; nonsense inputs give typed errors;
- the ``memchunk`` command line: any argv gives exit code 0, 1 or 2 and no traceback.

Every example is bounded (few examples, small volumes, no deadline flakiness);
the whole module runs in well under a minute on two cores.
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from memchunk_prefect.cli import app as cli
from memchunk_prefect.core.chunks import (
    Chunk,
    balanced_grid,
    check_halo,
    check_shape,
    covers_exactly,
    grid,
    normalize_halo,
    split,
    uncovered_boxes,
    with_halo,
)
from memchunk_prefect.core.errors import MemchunkError
from memchunk_prefect.core.policy import plan, split_chunk
from memchunk_prefect.core.probe import probe_plan
from memchunk_prefect.core.records import Prediction
from memchunk_prefect.core.units import parse_bytes
from memchunk_prefect.io.segy import close_handles
from memchunk_prefect.io.segy_xarray import open_segy
from memchunk_prefect.learn.store import Store
from memchunk_prefect.testing import seed_store

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SMALL = settings(FUZZ, max_examples=60)

SEGY_FILES = ("small.sgy", "f3.sgy", "tiny.sgy", "small-lsb.sgy", "Format8msb.sgy")

#: Binary-header fields (byte offset inside the 400-byte binary header, struct code) worth breaking.
BINARY_FIELDS = {
    "interval": (16, "H"), "samples": (20, "H"), "format": (24, "h"), "sorting": (28, "h"),
    "revision": (300, "H"), "fixed_length": (302, "h"), "ext_headers": (304, "h"),
}
#: Trace-header fields (0-based offset inside the 240-byte trace header, struct code).
TRACE_FIELDS = {
    "offset": (36, "i"), "scalar": (70, "h"), "sample_count": (114, "H"), "interval": (116, "H"),
    "cdp_x": (180, "i"), "cdp_y": (184, "i"), "iline": (188, "i"), "xline": (192, "i"),
}
STRUCT_RANGE = {"H": (0, 2**16 - 1), "h": (-2**15, 2**15 - 1), "i": (-2**31, 2**31 - 1)}


def _is_little(name: str) -> bool:
    return "lsb" in name


def _trace_size(data: bytes, little: bool) -> int:
    ns = struct.unpack(("<" if little else ">") + "H", data[3220:3222])[0]
    fmt = struct.unpack(("<" if little else ">") + "h", data[3224:3226])[0]
    return 240 + ns * {3: 2, 8: 1}.get(fmt, 4)


@st.composite
def mutated_segy(draw, segy_dir: Path) -> bytes:
    """A real SEG-Y file with 1-4 of: a binary-header field, a trace-header field, flipped bytes, a cut."""
    name = draw(st.sampled_from(SEGY_FILES))
    data = bytearray((segy_dir / name).read_bytes())
    little = _is_little(name)
    e = "<" if little else ">"
    trace_bytes = _trace_size(bytes(data), little)
    n_traces = (len(data) - 3600) // trace_bytes
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["binary", "trace", "flip", "truncate", "splice"]))
        if kind == "binary":
            off, code = BINARY_FIELDS[draw(st.sampled_from(sorted(BINARY_FIELDS)))]
            value = draw(st.one_of(st.sampled_from([0, 1, 2, 3, 5, 8, 16, 255]), st.integers(*STRUCT_RANGE[code])))
            value = max(STRUCT_RANGE[code][0], min(STRUCT_RANGE[code][1], value))
            data[3200 + off:3200 + off + struct.calcsize(code)] = struct.pack(e + code, value)
        elif kind == "trace":
            off, code = TRACE_FIELDS[draw(st.sampled_from(sorted(TRACE_FIELDS)))]
            t = draw(st.integers(0, max(0, n_traces - 1)))
            value = draw(st.one_of(st.sampled_from([0, 1, -1]), st.integers(*STRUCT_RANGE[code])))
            value = max(STRUCT_RANGE[code][0], min(STRUCT_RANGE[code][1], value))
            start = 3600 + t * trace_bytes + off
            if start + struct.calcsize(code) <= len(data):
                data[start:start + struct.calcsize(code)] = struct.pack(e + code, value)
        elif kind == "flip":
            for _ in range(draw(st.integers(1, 16)) if data else 0):  # an earlier cut may have left nothing
                i = draw(st.integers(0, len(data) - 1))
                data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            data = data[:draw(st.integers(0, len(data)))]
        else:  # overwrite a run of bytes anywhere (headers included) with garbage
            if data:
                i = draw(st.integers(0, len(data) - 1))
                junk = draw(st.binary(min_size=1, max_size=64))
                data[i:i + len(junk)] = junk
    return bytes(data)


def garbage_segy() -> st.SearchStrategy[bytes]:
    """Random bytes, some of them behind a plausible 3600-byte header (so the header checks pass)."""
    header = st.builds(
        lambda text, ns, fmt, ext: b" " * 3200 + bytes(16) + struct.pack(">H", 4000) + bytes(2)
        + struct.pack(">H", ns) + bytes(2) + struct.pack(">h", fmt) + bytes(278) + struct.pack(">h", ext)
        + bytes(94),
        st.none(), st.integers(0, 300), st.sampled_from([1, 2, 3, 5, 8, 0, 99]), st.integers(-2, 2))
    return st.one_of(st.binary(max_size=6000),
                     st.tuples(header, st.binary(max_size=6000)).map(lambda hb: hb[0] + hb[1]))


def read_a_few_values(path: Path) -> None:
    """What a user does first: open, look at the coordinates, read a trace, an inline and a corner."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # segyio warns about unknown formats; the contract is about raising
        da = open_segy(path)
        _ = da.coords["twt"].values, da.attrs["sample_interval_ms"]
        _ = da.isel(iline=0, xline=0).values
        _ = da.isel(iline=-1).values
        _ = da[-1, -1, -1].values


def only_typed_errors(call, *args, **kwargs):
    """Run ``call``; a MemchunkError is fine, anything else is re-raised as an assertion naming it."""
    try:
        return call(*args, **kwargs)
    except MemchunkError:
        return None
    except Exception as exc:  # the contract under test: no other exception may escape
        raise AssertionError(f"{call.__name__}{args!r} {kwargs!r} let an untyped {type(exc).__name__} escape: "
                             f"{exc}") from exc


@pytest.fixture(scope="module")
def fuzz_dir():
    with tempfile.TemporaryDirectory(prefix="memchunk-fuzz-") as d:
        yield Path(d)
    close_handles()


# =========================================================================== SEG-Y reader


def test_mutated_real_segy_files_raise_only_typed_errors(segy_dir, fuzz_dir):
    @settings(FUZZ, max_examples=300)
    @given(data=mutated_segy(segy_dir))
    def check(data):
        path = fuzz_dir / "mutated.sgy"
        close_handles()
        path.write_bytes(data)
        only_typed_errors(read_a_few_values, path)

    check()


def test_random_garbage_files_raise_only_typed_errors(fuzz_dir):
    @SMALL
    @given(data=garbage_segy())
    @example(data=b"")
    @example(data=b"\x00" * 3600)
    @example(data=b"\x00" * 3600 + b"\x01" * 240)
    def check(data):
        path = fuzz_dir / "garbage.sgy"
        close_handles()
        path.write_bytes(data)
        only_typed_errors(read_a_few_values, path)

    check()


def _plain_files() -> dict[str, bytes]:
    """Files that are not SEG-Y, as users rename them: text (the README), an image, an archive, nothing."""
    import zipfile

    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("survey.sgy", b"\x00" * 5000)
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_bytes()
    return {"readme": readme * 20, "png": b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 40,
            "zip": archive.getvalue(), "empty": b"", "json": b'{"zarr_format": 3}' * 300}


@pytest.mark.parametrize("name", sorted(_plain_files()))
@pytest.mark.parametrize("cut", [None, 3600, 5000])
def test_plain_files_given_a_segy_name_say_what_is_wrong(fuzz_dir, name, cut):
    """Whatever a file that is not SEG-Y holds (or the first bytes of it), the verdict is a typed error saying
    so: never one read from a binary header that text filled with garbage."""
    from memchunk_prefect.core.errors import NotSegyError, SegyTruncatedError

    path = fuzz_dir / f"{name}.sgy"
    close_handles()
    path.write_bytes(_plain_files()[name][:cut])
    with pytest.raises((NotSegyError, SegyTruncatedError)) as info:
        read_a_few_values(path)
    assert "not a SEG-Y file" in str(info.value), str(info.value)


@pytest.mark.parametrize("iline", [0, -1, 2, 190, 238, 240, 2**40, "a", None])
def test_bad_byte_locations_raise_a_typed_error(segy_dir, iline):
    with pytest.raises(MemchunkError, match="byte"):
        open_segy(segy_dir / "small.sgy", iline=iline)


CANARY = r"""
import random, struct, sys, warnings
from pathlib import Path
warnings.simplefilter("ignore")
from memchunk_prefect.core.errors import MemchunkError
from memchunk_prefect.io.segy import close_handles
from memchunk_prefect.io.segy_xarray import open_segy
src, out, seed, n = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
names = ["small.sgy", "f3.sgy", "tiny.sgy", "small-lsb.sgy", "Format8msb.sgy", "long.sgy", "broken.sgy"]
for k in range(n):
    data = bytearray((src / rng.choice(names)).read_bytes())
    for _ in range(rng.randint(1, 6)):
        op = rng.random()
        if not data:
            break
        if op < 0.4:  # the binary header and the first trace headers
            i = rng.randrange(min(3200, len(data) - 1), max(min(len(data), 3600 + 3 * 240), 3201))
            data[i:i + 2] = rng.randbytes(2)
        elif op < 0.8:
            i = rng.randrange(len(data))
            data[i] ^= 1 << rng.randrange(8)
        else:
            data = data[:rng.randrange(len(data) + 1)]
    close_handles()
    out.write_bytes(bytes(data))
    try:
        da = open_segy(out)
        da.isel(iline=0).values
        da[-1, -1, -1].values
    except MemchunkError:
        pass
    except Exception as exc:
        print(f"case {k}: untyped {type(exc).__name__}: {exc}")
print("survived", n)
"""


def test_segyio_never_crashes_the_process_on_broken_files(segy_dir, tmp_path):
    """A seeded batch of broken files in a child process: it must exit normally, not die of a signal."""
    proc = subprocess.run([sys.executable, "-c", CANARY, str(segy_dir), str(tmp_path / "c.sgy"), "8", "250"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the reader process died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    assert "survived 250" in proc.stdout
    assert "untyped" not in proc.stdout, proc.stdout


# =========================================================================== chunk arithmetic: valid inputs

shapes = st.tuples(st.integers(1, 40), st.integers(1, 40), st.integers(1, 60))


@FUZZ
@given(shape=shapes, data=st.data())
def test_grid_and_balanced_grid_tile_the_volume_exactly(shape, data):
    cs = data.draw(st.tuples(*(st.integers(1, 2 * n) for n in shape)), label="chunk_shape")
    counts = data.draw(st.tuples(*(st.integers(-2, n + 3) for n in shape)), label="counts")
    # covers_exactly compares chunks pairwise: keep tilings to a few hundred chunks
    assume(math.prod(-(-n // c) for n, c in zip(shape, cs)) <= 400)
    assume(math.prod(max(1, min(k, n)) for n, k in zip(shape, counts)) <= 400)
    g = grid(shape, cs)
    assert covers_exactly(g, shape)
    assert all(c.shape[a] <= cs[a] for c in g for a in range(3))
    b = balanced_grid(shape, counts)
    assert covers_exactly(b, shape)
    for a in range(3):  # near-equal pieces: sizes along an axis differ by at most one
        sizes = {c.shape[a] for c in b}
        assert max(sizes) - min(sizes) <= 1


@FUZZ
@given(shape=shapes, data=st.data())
def test_split_halves_cover_the_chunk_and_with_halo_trims_back(shape, data):
    start = data.draw(st.tuples(*(st.integers(0, n - 1) for n in shape)), label="start")
    stop = data.draw(st.tuples(*(st.integers(a + 1, n) for a, n in zip(start, shape))), label="stop")
    c = Chunk(start, stop)
    whole_traces = data.draw(st.booleans())
    pieces = split_chunk(c, whole_traces=whole_traces)
    if pieces:
        assert len(pieces) == 2 and sum(p.elements for p in pieces) == c.elements
        assert all(c.contains(p) for p in pieces) and pieces[0].intersect(pieces[1]) is None
        if whole_traces:
            assert all(p.shape[2] == c.shape[2] for p in pieces)
    else:
        assert c.shape[:2] == (1, 1) if whole_traces else c.elements == 1
    halo = data.draw(st.one_of(st.integers(0, 50), st.tuples(*(st.integers(0, 50) for _ in range(3)))))
    read, trim = with_halo(c, halo, shape)
    assert read.contains(c) and Chunk.whole(shape).contains(read)
    h = normalize_halo(halo)
    for a in range(3):
        assert read.start[a] == max(0, c.start[a] - h[a]) and read.stop[a] == min(shape[a], c.stop[a] + h[a])
        assert trim[a].stop - trim[a].start == c.shape[a] and read.start[a] + trim[a].start == c.start[a]


@FUZZ
@given(shape=shapes, data=st.data())
def test_uncovered_boxes_plus_the_done_chunks_cover_the_volume_and_never_overlap_them(shape, data):
    """Resuming computes exactly what no completed chunk covers: nothing twice, nothing missed."""
    n = data.draw(st.integers(0, 8), label="done chunks")
    done = []
    for _ in range(n):  # arbitrary boxes, overlapping each other (a re-cut resume) and sometimes the edge
        start = data.draw(st.tuples(*(st.integers(0, d - 1) for d in shape)))
        stop = data.draw(st.tuples(*(st.integers(a + 1, d + 3) for a, d in zip(start, shape))))
        done.append(Chunk(start, stop))
    boxes = uncovered_boxes(shape, done)
    whole = Chunk.whole(shape)
    assert all(whole.contains(b) for b in boxes)
    assert not any(b.intersect(c) for b in boxes for c in done), "a resumed box recomputes a completed chunk"
    assert all(a.intersect(b) is None for i, a in enumerate(boxes) for b in boxes[i + 1:])
    covered = np.zeros(shape, dtype=bool)
    for c in done:
        covered[tuple(slice(a, min(b, d)) for a, b, d in zip(c.start, c.stop, shape))] = True
    assert sum(b.elements for b in boxes) == int((~covered).sum())


def linear_predictor(bytes_per_element: float, fixed: float = 0.0):
    return lambda ext: Prediction(mean_bytes=fixed + 0.8 * bytes_per_element * math.prod(ext),
                                  upper_bytes=fixed + bytes_per_element * math.prod(ext), n_observations=10, ready=True)


@FUZZ
@given(shape=shapes, data=st.data())
def test_plan_covers_the_region_exactly_or_says_the_budget_is_too_small(shape, data):
    bpe = data.draw(st.floats(1.0, 200.0), label="bytes_per_element")
    budget = data.draw(st.integers(1, 4 * math.prod(shape) * 200), label="budget")
    halo = data.draw(st.tuples(*(st.integers(0, 6) for _ in range(3))), label="halo")
    whole = data.draw(st.booleans(), label="whole_traces")
    slots = data.draw(st.integers(-3, 12), label="slots")
    start = data.draw(st.tuples(*(st.integers(0, n - 1) for n in shape)), label="region start")
    region = Chunk(start, tuple(n for n in shape))
    p = only_typed_errors(plan, shape, budget_bytes=budget, estimates=linear_predictor(bpe), halo=halo,
                          slots=slots, whole_traces=whole, region=region)
    if p is None:
        return  # BudgetTooSmallError: fine when even the smallest chunk does not fit
    # A probe (the bound over the budget where the mean fits: too little known) covers the region with what it
    # leaves to plan; a plan covers it with its chunks, each within the budget.
    assert covers_exactly([Chunk(tuple(a - o for a, o in zip(c.start, start)),
                                 tuple(b - o for b, o in zip(c.stop, start))) for c in p.chunks + p.remainder],
                          region.shape)
    assert p.probe or p.upper_bound_bytes <= budget
    if whole:
        assert all(c.shape[2] == region.shape[2] for c in p.chunks)


@FUZZ
@given(shape=shapes, data=st.data())
def test_probe_chunks_and_remainder_cover_the_region_exactly(shape, data):
    budget = data.draw(st.integers(1, 10**9), label="budget")
    halo = data.draw(st.tuples(*(st.integers(0, 6) for _ in range(3))), label="halo")
    p = only_typed_errors(probe_plan, shape, budget_bytes=budget, halo=halo, slots=data.draw(st.integers(-2, 8)),
                          whole_traces=data.draw(st.booleans()), scale=data.draw(st.floats(0.01, 64.0)))
    if p is None:
        return  # BudgetTooSmallError: not even one column fits the budget
    assert p.probe and p.chunks
    assert covers_exactly(p.chunks + p.remainder, shape)


# =========================================================================== chunk arithmetic: nonsense

ints = st.integers(-10**20, 10**20)
nonsense_int_like = st.one_of(ints, st.sampled_from([0, -1, 1, 2**63, -2**63]))
junk = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.none(),
                 st.binary(max_size=3), st.booleans(), st.lists(st.integers(-3, 3), max_size=4))
anything = st.one_of(nonsense_int_like, junk, st.tuples(nonsense_int_like, nonsense_int_like, nonsense_int_like),
                     st.lists(st.one_of(nonsense_int_like, junk), max_size=4))


def _call_everything(a, b, c) -> None:
    """Every chunk-arithmetic entry point with integer-valued nonsense arguments (each alone)."""
    okc = Chunk((0, 0, 0), (4, 4, 4))
    only_typed_errors(check_shape, (a, b, c))
    only_typed_errors(normalize_halo, (a, b, c))
    only_typed_errors(normalize_halo, a)
    only_typed_errors(check_halo, (a, b, c), (8, 8, 8))
    only_typed_errors(check_halo, 1, (a, b, c))
    only_typed_errors(Chunk, (a, b, c), (a + 1, b + 1, c + 1))
    only_typed_errors(Chunk, (0, 0, 0), (a, b, c))
    only_typed_errors(with_halo, okc, (a, b, c), (8, 8, 8))
    only_typed_errors(with_halo, okc, 1, (a, b, c))
    if all(abs(v) < 10**6 for v in (a, b, c)):  # a grid of 10**20 chunks is a memory error by design
        only_typed_errors(grid, (8, 8, 8), (a, b, c))
        only_typed_errors(balanced_grid, (8, 8, 8), (a, b, c))
    pred = linear_predictor(4.0)
    only_typed_errors(plan, (8, 8, 8), budget_bytes=a, estimates=pred, slots=b, halo=abs(c) % 10)
    if all(v > 0 for v in (a, b, c)) and a * b * c <= 10**8:
        # (a plan of a 10**12-element volume under a 1 MB budget is millions of Chunk objects: slow by nature)
        only_typed_errors(plan, (a, b, c), budget_bytes=10**6, estimates=pred)
    else:
        only_typed_errors(check_shape, (a, b, c))
    only_typed_errors(probe_plan, (8, 8, 8), budget_bytes=a, slots=max(-5, min(b, 64)))  # huge slots: see below


@FUZZ
@given(a=nonsense_int_like, b=nonsense_int_like, c=nonsense_int_like)
def test_integer_nonsense_gives_only_typed_errors(a, b, c):
    _call_everything(a, b, c)


@FUZZ
@given(x=anything)
def test_any_nonsense_argument_gives_only_typed_errors(x):
    okc = Chunk((0, 0, 0), (4, 4, 4))
    pred = linear_predictor(4.0)
    only_typed_errors(Chunk, x, (5, 5, 5))
    only_typed_errors(Chunk, (0, 0, 0), x)
    only_typed_errors(check_shape, x)
    only_typed_errors(normalize_halo, x)
    only_typed_errors(with_halo, okc, x, (8, 8, 8))
    only_typed_errors(with_halo, okc, 1, x)
    only_typed_errors(check_halo, x, (8, 8, 8))
    only_typed_errors(grid, (8, 8, 8), x)
    only_typed_errors(balanced_grid, (8, 8, 8), x)
    only_typed_errors(split, okc, x)
    only_typed_errors(split_chunk, x)
    only_typed_errors(covers_exactly, x, (8, 8, 8))
    only_typed_errors(plan, (8, 8, 8), budget_bytes=x, estimates=pred)
    only_typed_errors(plan, (8, 8, 8), budget_bytes=10**6, estimates=pred, slots=x)
    only_typed_errors(plan, (8, 8, 8), budget_bytes=10**6, estimates=pred, halo=x)
    only_typed_errors(probe_plan, (8, 8, 8), budget_bytes=x)
    only_typed_errors(probe_plan, (8, 8, 8), budget_bytes=10**6, slots=x)
    only_typed_errors(probe_plan, (8, 8, 8), budget_bytes=10**6, itemsize=x)
    only_typed_errors(probe_plan, (8, 8, 8), budget_bytes=10**6, scale=x)


# Each bug above, one input each: the precise specification of the fixes.
KNOWN_UNTYPED = [
    ("check_shape inf", lambda: check_shape((float("inf"), 4, 4))),
    ("normalize_halo inf", lambda: normalize_halo((float("inf"), 0, 0))),
    ("Chunk nan", lambda: Chunk((float("nan"), 0, 0), (1, 1, 1))),
    ("Chunk of an int", lambda: Chunk(5, (1, 1, 1))),
    ("balanced_grid short counts", lambda: balanced_grid((8, 8, 8), (2, 2))),
    ("split on axis 5", lambda: split(Chunk((0, 0, 0), (4, 4, 4)), (5,))),
    ("covers_exactly non-chunks", lambda: covers_exactly([1], (8, 8, 8))),
    ("plan budget nan", lambda: plan((8, 8, 8), budget_bytes=float("nan"), estimates=linear_predictor(4.0))),
    ("plan budget text", lambda: plan((8, 8, 8), budget_bytes="2GiB", estimates=linear_predictor(4.0))),
    ("probe_plan itemsize 0", lambda: probe_plan((8, 8, 8), budget_bytes=10**6, itemsize=0)),
    ("parse_bytes 1e400", lambda: parse_bytes("1e400")),
]


@pytest.mark.parametrize("what,call", KNOWN_UNTYPED, ids=[k for k, _ in KNOWN_UNTYPED])
def test_known_untyped_escape(what, call):
    only_typed_errors(call)


def test_probe_plan_for_a_very_large_cluster_is_quick():
    import signal

    def too_slow(*_):
        raise TimeoutError("probe_plan took more than 2 s")

    old = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(2)
    try:
        p = probe_plan((8, 8, 8), budget_bytes=10**9, slots=10_000)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert covers_exactly(p.chunks + p.remainder, (8, 8, 8))


# =========================================================================== the command line

TOKENS = ["plan", "models", "export", "--operator", "envelope", "gst3d_dip", "gst3d", "nope|float32|cpu",
          "--shape", "--budget", "--halo", "--slots", "--whole-traces", "--cut-traces", "--json", "--format",
          "csv", "json", "xml", "--help", "-h", "2GiB", "1KiB", "0", "-1", "1e30", "nan", "3", "10", "1000000",
          "abc", "", " ", "--", "-", "--store"]


@pytest.fixture(scope="module")
def seeded_store(fuzz_dir) -> str:
    path = fuzz_dir / "cli.sqlite"
    with Store(path) as s:
        seed_store(s, "envelope|float32|cpu", 12.0, fixed_bytes=2 * 2**20)
        seed_store(s, "gst3d_dip|float32|cpu", 60.0)
        seed_store(s, "gst3d_dip[sigma=2]|float32|cpu", 70.0)
    return str(path)


def test_cli_with_random_arguments_never_shows_a_traceback(seeded_store):
    @SMALL
    @given(command=st.sampled_from(["plan", "models", "export"]),
           rest=st.lists(st.one_of(st.sampled_from(TOKENS), st.text(max_size=6),
                                   st.integers(-10**6, 10**9).map(str)), max_size=12))
    @example(command="plan", rest=["--operator", "gst3d_dip", "--shape", "100", "100", "100", "--budget", "1KiB"])
    def check(command, rest):
        argv = [command, "--store", seeded_store] + [t for t in rest if t not in ("--store", "--output", "-o")]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main(argv)
            except Exception as exc:  # the contract: main() never raises
                raise AssertionError(f"memchunk {' '.join(argv)} raised {type(exc).__name__}: {exc}") from exc
        assert code in (0, 1, 2), (argv, code)
        assert "Traceback" not in err.getvalue() + out.getvalue(), argv

    check()


def test_cli_budget_too_large_to_represent_is_a_usage_error(seeded_store, capsys):
    argv = ["plan", "--store", seeded_store, "--operator", "envelope", "--shape", "4", "4", "4", "--budget", "1e400"]
    try:
        code = cli.main(argv)
    except Exception as exc:
        raise AssertionError(f"raised {type(exc).__name__}: {exc}") from exc
    assert code == 2 and "memory size" in capsys.readouterr().err
