"""Scripts run as ``python SCRIPT`` would, without paying torch's import each time (docs/testing.md).

A `Preloaded` server process imports torch and phalanx once; each `Preloaded.run` forks a
child of it that runs the script as ``__main__`` (its own ``sys.argv``, ``sys.path[0]``, working
folder and output) and exits as the interpreter would. The child is a fresh process, but with
torch and phalanx already imported: a script that must set a variable torch reads at import
needs a real interpreter (`support.cluster.run_python`).

Example::

    with Preloaded() as python:
        done = python.run(tmp_path / "block.py", cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["Preloaded"]

SERVER = Path(__file__).resolve().parent / "_preloaded_server.py"
START_TIMEOUT = 120.0  # seconds for the server to import torch and phalanx, on a loaded box


class Preloaded:
    """A server process that forks a child per script; stop it with `close` (or ``with``).

    Args:
        env: The server's environment, and so every child's (default: this process's).
    """

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(SERVER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: closed with everything it started
        )
        self._outputs = tempfile.TemporaryDirectory(prefix="preloaded-")

    def run(
        self, script: str | Path, *args: Any, cwd: str | Path, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``python SCRIPT ARGS`` in ``cwd`` (blocks until it exits), its stdout and stderr apart.

        Raises:
            AssertionError: The script ran past ``timeout`` seconds (it and its children were
                killed; its output is in the message), or the server is gone (its exit code).
        """
        out, err = Path(self._outputs.name, "stdout"), Path(self._outputs.name, "stderr")
        request = {"script": str(script), "args": list(map(str, args)), "cwd": str(cwd)}
        request |= {"stdout": str(out), "stderr": str(err), "timeout": timeout}
        assert self._proc.stdin is not None
        assert self._proc.stdout is not None
        argv = [sys.executable, str(script), *request["args"]]
        try:
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout + START_TIMEOUT)
            line = self._proc.stdout.readline() if ready else ""
        except BrokenPipeError:
            line = ""
        if not line:
            self.close()
            gone = f"the preloaded python server is gone (exit code {self._proc.returncode})"
            raise AssertionError(f"{gone}; it was running {argv}")
        answer = json.loads(line)
        stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        if answer["timed_out"]:
            killed = f"{argv} timed out after {timeout}s; it was killed (and whatever it started)"
            raise AssertionError(f"{killed}.\n{stdout[-3000:]}{stderr[-3000:]}")
        return subprocess.CompletedProcess(argv, answer["returncode"], stdout, stderr)

    def close(self) -> None:
        """Ends the server (EOF on its input), killing it and its children if it lingers."""
        with contextlib.suppress(BrokenPipeError, ValueError):
            if self._proc.stdin is not None:
                self._proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
        self._outputs.cleanup()

    def __enter__(self) -> Preloaded:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
