"""The launcher's policy: given every task's state, run on, succeed, fail or time out.

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


@dataclass(frozen=True)
class TaskState:
    """One task as the policy sees it: ``returncode`` is None while it runs."""

    name: str
    is_trainer: bool
    returncode: int | None
    serves_coordinator: bool = False  # a worker/ps of a parameter-server cluster


@dataclass(frozen=True)
class Decision:
    """The policy's answer: the outcome, the launcher's exit code and what to tell the user."""

    outcome: Outcome
    exit_code: int = 0
    message: str = ""


def decide(
    states: Sequence[TaskState], *, timed_out: bool, timeout: float | None, stop_auxiliary: bool
) -> Decision:
    """Decides from the tasks' states, in this order of rules.

    0. In a parameter-server cluster, the workers and ps tasks serve the chief: their exits
       are the coordinator's to handle (it reschedules a lost worker's functions, it raises
       for a lost ps), so only the chief's exit decides.
    1. A chief/worker exited non-zero → FAILED with its code.
    2. A ps/evaluator exited non-zero → FAILED with its code; with ``stop_auxiliary`` (local
       mode: they serve the workers and are stopped when those finish), one that exits at all
       before the workers are done is a failure (code 1 if it exited 0).
    3. Every chief/worker exited 0 (and, without ``stop_auxiliary``, every task) → SUCCEEDED.
    4. The deadline passed → TIMED_OUT (124), naming the tasks still running.
    5. Else RUNNING.
    """
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
    if trainers_done and (stop_auxiliary or all(s.returncode == 0 for s in states)):
        return Decision(Outcome.SUCCEEDED, 0)
    if timed_out:
        running = [s.name for s in states if s.returncode is None]
        return Decision(
            Outcome.TIMED_OUT,
            TIMEOUT_EXIT_CODE,
            f"timed out after {timeout}s; still running: {running}. Stopping them.",
        )
    return Decision(Outcome.RUNNING)


def describe_exit(code: int) -> str:
    """`` (killed by SIGKILL)``-style note for a negative (signal) exit code, else ""."""
    if code >= 0:
        return ""
    try:
        return f" (killed by {signal.Signals(-code).name})"
    except ValueError:
        return f" (killed by signal {-code})"
