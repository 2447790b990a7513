"""Starting, watching and stopping the task processes of a launch."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from phalanx.cluster._output import PrefixedOutput
from phalanx.cluster._supervisor import Decision, Outcome, TaskState, decide
from phalanx.cluster._tasks import TORCHRUN_VARS, PlannedTask

__all__ = ["GRACE_SECONDS", "POLL_SECONDS", "run_tasks"]

GRACE_SECONDS = 5.0  # between SIGTERM and SIGKILL
POLL_SECONDS = 0.05


@dataclass
class _Running:
    task: PlannedTask
    process: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)

    def state(self) -> TaskState:
        serves = self.task.coordinated and not self.task.is_trainer
        return TaskState(self.task.name, self.task.is_trainer, self.process.poll(), serves)


def run_tasks(
    argv: Sequence[str],
    tasks: Sequence[PlannedTask],
    env: Mapping[str, str] | None,
    timeout: float | None,
    out: IO[str] | None,
    stop_auxiliary: bool,
) -> int:
    """Starts one process per task, streams their output, and waits for the policy's verdict.

    Whatever happens (success, failure, timeout, an exception or Ctrl-C here), every task's
    process group is stopped before this returns: SIGTERM, then SIGKILL after
    `GRACE_SECONDS`.

    Returns:
        0 on success; the failed task's exit code (negative: killed by that signal); 124 on
        timeout.

    Raises:
        ValueError: A process could not be started (e.g. ``python`` does not exist).
    """
    output = PrefixedOutput(out)
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    running: list[_Running] = []
    try:
        for task in tasks:
            running.append(_start(argv, task, {**base, **(env or {}), **task.env}, output))
        decision = _supervise(running, timeout, stop_auxiliary)
        if decision.message:
            output.note(decision.message)
        else:
            left = [r.task.name for r in running if r.process.poll() is None]
            if left:
                done = "the chief" if any(r.task.coordinated for r in running) else "every worker"
                output.note(f"{done} finished; stopping {left}.")
        return decision.exit_code
    finally:
        _stop(running)
        for r in running:
            for reader in r.readers:
                reader.join(timeout=2.0)


def _start(argv: Sequence[str], task: PlannedTask, env: dict[str, str], output: PrefixedOutput) -> _Running:
    env["PYTHONUNBUFFERED"] = "1"  # lines appear as they are printed, not when a buffer fills
    try:
        # A session of its own: the task and its children are stopped together (killpg), and a
        # Ctrl-C reaches only the launcher, which then stops them in order.
        process = subprocess.Popen(
            list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
        )
    except OSError as exc:
        raise ValueError(
            f"Could not start task {task.name}: {exc}. Command: {argv[0]!r}. "
            "HINT: check the python= argument."
        ) from exc
    assert process.stdout is not None
    assert process.stderr is not None
    readers = [output.pump(task.name, process.stdout, False), output.pump(task.name, process.stderr, True)]
    return _Running(task, process, readers)


def _supervise(running: Sequence[_Running], timeout: float | None, stop_auxiliary: bool) -> Decision:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        timed_out = deadline is not None and time.monotonic() >= deadline
        decision = decide(
            [r.state() for r in running], timed_out=timed_out, timeout=timeout, stop_auxiliary=stop_auxiliary
        )
        if decision.outcome is not Outcome.RUNNING:
            return decision
        time.sleep(POLL_SECONDS)


def _stop(running: Sequence[_Running]) -> None:
    alive = [r for r in running if r.process.poll() is None]
    for r in alive:
        _signal_group(r.process.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for r in alive:
        try:
            r.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(r.process.pid, signal.SIGKILL)
            r.process.wait()
    for r in running:
        # Children a task left behind (DataLoader workers, servers) are in its group: stop them too.
        _signal_group(r.process.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pid, sig)
