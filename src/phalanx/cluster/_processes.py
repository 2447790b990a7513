"""Starting, watching and stopping the task processes of a launch.

No task outlives its launcher. Each task starts through `phalanx.cluster._lifeline`, which
has the kernel kill it when the launcher dies (SIGKILL included), or watches the launcher
where the kernel cannot. SIGINT, SIGTERM and SIGHUP to the launcher are passed on to every
task's process group; tasks still running after `GRACE_SECONDS` are killed, and the launcher
returns ``128 + signal``, as a shell reports a death by that signal.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import IO

from phalanx.cluster import _lifeline
from phalanx.cluster._output import PrefixedOutput
from phalanx.cluster._supervisor import Decision, Outcome, TaskState, decide
from phalanx.cluster._tasks import TORCHRUN_VARS, PlannedTask
from phalanx.cluster.elastic import ElasticLaunch, elastic_states

__all__ = ["FORWARDED_SIGNALS", "GRACE_SECONDS", "POLL_SECONDS", "lifeline_command", "run_tasks"]

GRACE_SECONDS = 5.0  # between passing a signal on (or SIGTERM) and SIGKILL
POLL_SECONDS = 0.05
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass
class _Running:
    task: PlannedTask
    process: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)

    def state(self) -> TaskState:
        serves = self.task.coordinated and not self.task.is_trainer
        coordinator = self.task.coordinated and self.task.is_trainer
        return TaskState(self.task.name, self.task.is_trainer, self.process.poll(), serves, coordinator)


class _Signals:
    """The signals the launcher received while it runs its tasks (handlers in the main thread).

    A handler only records the signal: the supervision loop sees it at its next poll, so no
    exception lands in the middle of starting or stopping a task.
    """

    def __init__(self) -> None:
        self.received: list[int] = []

    def _record(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Signals]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # Python delivers signals to the main thread only: nothing to install
            return
        previous = {sig: signal.signal(sig, self._record) for sig in FORWARDED_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None


def lifeline_command(argv: Sequence[str], python: str = sys.executable, mode: str = "auto") -> list[str]:
    """``argv`` run through `phalanx.cluster._lifeline`, tied to this process's life."""
    return [python, "-S", "-c", inspect.getsource(_lifeline), str(os.getpid()), mode, *argv]


def run_tasks(
    argv: Sequence[str],
    tasks: Sequence[PlannedTask],
    env: Mapping[str, str] | None,
    timeout: float | None,
    out: IO[str] | None,
    stop_auxiliary: bool,
    elastic: ElasticLaunch | None = None,
    on_exit: Callable[[str, int], None] | None = None,
) -> int:
    """Starts one process per task, streams their output, and waits for the policy's verdict.

    Whatever happens (success, failure, timeout, a signal, an exception here), every task's
    process group is stopped before this returns: the launcher's signal passed on (else
    SIGTERM), then SIGKILL after `GRACE_SECONDS`. If this process dies without a chance to do
    that, its tasks die with it (see the module doc). Call it from the thread that should
    own the tasks: on Linux they die when that thread ends.

    Returns:
        0 on success; the failed task's exit code (negative: killed by that signal); 124 on
        timeout; 128 + N when the launcher received signal N (SIGINT, SIGTERM, SIGHUP).

    With ``elastic`` (an elastic launch), a trainer that exits with an error is marked lost
    and restarted while restarts remain (`phalanx.cluster.elastic`).
    ``on_exit(task name, exit code)`` is called once per process that exits while the tasks
    are supervised (the status page's launcher side).

    Raises:
        ValueError: A process could not be started (e.g. ``python`` does not exist).
    """
    output = PrefixedOutput(out)
    base = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    running: list[_Running] = []
    retired: list[_Running] = []

    def start(task: PlannedTask) -> _Running:
        extra = elastic.incarnation_env(task.name) if elastic is not None else {}
        return _start(argv, task, {**base, **(env or {}), **task.env, **extra}, output)

    def restart(name: str) -> None:
        index = next(i for i, r in enumerate(running) if r.task.name == name)
        retired.append(running[index])
        running[index] = start(running[index].task)

    with _Signals().installed() as signals:
        try:
            for task in tasks:
                running.append(start(task))
            decision = _supervise(running, timeout, stop_auxiliary, signals, elastic, restart, on_exit)
            _report(decision, running, output)
            return decision.exit_code
        finally:
            _stop(running, signals)
            for r in [*running, *retired]:
                for reader in r.readers:
                    reader.join(timeout=2.0)
            if elastic is not None:
                elastic.close()


