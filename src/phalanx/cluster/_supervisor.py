"""The launcher's policy: given every task's state, run on, succeed, fail, time out or stop on a signal.

A pure function of the tasks' states (no processes), so each rule is tested on its own;
`phalanx.cluster._processes` polls the processes and acts on the decision.
"""

from __future__ import annotations

import enum
import signal
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TIMEOUT_EXIT_CODE", "Decision", "Outcome", "TaskState", "decide", "describe_exit"]

TIMEOUT_EXIT_CODE = 124  # as coreutils' timeout(1)


class Outcome(enum.Enum):
    """What the launcher does next."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMED_OUT = "timed out"
    SIGNALLED = "signalled"


@dataclass(frozen=True)
class TaskState:
    """One task as the policy sees it: ``returncode`` is None while it runs."""

    name: str
    is_trainer: bool
    returncode: int | None
    serves_coordinator: bool = False  # a worker/ps of a parameter-server cluster
    coordinator: bool = False  # the chief of a parameter-server cluster


@dataclass(frozen=True)
class Decision:
    """The policy's answer: the outcome, the launcher's exit code and what to tell the user."""

    outcome: Outcome
    exit_code: int = 0
    message: str = ""


def decide(
    states: Sequence[TaskState],
    *,
    timed_out: bool,
    timeout: float | None,
    stop_auxiliary: bool,
    signalled: int | None = None,
) -> Decision:
    """Decides from the tasks' states, in this order of rules.

    0. The launcher received signal N (SIGINT, SIGTERM, SIGHUP) → SIGNALLED with 128 + N, as
       a shell reports a death by signal; the tasks get the signal passed on and are stopped.
    1. In a parameter-server cluster, the workers and ps tasks serve the chief: their exits
       are the coordinator's to handle (it reschedules a lost worker's functions, it raises
       for a lost ps), so only the chief's exit decides.
    2. A chief/worker exited non-zero → FAILED with its code.
    3. A ps/evaluator exited non-zero → FAILED with its code; with ``stop_auxiliary`` (local
       mode: they serve the workers and are stopped when those finish), one that exits at all
       before the workers are done is a failure (code 1 if it exited 0).
    4. Every chief/worker exited 0, and either ``stop_auxiliary``, or the chief of a
       parameter-server cluster is among the tasks (nothing is left to serve), or every task
       exited 0 → SUCCEEDED.
    5. Every task has exited (a node whose serving tasks ended on their own) → FAILED with
       the first non-zero code.
    6. The deadline passed → TIMED_OUT (124), naming the tasks still running.
    7. Else RUNNING.
    """
    running = [s.name for s in states if s.returncode is None]
    if signalled is not None:
        return Decision(
            Outcome.SIGNALLED,
            128 + signalled,
            f"received {_signal_name(signalled)}; passing it on to {running} and stopping them.",
        )
    failure = _first_failure(states, stop_auxiliary)
    if failure is not None:
        return failure
    if _finished(states, stop_auxiliary):
        return Decision(Outcome.SUCCEEDED, 0)
    if not running:
        failed = next(s for s in states if s.returncode)  # all 0 would have finished above
        code = failed.returncode or 1
        return Decision(
            Outcome.FAILED,
            code,
            f"{failed.name} exited with code {code}; no task is left.{describe_exit(code)}",
        )
    if timed_out:
        return Decision(
            Outcome.TIMED_OUT,
            TIMEOUT_EXIT_CODE,
            f"timed out after {timeout}s; still running: {running}. Stopping them.",
        )
    return Decision(Outcome.RUNNING)


def _first_failure(states: Sequence[TaskState], stop_auxiliary: bool) -> Decision | None:
    trainers_done = all(s.returncode == 0 for s in states if s.is_trainer)
    for state in sorted(states, key=lambda s: not s.is_trainer):
        if state.serves_coordinator:
            continue
        code = state.returncode
        if code is None or (code == 0 and (state.is_trainer or not stop_auxiliary or trainers_done)):
            continue
        early = "" if code else " before the workers finished"
        return Decision(
            Outcome.FAILED,
            code or 1,
            f"{state.name} exited with code {code}{early}; stopping the other tasks.{describe_exit(code)}",
        )
    return None


def _finished(states: Sequence[TaskState], stop_auxiliary: bool) -> bool:
    if not all(s.returncode == 0 for s in states if s.is_trainer):
        return False
    return stop_auxiliary or any(s.coordinator for s in states) or all(s.returncode == 0 for s in states)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int) -> str:
    """`` (killed by SIGKILL)``-style note for a negative (signal) exit code, else ""."""
    if code >= 0:
        return ""
    return f" (killed by {_signal_name(-code)})"
