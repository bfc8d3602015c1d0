"""A real local Prefect server in a subprocess, with its own home: for tests, the screenshot script, trials.

    with local_server(tmp_path / "prefect-home") as srv:
        subprocess.run([prefect, "work-pool", "create", ...], env=srv.env)
        print(srv.ui_url)

``srv.env`` is this process's environment plus ``PREFECT_HOME``, ``PREFECT_API_URL``,
analytics off: hand it to every ``prefect`` subprocess (workers, deploy, serve).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PREFECT = str(Path(sys.executable).with_name("prefect"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LocalServer:
    url: str  # http://127.0.0.1:PORT
    env: dict[str, str]
    process: subprocess.Popen
    log: Path

    @property
    def api_url(self) -> str:
        return self.url + "/api"

    @property
    def ui_url(self) -> str:
        return self.url


def server_env(home: str | os.PathLike, api_url: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180", PREFECT_WORKER_QUERY_SECONDS="1",
               PREFECT_RUNNER_POLL_FREQUENCY="1", PREFECT_LOGGING_LEVEL="INFO")
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return env


def wait_healthy(url: str, timeout: float, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with {process.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/api/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the Prefect server at {url} was not healthy after {timeout:.0f} s")


@contextlib.contextmanager
def local_server(home: str | os.PathLike, *, port: int | None = None, timeout: float = 120,
                 services: bool = True) -> Iterator[LocalServer]:
    """``prefect server start --host 127.0.0.1 --port PORT`` with ``PREFECT_HOME=home``; stopped on exit."""
    home = Path(home)
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = server_env(home, url + "/api")
    log = home / "server.log"
    cmd = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"]
    if not services:
        cmd.append("--no-services")
    with open(log, "ab") as fh:
        proc = subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(url, timeout, proc)
        yield LocalServer(url=url, env=env, process=proc, log=log)
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout: float = 20) -> None:
    """Terminate a process we started (and its process group), then kill it if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(5)
