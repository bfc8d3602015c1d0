"""Shared test fixtures. Keep this file small: fixtures used by one test module live in that module."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No network here: never let Prefect try to phone home.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

REPO = Path(__file__).resolve().parents[1]


def _find_segy_dir() -> Path:
    """The real SEG-Y files shipped beside the repository (../shared/data/segy)."""
    env = os.environ.get("MEMCHUNK_SEGY_TEST_DATA")
    candidates = [Path(env)] if env else []
    candidates += [REPO.parent / "shared" / "data" / "segy", REPO / "tests" / "data" / "segy"]
    for c in candidates:
        if (c / "f3.sgy").exists():
            return c
    raise RuntimeError(f"real SEG-Y test files not found in any of {candidates}; set MEMCHUNK_SEGY_TEST_DATA")


@pytest.fixture(scope="session")
def segy_dir() -> Path:
    return _find_segy_dir()


@pytest.fixture(scope="session")
def prefect_server():
    """One real local Prefect server (SQLite) for the whole session; sets PREFECT_API_URL.

    Dask workers get the URL through the settings Prefect pickles into each
    submission, so flow and workers talk to the same server.
    """
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield

