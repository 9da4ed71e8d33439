"""Helpers for tests that start servers (retrieval, tracking, Streamlit): a free local port, a
health poll, and a start on a free port that survives losing the port to another process.
Plain functions (not fixtures), importable from tests in every folder, tests/verl included
(`from servers import free_port`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Callable, Sequence


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log: Path | None = None) -> None:
    """Poll `url` until it answers 200; fail early, with the server's log, if `proc` exits."""
    tail = (lambda: log.read_text()[-3000:]) if log is not None else (lambda: "")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered: {tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s: {tail()}")


def start_on_free_port(command: Callable[[int], Sequence[str]], health: str, timeout: float, log: Path,
                       attempts: int = 3, **popen) -> tuple[subprocess.Popen, str]:
    """Start `command(port)` on a free port of 127.0.0.1, its output in `log`, and wait until
    `http://127.0.0.1:<port><health>` answers. A port is free when `free_port` releases it, and
    another process (the other pytest-xdist worker's server, an outgoing connection) may take it
    before the server binds it: a server that exits saying so is started again on a new port.
    Returns (process, base URL)."""
    for attempt in range(attempts):
        port = free_port()
        with open(log, "a") as out:
            proc = subprocess.Popen(list(command(port)), stdout=out, stderr=subprocess.STDOUT, **popen)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url + health, proc, timeout, log)
            return proc, url
        except BaseException as e:
            if proc.poll() is None:  # it did not answer in time: stopped, with what it started
                os.killpg(proc.pid, signal.SIGKILL) if popen.get("start_new_session") else proc.kill()
                proc.wait()
            in_use = isinstance(e, RuntimeError) and "address already in use" in log.read_text().lower()
            if not in_use or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")
