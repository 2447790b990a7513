"""The coordinator's connection to one worker task: runs a function there, and tells a lost
worker (its process died, or it stopped answering heartbeats) from a function that failed, and
from a function that hangs on a worker that still answers (the closure deadline)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from phalanx.ps import pickling
from phalanx.ps.coordinator.deadlines import CLOSURE_TIMEOUT_ENV, DEFAULT_CLOSURE_TIMEOUT
from phalanx.ps.transport import RpcClient, TaskUnavailableError
from phalanx.ps.variables import BufferChanges

__all__ = ["ClosureTimeoutError", "RemoteWorker", "WorkerLostError"]

log = logging.getLogger("phalanx")


class WorkerLostError(RuntimeError):
    """The worker could not be reached or stopped answering; its function runs elsewhere."""


class ClosureTimeoutError(TimeoutError):
    """A function ran past the closure deadline on a worker that still answers heartbeats."""


class RemoteWorker:
    """Runs pickled functions on one worker task.

    While a function runs, the worker is pinged every ``heartbeat_interval`` seconds; after
    ``heartbeat_misses`` pings in a row without an answer (each within the interval), it
    counts as lost: ``run`` raises `WorkerLostError` (the process dying ends the call at once).
    A worker that answers while its function runs longer than ``closure_timeout`` seconds
    makes ``run`` raise `ClosureTimeoutError` naming both.

    Args:
        index: The worker's index in the ``worker`` job.
        client: A connection to it.
        heartbeat_interval, heartbeat_misses: See above (defaults: 1 s, 5 misses).
        closure_timeout: See above (default 3600 s).
    """

    def __init__(
        self,
        index: int,
        client: RpcClient,
        heartbeat_interval: float = 1.0,
        heartbeat_misses: int = 5,
        closure_timeout: float = DEFAULT_CLOSURE_TIMEOUT,
    ) -> None:
        self.index, self._client = index, client
        self._interval, self._misses = heartbeat_interval, heartbeat_misses
        self.closure_timeout = closure_timeout

    @classmethod
    def with_deadlines(
        cls, index: int, client: RpcClient, heartbeat_timeout: float, closure_timeout: float
    ) -> RemoteWorker:
        """A worker counted lost after about ``heartbeat_timeout`` silent seconds (pinged at
        most every second, at least 5 times within the bound)."""
        interval = min(1.0, heartbeat_timeout / 5)
        return cls(index, client, interval, max(2, math.ceil(heartbeat_timeout / interval)), closure_timeout)

    @property
    def name(self) -> str:
        """The worker's name in messages."""
        return self._client.name

    @property
    def abandon_after(self) -> float:
        """Seconds without a ping after which the worker stops writing for its function: one
        interval less than the silence after which this side counts it lost, so that any
        write the worker starts after that decision is refused (`phalanx.ps.worker.running`)."""
        return (self._misses - 1) * self._interval

    def run(
        self, payload: bytes, run: int = 0, what: str = "a function", session: str | None = None
    ) -> tuple[bool, bytes, BufferChanges]:
        """Runs one pickled function: (True, pickled result, the buffer changes the caller adds
        to the ps tasks when it takes the result) or (False, pickled error, no changes).

        Args:
            payload: The pickled function and arguments.
            run: This run's number, named in the heartbeats (the worker tells what it runs).
            what: The function, for the errors.
            session: The coordinator's session: the worker tags its calls to the ps tasks
                with ``[session, index, run]`` (`phalanx.ps.coordinator.fencing`); None: untagged.

        Raises:
            WorkerLostError: The worker is unreachable, or stopped answering.
            ClosureTimeoutError: The worker answers, but the function ran past ``closure_timeout``.
        """
        request = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        fence = None if session is None else [session, self.index, run]
        header = {"closure": run, "heartbeat_timeout": self.abandon_after, "fence": fence}
        # the RPC's own deadline is a backstop: the closure deadline below fires first
        limit = self.closure_timeout + self._interval * (self._misses + 2)
        start, missed = time.monotonic(), 0

        def heartbeat() -> None:  # every interval without the reply, on this thread
            nonlocal missed
            elapsed = time.monotonic() - start
            if elapsed > self.closure_timeout:
                raise self._closure_timeout(what, elapsed)
            missed = 0 if self.status(self._interval, run) is not None else missed + 1
            if missed >= self._misses:
                silent = missed * self._interval
                raise WorkerLostError(
                    f"{self.name} stopped answering heartbeats ({missed} missed, {silent:g}s)"
                )

        try:
            reply, tensors = self._client.call_watched(
                "run", header, [request], timeout=limit, every=self._interval, on_wait=heartbeat
            )
        except TaskUnavailableError as exc:
            raise WorkerLostError(str(exc)) from exc
        changes = BufferChanges.from_reply(reply.get("buffers", []), tensors[1:])
        return bool(reply["ok"]), tensors[0].numpy().tobytes(), changes

    def _closure_timeout(self, what: str, elapsed: float) -> ClosureTimeoutError:
        return ClosureTimeoutError(
            f"{what} ran on {self.name} for {elapsed:.0f}s, longer than the closure deadline of "
            f"{self.closure_timeout:g}s, while the worker kept answering heartbeats. Received: a function "
            "that hangs or runs too long. HINT: the worker's log shows where it is; a function that needs "
            "longer takes ClusterCoordinator(closure_timeout=...) or "
            f"{CLOSURE_TIMEOUT_ENV}. The worker serves again once the function returns."
        )

    def status(self, timeout: float, closure: int | None = None) -> dict[str, Any] | None:
        """The worker's heartbeat reply (``{"worker", "running", "running_for"}``), or None if it
        does not answer within ``timeout`` seconds. ``closure``: the function this side still
        waits for (the worker keeps writing for it)."""
        try:
            reply, _ = self._client.call("ping", {"closure": closure}, timeout=timeout, wait_for_ready=True)
        except Exception:  # unreachable, or the connection was closed at shutdown
            return None
        return reply

    def ping(self, timeout: float) -> bool:
        """Whether the worker answers within ``timeout`` seconds."""
        return self.status(timeout) is not None

    def wait_until_back(self, timeout: float, stop: object | None = None, idle: bool = False) -> bool:
        """Pings until the worker answers (True) or ``timeout`` passes (False); with ``idle``,
        until it answers running no function."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if getattr(stop, "is_set", lambda: False)():
                return False
            reply = self.status(min(self._interval, max(deadline - time.monotonic(), 0.01)))
            if reply is not None and not (idle and reply.get("running") is not None):
                return True
            time.sleep(min(self._interval, 0.5))
        return False

    @staticmethod
    def result(ok: bool, data: bytes) -> object:
        """The function's value, or raises its error (unpickled from the worker's reply)."""
        value = pickling.loads(data)
        if not ok:
            assert isinstance(value, BaseException)
            raise value
        return value

    def close(self) -> None:
        """Closes the connection (a running call is cancelled)."""
        self._client.close()
