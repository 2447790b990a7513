"""How many shards a variable is split into along its first axis (tf.distribute's
``experimental.partitioners``). Give one to ``ParameterServerStrategy(variable_partitioner=...)``.

A partitioner is called with a variable's shape and dtype and returns the number of
partitions per axis; only the first axis is ever split. Shards are spread over the ps tasks
round-robin; their rows are split as evenly as possible, the first shards taking one row
more (TF's rule).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"]


class Partitioner:
    """Base class: ``partitioner(shape, dtype) -> [shards along axis 0, 1, 1, ...]``."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        if axis != 0:
            raise ValueError(f"Variables are partitioned along axis 0 only. Received: axis={axis}.")
        shape = list(shape)
        if not shape or shape[0] == 0:
            return [1] * max(len(shape), 1)
        return [max(1, min(self._shards(shape, dtype), shape[0])), *([1] * (len(shape) - 1))]

    def _shards(self, shape: list[int], dtype: torch.dtype) -> int:
        raise NotImplementedError


def _row_bytes(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape[1:]) * torch.empty((), dtype=dtype).element_size()


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer when the variable has fewer rows).

    Raises:
        ValueError: ``num_shards`` < 1.
    """

    def __init__(self, num_shards: int) -> None:
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1. Received: {num_shards}.")
        self.num_shards = num_shards

    def _shards(self, shape: list[int], dtype: torch.dtype) -> int:
        return self.num_shards


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``.

    Raises:
        ValueError: A bound < 1.
    """

    def __init__(
        self, min_shard_bytes: int = 256 << 10, max_shards: int = 1, bytes_per_string: int = 16
    ) -> None:
        if min_shard_bytes < 1 or max_shards < 1:
            raise ValueError(
                f"min_shard_bytes and max_shards must be >= 1. Received: {min_shard_bytes}, {max_shards}."
            )
        self.min_shard_bytes, self.max_shards = min_shard_bytes, max_shards

    def _shards(self, shape: list[int], dtype: torch.dtype) -> int:
        total = shape[0] * _row_bytes(shape, dtype)
        return min(self.max_shards, max(1, total // self.min_shard_bytes))


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (at least one row each), at
    most ``max_shards`` if given.

    Raises:
        ValueError: A bound < 1.
    """

    def __init__(
        self, max_shard_bytes: int, max_shards: int | None = None, bytes_per_string: int = 16
    ) -> None:
        if max_shard_bytes < 1 or (max_shards is not None and max_shards < 1):
            raise ValueError(
                f"max_shard_bytes and max_shards must be >= 1. Received: {max_shard_bytes}, {max_shards}."
            )
        self.max_shard_bytes, self.max_shards = max_shard_bytes, max_shards

    def _shards(self, shape: list[int], dtype: torch.dtype) -> int:
        rows_per_shard = max(1, self.max_shard_bytes // max(_row_bytes(shape, dtype), 1))
        shards = math.ceil(shape[0] / rows_per_shard)
        return shards if self.max_shards is None else min(shards, self.max_shards)


def shard_rows(rows: int, shards: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of each shard: as even as possible, the first ones larger."""
    base, extra = divmod(rows, shards)
    out, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out
