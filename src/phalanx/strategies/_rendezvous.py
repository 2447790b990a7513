"""Meeting points for the replica threads of one process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["ReplicaAbortedError", "ReplicaTimeoutError", "Rendezvous"]


class ReplicaTimeoutError(TimeoutError):
    """A replica waited at a meeting point longer than the strategy's timeout."""


class ReplicaAbortedError(RuntimeError):
    """Another replica failed, so this replica's step was abandoned."""


class Rendezvous:
    """Lets ``num_replicas`` threads exchange values; the last to arrive may compute for all.

    Each meeting is a generation: every replica calls `exchange` once per generation, in the
    same order as the others (like a collective). A failed replica calls `abort`, which wakes
    every waiter with `ReplicaAbortedError` until `reset`.

    Args:
        num_replicas: Threads that meet.
        timeout: Seconds a replica waits for the others before `ReplicaTimeoutError`.
    """

    def __init__(self, num_replicas: int, timeout: float) -> None:
        self._n = num_replicas
        self._timeout = timeout
        self._cond = threading.Condition()
        self._values: list[Any] = [None] * num_replicas
        self._arrived: set[int] = set()
        self._generation = 0
        self._result: tuple[bool, Any] = (True, None)
        self._aborted: BaseException | None = None

    def exchange(
        self,
        index: int,
        value: Any,
        leader_fn: Callable[[list[Any]], Any] | None = None,
        what: str = "a collective",
    ) -> Any:
        """Deposits ``value`` and blocks until every replica has (all replicas).

        Returns:
            ``leader_fn(values)`` computed once by the last replica to arrive, or the list of
            all replicas' values when no ``leader_fn`` is given.

        Raises:
            ReplicaTimeoutError: Some replicas did not arrive in time (named in the message).
            ReplicaAbortedError: Another replica failed.
        """
        if self._n == 1:
            return leader_fn([value]) if leader_fn is not None else [value]
        with self._cond:
            self._raise_if_aborted()
            generation = self._generation
            self._values[index] = value
            self._arrived.add(index)
            if len(self._arrived) == self._n:
                return self._lead(leader_fn)
            ok = self._cond.wait_for(
                lambda: self._generation != generation or self._aborted is not None,
                timeout=self._timeout,
            )
            if self._generation == generation:
                self._raise_if_aborted()
                if not ok:
                    missing = sorted(set(range(self._n)) - self._arrived)
                    self._abort_locked(ReplicaTimeoutError("timeout"))
                    raise ReplicaTimeoutError(
                        f"Replica {index} waited {self._timeout:.0f}s at {what} for replicas "
                        f"{missing}, which never arrived. Every replica must make the same "
                        "sequence of collective calls (all_reduce, merge_call, "
                        "optimizer.step()). HINT: check for a replica-dependent branch."
                    )
            succeeded, result = self._result
        if not succeeded:
            raise result
        return result

    def _lead(self, leader_fn: Callable[[list[Any]], Any] | None) -> Any:
        values = list(self._values)
        try:
            result: tuple[bool, Any] = (True, leader_fn(values)) if leader_fn is not None else (True, values)
        except BaseException as exc:  # re-raised in every replica
            result = (False, exc)
        self._result = result
        self._values = [None] * self._n
        self._arrived.clear()
        self._generation += 1
        self._cond.notify_all()
        if not result[0]:
            raise result[1]
        return result[1]

    def _raise_if_aborted(self) -> None:
        if self._aborted is not None:
            raise ReplicaAbortedError(
                f"This replica's step was abandoned because another replica failed: {self._aborted!r}"
            )

    def _abort_locked(self, exc: BaseException) -> None:
        if self._aborted is None:
            self._aborted = exc
        self._cond.notify_all()

    def abort(self, exc: BaseException) -> None:
        """Wakes every waiting replica with `ReplicaAbortedError` (called by a failing one)."""
        with self._cond:
            self._abort_locked(exc)

    def reset(self) -> None:
        """Readies the meeting point for a new `run` (called with no replica waiting)."""
        with self._cond:
            self._aborted = None
            self._values = [None] * self._n
            self._arrived.clear()
            self._generation += 1
