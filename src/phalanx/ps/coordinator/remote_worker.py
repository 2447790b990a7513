"""The coordinator's connection to one worker task: runs a function there, and tells a lost
worker (its process died, or it stopped answering heartbeats) from a function that failed."""

from __future__ import annotations

import logging
import time

import torch

from phalanx.ps import pickling
from phalanx.ps.transport import RpcClient, TaskUnavailableError

__all__ = ["RemoteWorker", "WorkerLostError"]

log = logging.getLogger("phalanx")


class WorkerLostError(RuntimeError):
    """The worker could not be reached or stopped answering; its function runs elsewhere."""


class RemoteWorker:
    """Runs pickled functions on one worker task.

    While a function runs, the worker is pinged every ``heartbeat_interval`` seconds; after
    ``heartbeat_misses`` pings in a row without an answer (each within the interval), it
    counts as lost: ``run`` raises `WorkerLostError` (the process dying ends the call at once).

    Args:
        index: The worker's index in the ``worker`` job.
        client: A connection to it.
        heartbeat_interval, heartbeat_misses: See above (defaults: 1 s, 5 misses).
    """

    def __init__(
        self, index: int, client: RpcClient, heartbeat_interval: float = 1.0, heartbeat_misses: int = 5
    ) -> None:
        self.index, self._client = index, client
        self._interval, self._misses = heartbeat_interval, heartbeat_misses

    @property
    def name(self) -> str:
        """The worker's name in messages."""
        return self._client.name

    def run(self, payload: bytes) -> tuple[bool, bytes]:
        """Runs one pickled function; (True, pickled result) or (False, pickled error).

        Raises:
            WorkerLostError: The worker is unreachable, or stopped answering.
        """
        request = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        call = self._client.start("run", {}, [request], timeout=365 * 24 * 3600.0)
        missed = 0
        while True:
            try:
                header, tensors = call.result(timeout=self._interval)
            except TimeoutError:
                missed = 0 if self.ping(self._interval) else missed + 1
                if missed >= self._misses:
                    call.cancel()
                    raise WorkerLostError(
                        f"{self.name} stopped answering heartbeats ({missed} missed, "
                        f"{missed * self._interval:g}s)"
                    ) from None
                continue
            except TaskUnavailableError as exc:
                raise WorkerLostError(str(exc)) from exc
            return bool(header["ok"]), tensors[0].numpy().tobytes()

    def ping(self, timeout: float) -> bool:
        """Whether the worker answers within ``timeout`` seconds."""
        try:
            self._client.call("ping", {}, timeout=timeout, wait_for_ready=True)
        except Exception:  # unreachable, or the connection was closed at shutdown
            return False
        return True

    def wait_until_back(self, timeout: float, stop: object | None = None) -> bool:
        """Pings until the worker answers (True) or ``timeout`` passes (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if getattr(stop, "is_set", lambda: False)():
                return False
            if self.ping(min(self._interval, max(deadline - time.monotonic(), 0.01))):
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
