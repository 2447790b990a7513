"""What the elastic membership reads its members' state with: `Member` (a task and its
incarnation), `Beacons` (when each member's beacon last moved, hence who is lost) and `Wait`
(a bounded wait). Both clocks leave out the time in which the store did not answer: a member
could neither move its beacon nor check in then (`STALL_SECONDS`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEAD", "STALL_SECONDS", "STORE_CALL_SECONDS", "Beacons", "Member", "Wait"]

# One store call's bound (a round trip, milliseconds when healthy). The membership's own waits
# poll with `check` against their deadlines (the join timeout); a call bounded by that timeout
# failed with the store's bare "wait timeout" when a loaded machine delayed one reply past it.
STORE_CALL_SECONDS = 30.0
# A poll round slower than this was stuck: the store did not answer, or the machine paused.
# torch's TCPStore resolves each new client's address (a reverse DNS lookup) on its server's one
# event loop, so a resolver that drops a query stalls every call of every client for its timeout
# (5 s): time in which no beacon could move and no task could check in.
STALL_SECONDS = 1.0
DEAD = "dead"


@dataclass(frozen=True)
class Member:
    """One member of a membership epoch: a task and its incarnation."""

    task: int
    incarnation: int

    def __str__(self) -> str:
        return f"{self.task}:{self.incarnation}"

    @classmethod
    def parse(cls, text: str) -> Member:
        task, _, incarnation = text.partition(":")
        return cls(int(task), int(incarnation))


class Wait:
    """A bounded wait whose clock leaves out the rounds in which it was stuck (a round slower
    than `STALL_SECONDS`): no other task could act then either. At most `STORE_CALL_SECONDS`
    are left out, so a store that stays slow still ends the wait.

    Args:
        seconds: How long the wait lasts.
    """

    def __init__(self, seconds: float) -> None:
        self._seconds, self._stuck = seconds, 0.0
        self._start = self._last = time.monotonic()

    def over(self) -> bool:
        """Whether the wait is over (call once per round)."""
        now = time.monotonic()
        if now - self._last > STALL_SECONDS:
            self._stuck = min(self._stuck + now - self._last, STORE_CALL_SECONDS)
        self._last = now
        return now - self._start - self._stuck > self._seconds


class Beacons:
    """Reads members' beacons over one store connection, remembering when each last moved."""

    def __init__(self, store: Any, name: Callable[[int], str], dead_after: float) -> None:
        self.store, self._name, self._dead_after = store, name, dead_after
        self._seen: dict[Member, tuple[str, float]] = {}
        self._answered = time.monotonic()  # when this reader's last read returned

    def _read(self, key: str) -> str | None:
        asked = time.monotonic()
        value = self.store.get(key).decode() if self.store.check([key]) else None
        answered = time.monotonic()
        if asked - self._answered > STALL_SECONDS or answered - asked > STALL_SECONDS:
            # this reader was away or stuck (idle between re-forms, a stalled store, a paused
            # machine): a beacon that did not move meanwhile may not have been able to
            self._seen.clear()
        self._answered = answered
        return value

    def lost_reason(self, member: Member) -> str | None:
        """Why ``member`` counts as lost, or None while its beacon moves."""
        value = self._read(f"alive/{member.task}")
        if value is None:
            return None
        if value == DEAD:
            return f"{self._name(member.task)} exited"
        if int(value.partition(":")[0]) != member.incarnation:
            return f"{self._name(member.task)} restarted"
        now = time.monotonic()
        seen = self._seen.get(member)
        if seen is None or seen[0] != value:
            self._seen[member] = (value, now)
            return None
        if now - seen[1] > self._dead_after:
            return f"{self._name(member.task)} sent no beacon for {self._dead_after:g}s"
        return None
