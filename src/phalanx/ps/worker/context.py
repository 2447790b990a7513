"""Which worker environment the current thread runs a scheduled function for.

Set by `WorkerEnvironment.run` while a function is unpickled and runs; read by the worker's
half of the pickling contract (`phalanx.ps.pickling`) and by the embedding hooks
(`phalanx.ps.worker.embedding`). Unset everywhere else, the chief included.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from phalanx.protocols import DistributionStrategy
    from phalanx.ps.handles import VariableHandle

__all__ = ["Environment", "current", "running"]


class Environment(Protocol):
    """What unpickling and the embedding hooks use of a worker's environment:
    `phalanx.ps.worker.environment.WorkerEnvironment` is the one implementation (named here
    so this module does not import it: it imports this one)."""

    worker_index: int
    num_workers: int
    resources: dict[str, Any]
    lazy: dict[str, VariableHandle]
    strategy: DistributionStrategy

    def variable(self, handle: VariableHandle) -> torch.Tensor: ...
    def is_lazy(self, tensor: torch.Tensor) -> bool: ...
    def read_whole(self, tensor: torch.Tensor) -> None: ...
    def lookup_rows(self, tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor: ...
    def dataset(self, dataset_id: str, pickled_fn: bytes) -> Any: ...
    def iterator(self, iterator_id: str, dataset_id: str, pickled_fn: bytes) -> Any:
        """This worker's iterator (a `phalanx.input.per_worker.WorkerIterator`)."""
        ...


_current = threading.local()


@contextlib.contextmanager
def running(env: Environment) -> Iterator[None]:
    """Makes ``env`` the environment this thread's unpickling and hooks refer to."""
    previous = getattr(_current, "env", None)
    _current.env = env
    try:
        yield
    finally:
        _current.env = previous


def current() -> Environment | None:
    """The environment of the function this thread runs, if any."""
    env: Environment | None = getattr(_current, "env", None)
    return env
