"""Helpers of the security tier: real `phalanx launch` processes, watched by pid, never left behind.

`Launcher` starts ``python -m phalanx launch ...`` in a session of its own (so that no signal
of ours reaches it by accident) with its output in files; at teardown, every process a test
recorded (the launcher, and the task pids the tasks wrote) that is still alive is SIGKILLed
by the `launcher` fixture (conftest.py),
and the test fails if there was one, so a leak is a failure and never outlives the test.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[2] / "src")
SCRIPTS = Path(__file__).parent / "scripts"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has exited: only its parent's wait() is missing)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def wait_for(condition, timeout: float, what: str):
    """Polls ``condition`` until it returns something truthy; fails naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout}s waiting for {what}")
        time.sleep(0.05)


def port_is_free(port: int) -> bool:
    """Whether nothing listens on ``port``: binding every IPv4 interface conflicts with any
    listener on it, an IPv6 dual-stack one included."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is not "in use"
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


class Launcher:
    """One ``phalanx launch`` process and the pids a test learned about."""

    def __init__(
        self, args: list[str], folder: Path, env: dict[str, str] | None = None, clean: bool = False
    ) -> None:
        base = {} if clean else dict(os.environ)  # clean: ``env`` is the whole environment
        self.stdout, self.stderr = folder / "launcher.out", folder / "launcher.err"
        with open(self.stdout, "wb") as out, open(self.stderr, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "phalanx", "launch", *args],
                stdout=out,
                stderr=err,
                env={**base, "PYTHONPATH": SRC, **(env or {})},
                start_new_session=True,
            )
        self.pids: list[int] = [self.process.pid]

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"phalanx launch still ran after {timeout}s:\n{self.output()}")

    def kill_leftovers(self) -> list[int]:
        left = [pid for pid in self.pids if alive(pid)]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        return left
