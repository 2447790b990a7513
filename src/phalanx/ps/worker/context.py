"""Which worker environment the current thread runs a scheduled function for.

Set by `WorkerEnvironment.run` while a function is unpickled and runs; read by the worker's
half of the pickling contract (`phalanx.ps.pickling`) and by the embedding hooks
(`phalanx.ps.worker.embedding`). Unset everywhere else, the chief included.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.ps.worker.environment import WorkerEnvironment

__all__ = ["current", "running"]

_current = threading.local()


@contextlib.contextmanager
def running(env: WorkerEnvironment) -> Iterator[None]:
    """Makes ``env`` the environment this thread's unpickling and hooks refer to."""
    previous = getattr(_current, "env", None)
    _current.env = env
    try:
        yield
    finally:
        _current.env = previous


def current() -> WorkerEnvironment | None:
    """The environment of the function this thread runs, if any."""
    env: WorkerEnvironment | None = getattr(_current, "env", None)
    return env
