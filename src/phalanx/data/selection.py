"""Selections of elements by position: take, skip and shard.

Each keeps the rows fast path: over tensor slices they select row numbers (slicing a range,
which keeps contiguous batches as views) instead of elements.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from phalanx.data import structure
from phalanx.data.cardinality import INFINITE, is_known
from phalanx.data.op import Input, Op
from phalanx.data.rows import Order, Rows, indices

__all__ = ["Shard", "Skip", "Take"]


def _select(order: Order, start: int, stop: int | None, step: int) -> Order:
    if isinstance(order, range):
        return order[start:stop:step]
    return lambda: itertools.islice(indices(order), start, stop, step)


class Take(Op):
    """The first ``count`` elements (all of them when ``count`` is -1)."""

    name = "take"

    def __init__(self, count: int) -> None:
        self._count = count

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return itertools.islice(inputs[0], None if self._count < 0 else self._count)

    def cardinality(self, inputs: Sequence[int]) -> int:
        n = inputs[0]
        if self._count < 0:
            return n
        if n == INFINITE:
            return self._count
        return min(n, self._count) if is_known(n) else n

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        rows = inputs[0].source_rows()
        if rows is None or self._count < 0:
            return rows
        return Rows(rows.data, _select(rows.order, 0, self._count, 1))

    def describe(self) -> str:
        return f"take({self._count})"


class Skip(Op):
    """All but the first ``count`` elements (none when ``count`` is -1, as in tf.data)."""

    name = "skip"

    def __init__(self, count: int) -> None:
        self._count = count

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        if self._count < 0:
            return _drain(iter(inputs[0]))
        return itertools.islice(inputs[0], self._count, None)

    def cardinality(self, inputs: Sequence[int]) -> int:
        n = inputs[0]
        if not is_known(n):
            return n
        return 0 if self._count < 0 else max(0, n - self._count)

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        rows = inputs[0].source_rows()
        if rows is None:
            return None
        order = range(0) if self._count < 0 else _select(rows.order, self._count, None, 1)
        return Rows(rows.data, order)

    def describe(self) -> str:
        return f"skip({self._count})"


def _drain(it: Iterator[Any]) -> Iterator[Any]:
    for _ in it:  # tf.data's skip(-1) reads the whole input and yields nothing
        pass
    yield from ()


class Shard(Op):
    """Every ``num_shards``-th element (or block of ``block`` elements), starting at ``index``.

    With ``block`` > 1 the blocks ``index, index + num_shards, ...`` of ``block`` consecutive
    elements are kept: how a DataLoader worker takes its share below a ``batch`` (see
    `Op.shard_block_below`).
    """

    name = "shard"

    def __init__(self, num_shards: int, index: int, block: int = 1) -> None:
        self._num_shards, self._index, self._block = num_shards, index, block

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        rows = self.rows(inputs)
        if rows is not None:  # read only this shard's rows of the source tensors
            return (structure.index(rows.data, i) for i in indices(rows.order))
        if self._block == 1:
            return itertools.islice(inputs[0], self._index, None, self._num_shards)
        return (e for i, e in enumerate(inputs[0]) if self._keeps(i))

    def _keeps(self, position: int) -> bool:
        return (position // self._block) % self._num_shards == self._index

    def cardinality(self, inputs: Sequence[int]) -> int:
        n = inputs[0]
        if not is_known(n):
            return n
        cycle = self._block * self._num_shards
        rest = n % cycle - self._index * self._block
        return n // cycle * self._block + min(max(rest, 0), self._block)

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        rows = inputs[0].source_rows()
        if rows is None:
            return None
        if self._block == 1:
            return Rows(rows.data, _select(rows.order, self._index, None, self._num_shards))
        order = rows.order
        return Rows(rows.data, lambda: (r for i, r in enumerate(indices(order)) if self._keeps(i)))

    def describe(self) -> str:
        block = f", block={self._block}" if self._block > 1 else ""
        return f"shard({self._num_shards}, {self._index}{block})"
