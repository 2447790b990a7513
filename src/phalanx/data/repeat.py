"""repeat: the input again and again, a fixed number of times or forever."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from phalanx.data.cardinality import INFINITE, is_known
from phalanx.data.op import Input, Op
from phalanx.data.rows import Rows, indices

__all__ = ["Repeat"]


def _passes(count: int, one_pass: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """``count`` passes (-1: forever), stopping early when a pass yields nothing (as tf.data)."""
    for _ in itertools.count() if count < 0 else range(count):
        produced = False
        for item in one_pass():
            produced = True
            yield item
        if not produced:
            return


class Repeat(Op):
    """The input ``count`` times in a row (-1: forever); each pass restarts the input."""

    name = "repeat"

    def __init__(self, count: int) -> None:
        self._count = count

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return _passes(self._count, lambda: inputs[0])

    def cardinality(self, inputs: Sequence[int]) -> int:
        n = inputs[0]
        if self._count < 0:
            return 0 if n == 0 else INFINITE
        if self._count == 0:
            return 0
        return n * self._count if is_known(n) else n

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        rows = inputs[0].source_rows()
        if rows is None:
            return None
        order, count = rows.order, self._count
        return Rows(rows.data, lambda: _passes(count, lambda: indices(order)))

    def describe(self) -> str:
        return "repeat()" if self._count < 0 else f"repeat({self._count})"
