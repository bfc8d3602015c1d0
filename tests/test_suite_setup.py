"""The suite from a plain clone: tests that need the real SEG-Y files skip with a reason, except in CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ONE_SEGY_TEST = "tests/test_segy_inputs.py::test_big_and_little_endian_f3_give_identical_values"

pytestmark = pytest.mark.slow


def _pytest_without_segy_files(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("CI", "MEMCHUNK_SEGY_TEST_DATA")}
    (tmp_path / "empty").mkdir()
    clean.update(MEMCHUNK_SEGY_TEST_DATA=str(tmp_path / "empty"), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", ONE_SEGY_TEST],
                          cwd=REPO, env=clean, capture_output=True, text=True, timeout=300)


def test_without_the_files_the_tests_skip_saying_where_files_come_from_and_how_to_point_at_them(tmp_path):
    proc = _pytest_without_segy_files(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "1 skipped" in proc.stdout
    # One short line per skipped test; the page it names says where the files come from.
    assert "MEMCHUNK_SEGY_TEST_DATA" in proc.stdout and "docs/how-to/tests.md" in proc.stdout
    page = (REPO / "docs" / "how-to" / "tests.md").read_text()
    assert "segyio" in page and "MEMCHUNK_SEGY_TEST_DATA" in page


def test_in_ci_missing_files_fail_the_run_instead_of_dropping_coverage(tmp_path):
    proc = _pytest_without_segy_files(tmp_path, CI="true")
    assert proc.returncode != 0
    assert "1 error" in proc.stdout and "in CI these tests must run" in proc.stdout, proc.stdout[-3000:]


def test_here_the_files_are_found(segy_dir):
    assert (segy_dir / "f3.sgy").exists()
