"""RemoteValue: the future result of a function scheduled on a worker (tf.distribute's)."""

from __future__ import annotations

import enum
import threading
from typing import Any

import torch

from phalanx.ps.coordinator.deadlines import Waiter

__all__ = ["RemoteValue", "RemoteValueStatus"]


class RemoteValueStatus(enum.Enum):
    """Where a `RemoteValue` stands."""

    NOT_READY = "NOT_READY"  # scheduled or running
    ABORTED = "ABORTED"  # the function failed or was cancelled: fetch raises
    READY = "READY"  # the function returned


class RemoteValue:
    """The result of `ClusterCoordinator.schedule`, available once a worker ran the function.

    `fetch` and `get` block until then, bounded: by their ``timeout``, or else by the
    coordinator's ``wait_timeout`` (`phalanx.ps.coordinator.deadlines`). A function that raised
    (or was cancelled because an earlier one failed) makes them raise that error.

    The coordinator's side fills it in: `set_result` or `set_exception`, called by
    `phalanx.ps.coordinator.closure.ClosureQueue` (as ``concurrent.futures.Future``'s, they
    are for the code that runs the function, not for users).

    Args:
        what: The function, for messages.
        waiter: The coordinator's bound on waits without a timeout (None: a waiter of its own,
            made at the first wait).
    """

    def __init__(self, what: str = "the scheduled function", waiter: Waiter | None = None) -> None:
        self._what = what
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None
        self._waiter = waiter

    def set_result(self, value: Any) -> None:
        """The function returned ``value``: READY, and waits return it."""
        self._value, self._error = value, None
        self._done.set()

    def set_exception(self, error: BaseException) -> None:
        """The function raised ``error`` or was cancelled: ABORTED, and waits raise it."""
        self._value, self._error = None, error
        self._done.set()

    def _reset(self) -> None:
        """Back to NOT_READY (the function is retried on another worker)."""
        self._done.clear()
        self._value = self._error = None

    @property
    def status(self) -> RemoteValueStatus:
        """NOT_READY, READY or ABORTED (does not block)."""
        if not self._done.is_set():
            return RemoteValueStatus.NOT_READY
        return RemoteValueStatus.ABORTED if self._error is not None else RemoteValueStatus.READY

    def _wait(self, timeout: float | None, method: str) -> Any:
        if self._waiter is None:
            self._waiter = Waiter.alone()
        self._waiter.wait(self._done.wait, timeout, f"{method}() of {self._what}")
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """The function's return value, with tensors as tensors (blocks until it is ready).

        Raises:
            The function's error; TimeoutError after ``timeout`` seconds, or once no
            scheduled function finished for the coordinator's ``wait_timeout`` (it names
            what is pending).
        """
        return self._wait(timeout, "get")

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's return value with tensors as NumPy arrays, as TF's ``fetch`` gives
        (blocks until it is ready).

        Raises:
            The function's error; TimeoutError after ``timeout`` seconds, or once no
            scheduled function finished for the coordinator's ``wait_timeout`` (it names
            what is pending).
        """
        return _to_numpy(self._wait(timeout, "fetch"))

    def __repr__(self) -> str:
        return f"RemoteValue(status={self.status.value})"


def _to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        items = [_to_numpy(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _to_numpy(v) for k, v in value.items()}
    return value
