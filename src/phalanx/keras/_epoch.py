"""One epoch of global batches as a dataset a strategy can distribute (for the fit loops)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from phalanx.input.input_options import AutoShardPolicy

__all__ = ["Epoch"]


class _Options:
    def __init__(self, policy: AutoShardPolicy) -> None:
        self.experimental_distribute = type("_Distribute", (), {"auto_shard_policy": policy})()


class Epoch:
    """One epoch of batches as a dataset the strategy can distribute (DATA-sharded)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches

    def __iter__(self) -> Iterator[Any]:
        return self._batches

    def options(self) -> _Options:
        # Every worker reads the same global batches and keeps its replicas' slices.
        return _Options(AutoShardPolicy.DATA)
