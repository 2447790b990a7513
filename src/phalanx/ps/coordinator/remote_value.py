"""RemoteValue: the future result of a function scheduled on a worker (tf.distribute's)."""

from __future__ import annotations

import enum
import threading
from typing import Any

import torch

__all__ = ["RemoteValue", "RemoteValueStatus"]


class RemoteValueStatus(enum.Enum):
    """Where a `RemoteValue` stands."""

    NOT_READY = "NOT_READY"  # scheduled or running
    ABORTED = "ABORTED"  # the function failed or was cancelled: fetch raises
    READY = "READY"  # the function returned


class RemoteValue:
    """The result of `ClusterCoordinator.schedule`, available once a worker ran the function.

    `fetch` and `get` block until then. A function that raised (or was cancelled because an
    earlier one failed) makes them raise that error.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _set_value(self, value: Any) -> None:
        self._value, self._error = value, None
        self._done.set()

    def _set_error(self, error: BaseException) -> None:
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

    def _wait(self, timeout: float | None) -> Any:
        if not self._done.wait(timeout):
            raise TimeoutError(
                f"The scheduled function did not finish within {timeout:g}s. HINT: call "
                "coordinator.join() to wait for every scheduled function, or fetch without a timeout."
            )
        if self._error is not None:
            raise self._error
        return self._value

    def get(self, timeout: float | None = None) -> Any:
        """The function's return value, with tensors as tensors (blocks until it is ready).

        Raises:
            The function's error; TimeoutError after ``timeout`` seconds.
        """
        return self._wait(timeout)

    def fetch(self, timeout: float | None = None) -> Any:
        """The function's return value with tensors as NumPy arrays, as TF's ``fetch`` gives
        (blocks until it is ready).

        Raises:
            The function's error; TimeoutError after ``timeout`` seconds.
        """
        return _to_numpy(self._wait(timeout))

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
