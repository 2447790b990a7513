"""Meeting points for the replica threads of one process, and their stall inspector.

Every meeting (`ReplicaRendezvous.exchange`) is numbered within a ``run`` and labelled with what it
is for ("all_reduce", "merge_call", "optimizer.step()"). A replica whose paths differ from the
others' is named at once when that is certain (it returned from the function given to
``strategy.run`` while the others wait, or it arrived at another meeting point), else after
the stall bound (``PHALANX_STALL_TIMEOUT_SECONDS``, 30 s): every replica then raises
`CollectiveMismatchError` naming each one's meeting point and call site. Call sites are read
only then, from the waiting threads' stacks (``sys._current_frames``): nothing on the hot path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from phalanx.communication.checks.call_sites import call_site
from phalanx.communication.checks.stall_inspector import (
    STALL_TIMEOUT_ENV,
    CollectiveMismatchError,
    StallSettings,
)

__all__ = ["ReplicaAbortedError", "ReplicaTimeoutError", "ReplicaRendezvous"]

_REPLICA_HINT = (
    "HINT: every replica must make the same calls in the same order; the usual cause is a "
    "branch on replica_id_in_sync_group or on the replica's data around optimizer.step(), "
    "all_reduce or merge_call (a skipped step, an extra reduce, an early return). If a replica "
    f"legitimately computes alone longer than the bound, raise {STALL_TIMEOUT_ENV} "
    "(docs/multi_worker.md, 'Mismatched collectives')."
)


class ReplicaTimeoutError(TimeoutError):
    """A replica waited at a meeting point longer than the strategy's timeout."""


class ReplicaAbortedError(RuntimeError):
    """Another replica failed, so this replica's step was abandoned."""


class ReplicaRendezvous:
    """Lets ``num_replicas`` threads exchange values; the last to arrive may compute for all.

    Each meeting is a generation: every replica calls `exchange` once per generation, in the
    same order as the others (like a collective). A failed replica calls `abort`, which wakes
    every waiter with `ReplicaAbortedError` until `reset`.

    Args:
        num_replicas: Threads that meet.
        timeout: Seconds a replica waits for the others before `ReplicaTimeoutError`.
        stall: The stall inspector's settings (default: `StallSettings.from_env`).
    """

    def __init__(self, num_replicas: int, timeout: float, stall: StallSettings | None = None) -> None:
        self._n = num_replicas
        self._timeout = timeout
        # one replica meets nobody: nothing to inspect, and nothing read from the environment
        self._stall = stall or (
            StallSettings.from_env() if num_replicas > 1 else StallSettings(enabled=False)
        )
        self._whats: dict[int, str] = {}  # replica -> the meeting point it waits at
        self._signatures: dict[int, str | None] = {}  # replica -> its value's dtypes and shapes
        self._threads: dict[int, int] = {}  # replica -> its thread's ident (this run)
        self._returned: set[int] = set()  # replicas whose function returned (this run)
        self._meetings = 0  # meetings completed in this run
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
        signature: str | None = None,
    ) -> Any:
        """Deposits ``value`` and blocks until every replica has (all replicas).

        ``signature``: the dtypes and shapes of ``value`` where they must match on every
        replica (`shapes_of`); replicas that arrive with different ones are a mismatch,
        raised on every replica before ``leader_fn`` runs.

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
            self._whats[index] = what
            self._signatures[index] = signature
            self._threads[index] = threading.get_ident()
            self._check_paths()
            if len(self._arrived) == self._n:
                return self._lead(leader_fn)
            ok = self._wait(generation)
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

    def _wait(self, generation: int) -> bool:
        """Waits for this meeting's end; after the stall bound, a replica that is elsewhere
        is a mismatch (every waiter raises it). False after the strategy's timeout."""
        done = lambda: self._generation != generation or self._aborted is not None  # noqa: E731
        if self._stall.enabled and self._stall.timeout < self._timeout:
            if self._cond.wait_for(done, timeout=self._stall.timeout):
                return True
            self._mismatch(f"has not arrived after {self._stall.timeout:g}s ({STALL_TIMEOUT_ENV})")
        return self._cond.wait_for(done, timeout=self._timeout)

    # ---------------------------------------------------------------- the stall inspector
    def started(self, index: int) -> None:
        """Replica ``index`` starts the function given to ``run`` on this thread."""
        with self._cond:
            self._threads[index] = threading.get_ident()

    def returned(self, index: int) -> None:
        """Replica ``index``'s function returned: it reaches no more meeting points in this
        run, so replicas waiting in one (or arriving later) can never be met."""
        with self._cond:
            self._returned.add(index)
            self._whats.pop(index, None)
            self._check_paths()

    def _check_paths(self) -> None:
        """Raises (and wakes every waiter with) a certain mismatch: replicas at different
        meeting points, or one that returned while others wait (called with the lock)."""
        if not self._stall.enabled or not self._arrived:
            return
        if len(set(self._whats[i] for i in self._arrived)) > 1:
            self._mismatch("arrived at another meeting point")
        if len(set(self._signatures.get(i) for i in self._arrived)) > 1:
            self._mismatch("arrived with other dtypes or shapes")
        if self._returned:
            self._mismatch("returned from the function given to strategy.run without reaching it")

    def _mismatch(self, why: str) -> None:
        """Aborts the meeting with `CollectiveMismatchError` naming every replica's place."""
        meeting = self._meetings + 1
        frames = sys._current_frames()
        places = []
        for i in range(self._n):
            frame = frames.get(self._threads.get(i, -1))
            where = call_site(frame) if frame is not None else "?"
            if i in self._arrived:
                of = f" [{self._signatures[i]}]" if self._signatures.get(i) else ""
                places.append(f"replica {i} waits in {self._whats[i]} #{meeting} ({where}){of}")
            elif i in self._returned:
                places.append(
                    f"replica {i} returned from its function (it reached meetings up to #{meeting - 1})"
                )
            else:
                places.append(f"replica {i} is elsewhere ({where})")
        first = min(self._arrived)
        missing = [
            i
            for i in range(self._n)
            if i not in self._arrived
            or (self._whats[i], self._signatures.get(i)) != (self._whats[first], self._signatures.get(first))
        ]
        error = CollectiveMismatchError(
            "Every replica must reach the same meeting points (all_reduce, merge_call, "
            f"optimizer.step()) in the same order, but replicas {missing} did not join meeting #{meeting}: "
            f"{'it' if len(missing) == 1 else 'one'} {why}; the replicas took different paths. "
            f"Received: {'; '.join(places)}. {_REPLICA_HINT}"
        )
        self._abort_locked(error)
        raise error

    def _lead(self, leader_fn: Callable[[list[Any]], Any] | None) -> Any:
        self._meetings += 1
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
        if isinstance(self._aborted, CollectiveMismatchError):  # every replica reports it itself
            raise CollectiveMismatchError(str(self._aborted))
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
            self._whats.clear()
            self._threads.clear()
            self._returned.clear()
            self._meetings = 0