def _report(decision: Decision, running: Sequence[_Running], output: PrefixedOutput) -> None:
    if decision.message:
        output.note(decision.message)
        return
    left = [r.task.name for r in running if r.process.poll() is None]
    if left:
        done = "the chief" if any(r.task.coordinated for r in running) else "every worker"
        output.note(f"{done} finished; stopping {left}.")


def _start(argv: Sequence[str], task: PlannedTask, env: dict[str, str], output: PrefixedOutput) -> _Running:
    env["PYTHONUNBUFFERED"] = "1"  # lines appear as they are printed, not when a buffer fills
    try:
        # A session of its own: the task and its children are stopped together (killpg), and a
        # Ctrl-C reaches only the launcher, which passes it on to each task in order.
        process = subprocess.Popen(
            lifeline_command(argv, argv[0]),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
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


def _supervise(
    running: Sequence[_Running],
    timeout: float | None,
    stop_auxiliary: bool,
    signals: _Signals,
    elastic: ElasticLaunch | None = None,
    restart: Callable[[str], None] = lambda name: None,
    on_exit: Callable[[str, int], None] | None = None,
) -> Decision:
    deadline = None if timeout is None else time.monotonic() + timeout
    told: set[int] = set()  # the processes whose exit on_exit heard of
    while True:
        timed_out = deadline is not None and time.monotonic() >= deadline
        if on_exit is not None:
            _tell_exits(running, told, on_exit)
        states = [r.state() for r in running]
        if elastic is not None and signals.first is None:
            elastic.handle_exits(elastic_states(running), restart)
            states = elastic.kept([r.state() for r in running])
            verdict = elastic.decide(states)
            if verdict is not None:
                return verdict
        decision = decide(
            states,
            timed_out=timed_out,
            timeout=timeout,
            stop_auxiliary=stop_auxiliary,
            signalled=signals.first,
        )
        if decision.outcome is not Outcome.RUNNING:
            return decision
        time.sleep(POLL_SECONDS)


def _tell_exits(running: Sequence[_Running], told: set[int], on_exit: Callable[[str, int], None]) -> None:
    for r in running:
        code = r.process.poll()
        if code is not None and r.process.pid not in told:
            told.add(r.process.pid)
            on_exit(r.task.name, code)


def _stop(running: Sequence[_Running], signals: _Signals) -> None:
    """Passes the launcher's signal on (SIGINT stays SIGINT; else SIGTERM) to every running
    task's group, waits up to `GRACE_SECONDS` (less if a second signal comes), then SIGKILLs."""
    first = signals.first
    polite = signal.SIGINT if first == signal.SIGINT else signal.SIGTERM
    already = len(signals.received)
    alive = [r for r in running if r.process.poll() is None]
    for r in alive:
        _signal_group(r.process.pid, polite)
    deadline = time.monotonic() + GRACE_SECONDS
    while any(r.process.poll() is None for r in alive):
        if time.monotonic() >= deadline or len(signals.received) > already:
            break  # out of patience, or the user insists (a second Ctrl-C)
        time.sleep(POLL_SECONDS)
    for r in running:
        # Children a task left behind (DataLoader workers, servers) are in its group: stop them too.
        _signal_group(r.process.pid, signal.SIGKILL)
    for r in running:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.process.wait(timeout=GRACE_SECONDS)  # SIGKILL cannot be refused: this is prompt


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is gone already
        os.killpg(pid, sig)
