"""batch and unbatch: group consecutive elements into batched tensors, and split them again."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from phalanx.data import structure
from phalanx.data.cardinality import UNKNOWN, is_known
from phalanx.data.op import Input, Op
from phalanx.data.rows import batch_rows

__all__ = ["Batch", "Unbatch"]


class Batch(Op):
    """Consecutive elements stacked into one; the last, partial batch kept unless dropped.

    Over rows of source tensors (`Op.rows`), a batch is one slice or gather of the sources
    instead of a stack of single rows.
    """

    name = "batch"

    def __init__(self, batch_size: int, drop_remainder: bool) -> None:
        self._size, self._drop = batch_size, drop_remainder

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        rows = inputs[0].source_rows()
        if rows is not None:
            return batch_rows(rows, self._size, self._drop)
        return _stacked(iter(inputs[0]), self._size, self._drop)

    def cardinality(self, inputs: Sequence[int]) -> int:
        n = inputs[0]
        if not is_known(n):
            return n
        return n // self._size if self._drop else -(-n // self._size)

    def shard_block_below(self, block: int) -> int | None:
        # Blocks of whole batches: each worker cuts the same batches (the partial last one too).
        return block * self._size

    def describe(self) -> str:
        return f"batch({self._size}{', drop_remainder=True' if self._drop else ''})"


def _stacked(source: Iterator[Any], size: int, drop_remainder: bool) -> Iterator[Any]:
    while True:
        chunk = list(itertools.islice(source, size))
        if not chunk or (drop_remainder and len(chunk) < size):
            return
        yield structure.stack(chunk)


class Unbatch(Op):
    """The rows of every batched element, in order."""

    name = "unbatch"

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return (row for batch in inputs[0] for row in structure.unstack(batch))

    def cardinality(self, inputs: Sequence[int]) -> int:
        return UNKNOWN
