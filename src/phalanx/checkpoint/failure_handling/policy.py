"""The preemption state machine: what every worker does at a step boundary (no processes here).

Every worker feeds it the same agreed flags at the same step (see `agreement`), so every worker
takes the same decision at the same step.

    TRAINING --notice anywhere, no grace period
               (or already too little left)--> SAVE_AND_EXIT            (then DONE)
    TRAINING --notice anywhere, a grace period---> SAVE, then COUNTDOWN
    COUNTDOWN --a noticed worker's time is up----> SAVE_AND_EXIT            (then DONE)

A worker's time is up when what is left of its grace period no longer covers a safety margin of
three times (two steps + one save), as measured on that worker (TF keeps a margin of 3 x 2 steps).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["Decision", "Flags", "PreemptionPolicy", "State"]

MARGIN_FACTOR = 3.0


class Decision(enum.Enum):
    CONTINUE = "continue"
    SAVE = "save"  # and train on: a grace period has begun
    SAVE_AND_EXIT = "save_and_exit"


class State(enum.Enum):
    TRAINING = "training"
    COUNTDOWN = "countdown"  # saved once; training on through a grace period
    DONE = "done"  # saved and exit_fn ran (and returned): later notices are not handled


@dataclass(frozen=True)
class Flags:
    """What one worker contributes at a step boundary, or (agreed) whether any worker does."""

    notice: bool = False  # a termination notice arrived
    time_is_up: bool = False  # its grace period is about to end

    def as_ints(self) -> list[int]:
        return [int(self.notice), int(self.time_is_up)]


class PreemptionPolicy:
    """Decides, from the agreed flags, whether to save and whether to exit (every worker).

    Args:
        grace_period: Seconds from a notice to the termination (0: save and exit at once).
    """

    def __init__(self, grace_period: float) -> None:
        self.grace_period = grace_period
        self.state = State.TRAINING

    def local_flags(
        self, notice_at: float | None, now: float, step_seconds: float, save_seconds: float
    ) -> Flags:
        """This worker's flags: whether it has a notice, and whether its time is up.

        Args:
            notice_at: When this worker's notice arrived (monotonic seconds), or None.
            now: The current monotonic time.
            step_seconds: The average duration of a step on this worker.
            save_seconds: How long the last save took on this worker (0 before the first).
        """
        if notice_at is None or self.state is State.DONE:
            return Flags()
        margin = MARGIN_FACTOR * (2 * step_seconds + save_seconds)
        return Flags(notice=True, time_is_up=now >= notice_at + self.grace_period - margin)

    def decide(self, agreed: Flags) -> Decision:
        """The decision for flags agreed across workers; advances the state."""
        if self.state is State.TRAINING and agreed.notice:
            if self.grace_period <= 0 or agreed.time_is_up:  # no time to train on: one save
                self.state = State.DONE
                return Decision.SAVE_AND_EXIT
            self.state = State.COUNTDOWN
            return Decision.SAVE
        if self.state is State.COUNTDOWN and agreed.time_is_up:
            self.state = State.DONE
            return Decision.SAVE_AND_EXIT
        return Decision.CONTINUE
