"""The server of `support.preloaded.Preloaded`: imports torch and phalanx once, then forks one
child per request, which runs a script as ``python SCRIPT ARGS`` would and exits as it would.

Protocol (one JSON object a line): a request on stdin, ``{"script", "args", "cwd", "stdout",
"stderr", "timeout"}`` (the last two: files for the child's output); the answer on stdout,
``{"returncode": int, "timed_out": bool}`` once the child has exited, or was killed (with
everything it started) after ``timeout`` seconds. EOF on stdin ends the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import signal
import sys
import time
import traceback

import torch  # noqa: F401  (what every child would import first: imported once, here)

import phalanx  # noqa: F401


def serve() -> dict | None:
    """Answers requests until EOF (returns None); in a forked child, returns its request."""
    while line := sys.stdin.readline():
        request = json.loads(line)
        child = os.fork()
        if child == 0:
            return request  # the child leaves the loop: it runs the script, then exits
        code, timed_out = wait(child, request["timeout"])
        print(json.dumps({"returncode": code, "timed_out": timed_out}), flush=True)
    return None


def wait(pid: int, timeout: float) -> tuple[int, bool]:
    """(the child's exit code, whether it was killed for running past ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while not (done := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # the child and everything it started
            return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), True
        time.sleep(0.02)
    return os.waitstatus_to_exitcode(done[1]), False


def run(request: dict) -> None:
    """In the child: ``python SCRIPT ARGS`` in ``cwd``, its output to the request's files."""
    os.setpgid(0, 0)  # a group of its own, for the timeout's kill
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (open until the process ends)
    os.chdir(request["cwd"])
    script = os.path.abspath(request["script"])
    sys.argv = [script, *request["args"]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)  # the interpreter's own exit: atexit handlers, non-daemon threads, flushes


if (request := serve()) is not None:
    run(request)
