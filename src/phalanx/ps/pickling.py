"""How a scheduled function travels from the coordinator to a worker.

The function, its arguments and everything they reach (the model, the optimizer, the
strategy, per-worker iterators) are pickled with cloudpickle, except that some objects are
replaced by a reference the worker resolves to its own copy: a variable that lives on a ps
task becomes its `VariableHandle` (the worker keeps one local tensor per variable and fills
it from the ps tasks before the function runs), the strategy becomes the worker's strategy,
an iterator of a per-worker dataset becomes that worker's iterator. Nothing is unpickled
before the transport authenticated the caller (see `phalanx.ps.transport`).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import cloudpickle

__all__ = ["dumps", "dumps_exception", "loads"]


class _Pickler(cloudpickle.CloudPickler):
    def __init__(self, file: io.BytesIO, replace: Callable[[Any], Any]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._replace = replace

    def reducer_override(self, obj: Any) -> Any:
        reduced = self._replace(obj)
        if reduced is not NotImplemented:
            return reduced
        return super().reducer_override(obj)


def dumps(obj: Any, replace: Callable[[Any], Any] = lambda obj: NotImplemented) -> bytes:
    """Pickles ``obj``; ``replace(x)`` returns a reduce tuple for objects sent by reference,
    or ``NotImplemented`` for the rest."""
    buffer = io.BytesIO()
    _Pickler(buffer, replace).dump(obj)
    return buffer.getvalue()


def loads(data: bytes) -> Any:
    """Unpickles what `dumps` made (only from an authenticated peer)."""
    return pickle.loads(data)  # noqa: S301 - the transport authenticated the sender


def dumps_exception(exc: BaseException) -> bytes:
    """Pickles an exception so the coordinator raises the same type; one that cannot be
    pickled becomes a RuntimeError with its type and message."""
    try:
        data = cloudpickle.dumps(exc)
        pickle.loads(data)  # noqa: S301 - our own bytes
        return data
    except Exception:
        return cloudpickle.dumps(RuntimeError(f"{type(exc).__name__}: {exc}"))
