"""The lifeline ties a task to its launcher: both ways of dying with it, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx.cluster._processes import lifeline_command

# A stand-in launcher: starts the lifeline (with a task that sleeps), prints the task's pid and
# its own, then waits to be killed.
_LAUNCHER = """
import subprocess, sys, time
from phalanx.cluster._processes import lifeline_command
mode = sys.argv[1]
task = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"]
child = subprocess.Popen(lifeline_command(task, mode=mode), stdout=subprocess.PIPE, start_new_session=True)
print(child.stdout.readline().decode().strip(), child.pid, flush=True)
time.sleep(120)
"""
SRC = str(Path(__file__).resolve().parents[4] / "src")


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["auto", "watch"])
def test_a_task_dies_when_its_launcher_is_killed(mode):
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, mode], stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC}
    )
    pids = []
    try:
        task, lifeline = map(int, launcher.stdout.readline().split())
        pids = [task, lifeline]
        assert (task == lifeline) is (mode == "auto")  # auto: the lifeline became the task (exec)
        assert _alive(task)
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while _alive(task) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(task)
        assert not _alive(lifeline)
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()
        launcher.wait(timeout=30)
        launcher.stdout.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["auto", "watch"])
@pytest.mark.parametrize(
    ("script", "code"), [("raise SystemExit(7)", 7), ("import os; os.kill(os.getpid(), 15)", -15)]
)
def test_the_tasks_exit_code_or_signal_comes_through(mode, script, code):
    done = subprocess.run(lifeline_command([sys.executable, "-c", script], mode=mode), timeout=50)
    assert done.returncode == code
