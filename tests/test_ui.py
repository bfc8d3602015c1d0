"""``memchunk ui`` stops the Prefect server it started, whatever signal stops it, and refuses a busy port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytestmark = [pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/health", timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


def _ui(port: int, tmp_path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return subprocess.Popen([sys.executable, "-m", "memchunk_prefect", "ui", "--port", str(port)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_ui_stops_its_server_on_a_signal_and_the_port_is_free_again(tmp_path, sig):
    port = _free_port()
    ui = _ui(port, tmp_path)
    try:
        deadline = time.time() + 180
        while not _healthy(port):
            assert ui.poll() is None, ui.stdout.read() if ui.stdout else ""
            assert time.time() < deadline, "the server did not start in 180 s"
            time.sleep(0.5)
        ui.send_signal(sig)
        assert ui.wait(30) == 0
        deadline = time.time() + 20
        while _healthy(port) and time.time() < deadline:
            time.sleep(0.5)
        assert not _healthy(port), "the server outlived memchunk ui"
        with socket.socket() as s:  # the port can be listened on again
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
    finally:
        if ui.poll() is None:
            ui.kill()


def test_ui_refuses_a_port_that_is_taken_and_starts_nothing(tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        ui = _ui(port, tmp_path)
        out, _ = ui.communicate(timeout=60)
    assert ui.returncode == 1
    assert f"port {port} is already in use" in out and "nothing was started" in out and "--port" in out
