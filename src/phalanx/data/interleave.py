"""flat_map and interleave: each element opens an inner dataset, whose elements are merged.

``list_files(...).interleave(read_file, cycle_length=4)`` is the classic file pipeline: the
chain keeps its source files, so FILE auto-sharding can rebuild it over a subset of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from phalanx.data import structure
from phalanx.data.cardinality import UNKNOWN
from phalanx.data.op import Input, Op
from phalanx.data.prefetch import PrefetchIterator

__all__ = ["Interleave"]


class Interleave(Op):
    """tf.data's interleave; ``flat_map`` is the case cycle_length = block_length = 1.

    ``cycle_length`` inner iterators are open at once; ``block_length`` elements are taken
    from each in turn. When one ends, its slot opens the next input element's dataset the
    next time the cycle reaches it, exactly as tf.data orders them. With ``background``,
    each open inner iterator is read ahead on its own thread (``num_parallel_calls``).
    """

    def __init__(
        self, fn: Callable[..., Any], cycle_length: int, block_length: int, background: bool, name: str
    ) -> None:
        self._fn, self._cycle, self._block = fn, cycle_length, block_length
        self._background = background
        self.name = name

    def _open(self, element: Any) -> Iterator[Any]:
        inner = structure.apply_unpacked(self._fn, element)
        if not isinstance(inner, Iterable) or isinstance(inner, (str, bytes)):
            raise TypeError(
                f"{self.name}'s function must return a Dataset or an iterable of elements. "
                f"Received: {type(inner).__name__}. HINT: return Dataset.from_tensor_slices(...) "
                "or a generator of elements."
            )
        elements = (structure.to_tensors(e) for e in inner)  # a no-op for a Dataset's elements
        if self._background:
            return PrefetchIterator(elements, max(self._block, 2), "phalanx-interleave")
        return elements

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return _Cycle(iter(inputs[0]), self._open, self._cycle, self._block).run()

    def cardinality(self, inputs: Sequence[int]) -> int:
        return UNKNOWN

    def describe(self) -> str:
        return f"{self.name}(cycle_length={self._cycle})" if self._cycle > 1 else self.name


class _Cycle:
    """The interleave loop's state: the open slots and where the cycle stands."""

    def __init__(
        self, source: Iterator[Any], open_fn: Callable[[Any], Iterator[Any]], cycle: int, block: int
    ) -> None:
        self._source, self._open_fn, self._block = source, open_fn, block
        self._slots: list[Iterator[Any] | None] = [None] * cycle
        self._source_done = False

    def run(self) -> Iterator[Any]:
        i = 0
        try:
            while not self._source_done or any(s is not None for s in self._slots):
                if self._slots[i] is None and not self._source_done:
                    self._slots[i] = self._next_inner()
                    continue  # stay on this slot: it may have opened
                yield from self._take_block(i)
                i = (i + 1) % len(self._slots)
        finally:
            for slot in self._slots:
                _close(slot)

    def _next_inner(self) -> Iterator[Any] | None:
        try:
            element = next(self._source)
        except StopIteration:
            self._source_done = True
            return None
        return self._open_fn(element)

    def _take_block(self, i: int) -> Iterator[Any]:
        inner = self._slots[i]
        if inner is None:
            return
        for _ in range(self._block):
            try:
                yield next(inner)
            except StopIteration:
                self._slots[i] = None
                _close(inner)
                return


def _close(it: Iterator[Any] | None) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()
