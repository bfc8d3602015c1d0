"""``memchunk ui``'s server: Prefect's, started as a child that stops with it whatever stops it.

``prefect server start`` run with ``subprocess.call`` outlived a ``memchunk ui`` stopped by SIGTERM (what
``kill``, ``timeout`` and process managers send): it was re-parented and kept port 4200, and the next
``memchunk ui`` failed on the port. :func:`serve` runs it in a process group of its own and, on SIGINT,
SIGTERM or SIGHUP, stops that group (SIGTERM, then SIGKILL after a grace period) before returning.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from typing import Any

#: Seconds the server has to stop after SIGTERM before it is killed.
GRACE_SECONDS = 10.0


class _Stop(Exception):
    """A signal asked ``memchunk ui`` to stop."""


def port_taken(port: int, host: str = "127.0.0.1") -> str:
    """What holds ``port`` on ``host`` in words ("" where it is free to listen on)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"{host}:{port}: {exc.strerror or exc}"
    return ""


def serve(cmd: list[str]) -> int:
    """Run ``cmd`` until it ends or a signal stops this process; its exit code (0 when stopped by a signal)."""
    proc = subprocess.Popen(cmd, start_new_session=True)

    def stop(signum: int, frame: Any) -> None:
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return proc.wait()
    except _Stop:
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
