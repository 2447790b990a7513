"""Prefixed, line-at-a-time output of the launched tasks (``[worker-1] ...``)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import IO

__all__ = ["PrefixedOutput"]


class PrefixedOutput:
    """Writes tasks' lines with their name in front, whole lines only, from reader threads.

    Without an ``out`` stream, a task's stdout lines go to ``sys.stdout`` and its stderr lines
    to ``sys.stderr`` (looked up at each write, so captured streams work); with one, both go
    there. The launcher's own notes (``[phalanx launch] ...``) go with stderr.

    Args:
        out: One stream for everything, or None.
    """

    def __init__(self, out: IO[str] | None = None) -> None:
        self._out = out
        self._lock = threading.Lock()  # one line at a time: tasks never interleave mid-line

    def write_line(self, name: str, line: str, stderr: bool = False) -> None:
        """Writes ``[name] line`` (adding a newline if the line has none)."""
        stream = self._out or (sys.stderr if stderr else sys.stdout)
        text = f"[{name}] {line}" if line.endswith("\n") else f"[{name}] {line}\n"
        with self._lock:
            stream.write(text)
            stream.flush()

    def note(self, message: str) -> None:
        """A message of the launcher itself, prefixed ``[phalanx launch]``."""
        self.write_line("phalanx launch", message, stderr=True)

    def pump(self, name: str, stream: IO[bytes], stderr: bool) -> threading.Thread:
        """Starts a daemon thread copying ``stream``'s lines until EOF, then closing it.

        Returns:
            The thread (join it once the task has exited).
        """
        thread = threading.Thread(
            target=self._copy, args=(name, stream, stderr), name=f"phalanx-launch-{name}", daemon=True
        )
        thread.start()
        return thread

    def _copy(self, name: str, stream: IO[bytes], stderr: bool) -> None:
        try:
            for raw in iter(stream.readline, b""):
                # If our own stream is gone (`phalanx launch ... | head`), keep draining the pipe:
                # a task whose pipe fills up would block forever on its next print.
                with contextlib.suppress(OSError, ValueError):
                    self.write_line(name, raw.decode(errors="replace"), stderr)
        finally:
            stream.close()
