"""The README's code, run exactly as written, the way a new user first runs it.

A fresh Prefect home and no Prefect server configured: the flow starts Prefect's
temporary server, whose first start migrates a new database (longer than
Prefect's default 20 s startup timeout on a busy 2-core machine: the runner
raises it, see ``memchunk_prefect.run.prefect_api.temporary_server_defaults``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MARKER = "<!-- tests/test_readme.py runs this block as written"

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def readme_blocks() -> list[str]:
    """The python blocks the README marks as run by this test, in order."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(re.escape(MARKER) + r"[^\n]*\n```python\n(.*?)```", text, flags=re.S)
    return blocks


def test_the_readme_marks_its_first_flow_and_its_own_operator_example():
    blocks = readme_blocks()
    assert len(blocks) == 2
    assert "@flow(task_runner=MemoryAwareRunner())" in blocks[0] and "def attributes(" in blocks[0]
    assert "@operator(" in blocks[1] and "def rms(" in blocks[1]


def test_readme_examples_run_with_a_fresh_prefect_home_and_no_server(tmp_path):
    first, own = readme_blocks()
    survey = tmp_path / "survey.sgy"
    script = tmp_path / "readme_examples.py"
    # The blocks as written, then what a user does with them: call the flows on a survey and look at the result.
    script.write_text(first + "\n" + own + "\n" + textwrap.dedent(f"""
        if __name__ == "__main__":
            from prefect.settings import get_current_settings
            from memchunk_prefect import open_segy, synthetic_survey
            print("startup timeout", get_current_settings().server.ephemeral.startup_timeout_seconds)
            synthetic_survey({str(survey)!r}, (24, 20, 120), seed=1)
            dip = attributes({str(survey)!r})
            print("attributes", dip.shape, str(dip.dtype), bool(np.isfinite(dip.values).any()))
            out = rms({str(survey)!r}, size=5)
            whole = rms_amplitude.fn(open_segy({str(survey)!r}).values, size=5)
            print("rms", out.shape, float(np.max(np.abs(out.values - whole)) / np.max(np.abs(whole))))
        """))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MEMCHUNK_"))}
    env.update(PREFECT_HOME=str(tmp_path / "fresh-prefect-home"))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Timed out while attempting to connect" not in out and "database is locked" not in out, out[-4000:]
    # No telemetry from the temporary server (the runner turns it off where the user chose nothing): no failure
    # to send it without internet, and no race on the fresh database for its session row.
    assert "telemetry" not in out.lower(), out[-4000:]
    assert "attributes (24, 20, 120) float32 True" in proc.stdout, out[-4000:]
    # Prefect's default (20 s) is too short for a first start on a busy 2-core machine: the runner raised it.
    assert "startup timeout 180" in proc.stdout
    rms_line = next(line for line in proc.stdout.splitlines() if line.startswith("rms "))
    assert rms_line.startswith("rms (24, 20, 120) ")
    assert float(rms_line.split()[-1]) <= 1e-5, "chunked equals whole-volume (relative), halo included"
    # The learned store went to the fresh Prefect home, where a user's `memchunk models` looks.
    assert (tmp_path / "fresh-prefect-home" / "memchunk" / "observations.sqlite").exists()
