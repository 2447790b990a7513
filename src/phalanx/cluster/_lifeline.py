"""Ties a launched task's life to its launcher's; its source is given to ``python -S -c``.

`phalanx launch` starts every task as ``python -S -c <this file> LAUNCHER_PID MODE COMMAND...``
in a session of its own, so that neither the task nor anything it starts outlives the
launcher, however the launcher ends (SIGKILL included):

* ``MODE = auto`` on Linux: ask the kernel to SIGKILL this process when its parent dies
  (``prctl(PR_SET_PDEATHSIG)``), make sure the launcher is still the parent (it may have died
  before the request), then ``exec`` the command. The task keeps this process id, and the
  setting survives the ``exec``. (The kernel's "parent" is the launcher's thread that started
  the task; the launcher's `run_tasks` keeps that thread until every task has exited.)
* ``MODE = watch`` (and ``auto`` where prctl is unavailable): run the command as a child in
  this process group and poll the parent; once the launcher is gone, SIGKILL the whole
  group. The launcher signals the group, so the command receives its signals directly; this
  process mirrors the command's exit (code or signal).

This file imports nothing from phalanx (it runs before the task's ``sys.path`` exists) and
nothing beyond the standard library, and starts with ``-S`` (no site) to start quickly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_SECONDS = 0.1


def main(argv: list[str]) -> int:
    """Runs ``argv[2:]`` tied to the launcher ``argv[0]`` in mode ``argv[1]`` (see the module doc)."""
    launcher, mode, command = int(argv[0]), argv[1], argv[2:]
    if mode == "auto" and _die_with_parent():
        if os.getppid() != launcher:  # the launcher died before the kernel was asked
            os.kill(os.getpid(), signal.SIGKILL)
        os.execvp(command[0], command)  # noqa: S606 - the launcher built this argv, no shell wanted
    return _watch(launcher, command)


def _die_with_parent() -> bool:
    """Asks Linux for SIGKILL when the parent dies; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _watch(launcher: int, command: list[str]) -> int:
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        # The launcher signals the whole group: the command has this signal already.
        signal.signal(signum, lambda *_: None)
    child = subprocess.Popen(command)
    while child.poll() is None:
        if os.getppid() != launcher:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the command, its children and this process
        time.sleep(WATCH_SECONDS)
    if child.returncode < 0:  # mirror a death by signal, so the launcher reports the signal
        if -child.returncode in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(-child.returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -child.returncode)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
