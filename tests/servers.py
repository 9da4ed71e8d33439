"""Helpers for tests that start servers (retrieval, tracking, Streamlit): a free local port and a
health poll. Plain functions (not fixtures), importable from tests in every folder, tests/verl
included (`from servers import free_port`)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.request
from pathlib import Path


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
