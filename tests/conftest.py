"""Shared test fixtures. Keep this file small: fixtures used by one test module live in that module."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

# No network here: never let Prefect try to phone home.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _outputs_in_a_temporary_directory(tmp_path_factory):
    """Chunked outputs a test does not place go to a temporary directory, not ``./memchunk-outputs`` in the
    checkout (the default a user gets), and so does the SEG-Y geometry cache. Tests of the defaults set their
    own."""
    previous = {k: os.environ.get(k) for k in ("MEMCHUNK_OUTPUT_DIR", "MEMCHUNK_CACHE_DIR")}
    os.environ["MEMCHUNK_OUTPUT_DIR"] = str(tmp_path_factory.mktemp("outputs"))
    os.environ["MEMCHUNK_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))  # SEG-Y geometries, per run
    yield
    for k, v in previous.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True, scope="session")
def _no_logging_tracebacks_once_the_session_is_over():
    """After the last test, a log record that cannot be written is dropped, not printed as a traceback.

    At interpreter exit (``atexit`` handlers), Prefect drains its background services ("Still processing items")
    and stops the temporary server a flow without a configured API started ("Stopping temporary server"). It logs
    both to the console it set up while pytest captured the output, and pytest has closed that stream by then:
    each pytest-xdist worker that ran such a flow printed "--- Logging error ---" and a traceback under the suite's
    summary. No test runs after this, so nothing a test could check is hidden (``logging.raiseExceptions`` is the
    standard library's switch for it).
    """
    yield
    logging.raiseExceptions = False


SEGY_SOURCE = ("segyio's test data (https://github.com/equinor/segyio, test-data/: f3.sgy, small.sgy, ...); "
               "this project's CI keeps them in ../shared/data/segy beside the repository")


def find_segy_dir() -> tuple[Path | None, list[Path]]:
    """The directory of real SEG-Y test files, and where it was looked for.

    ``$MEMCHUNK_SEGY_TEST_DATA`` when set (only there: an explicit path that lacks
    the files is not silently replaced by another); else ``../shared/data/segy``
    beside the repository, then ``tests/data/segy``.
    """
    env = os.environ.get("MEMCHUNK_SEGY_TEST_DATA")
    candidates = [Path(env)] if env else [REPO.parent / "shared" / "data" / "segy", REPO / "tests" / "data" / "segy"]
    for c in candidates:
        if (c / "f3.sgy").exists():
            return c, candidates
    return None, candidates


def running_in_ci() -> bool:
    """CI sets ``CI=true`` (GitHub Actions, GitLab, and this project's CI)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


_RANDOM_FUNCTIONS = ("random", "uniform", "getrandbits", "choice", "choices", "shuffle", "sample", "randint",
                     "randrange")


@pytest.fixture(autouse=True)
def _background_threads_draw_from_their_own_random(monkeypatch):
    """Threads other than the test's draw from a private ``random.Random``, the test's thread from the global one.

    Hypothesis fails a test whose strategies change the global ``random`` state, and
    it compares that state before and after each draw. Threads this process keeps
    running change it too: once a flow has run against the session's Prefect server,
    Prefect's events client pings over a websocket every 20 s from its own event-loop
    thread (``websockets`` draws the ping payload with ``random.getrandbits``), and
    Dask's comms draw connect back-off jitter. A ping landing inside a draw failed a
    fuzz test as "Flaky" (seen in CI). The test's own thread keeps the global state,
    so a strategy of ours that used ``random`` would still be caught.
    """
    import random
    import threading

    owner = threading.current_thread()
    private = random.Random()
    for name in _RANDOM_FUNCTIONS:
        shared, own = getattr(random, name), getattr(private, name)
        monkeypatch.setattr(random, name, lambda *a, _s=shared, _o=own, **k:
                            (_s if threading.current_thread() is owner else _o)(*a, **k))


@pytest.fixture(autouse=True)
def _dask_config_left_as_found():
    """Fail the test that leaves Dask's process-global allowed-failures changed, not a later one that reads it.

    ``dask.config.set`` is global and not thread-safe; the runner sets allowed-failures
    while it creates its client, and a leak once made a later test's scheduler start
    with the runner's value instead of Dask's default.
    """
    import dask
    import distributed  # noqa: F401 - loads distributed's defaults into dask.config, so `before` is Dask's

    key = "distributed.scheduler.allowed-failures"
    before = dask.config.get(key)
    yield
    assert dask.config.get(key) == before, f"this test left {key} = {dask.config.get(key)} (it was {before})"


@pytest.fixture(scope="session")
def segy_dir() -> Path:
    """The real SEG-Y files; the tests that need them skip when they are absent, except in CI, where they fail.

    A plain clone has no ../shared: its suite passes with these tests reported as
    skipped. In CI the files are beside the repository, so a skip there would be a
    silent loss of coverage: it is an error instead.
    """
    found, looked = find_segy_dir()
    if found is not None:
        return found
    message = (f"real SEG-Y test files (f3.sgy and others) not found in {', '.join(map(str, looked))}; they are "
               f"{SEGY_SOURCE}; point the suite at a copy with MEMCHUNK_SEGY_TEST_DATA=/path/to/dir")
    if running_in_ci():
        pytest.fail(f"CI=true and {message}: in CI these tests must run, not skip", pytrace=False)
    # One short reason: the summary prints it once per test that needs the files.
    pytest.skip("no real SEG-Y test files: set MEMCHUNK_SEGY_TEST_DATA (see docs/how-to/tests.md)")


@pytest.fixture(scope="session")
def prefect_server():
    """One real local Prefect server (SQLite) for the whole session; sets PREFECT_API_URL.

    Dask workers get the URL through the settings Prefect pickles into each
    submission, so flow and workers talk to the same server.
    """
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield

