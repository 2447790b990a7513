"""Element-wise transformations: map, filter, enumerate, cache and with_options."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.data import structure
from phalanx.data.cardinality import UNKNOWN
from phalanx.data.op import Input, Op
from phalanx.data.parallel import parallel_map

if TYPE_CHECKING:
    from phalanx.data.dataset_options import Options

__all__ = ["Cache", "Enumerate", "Filter", "Map", "WithOptions"]


class Map(Op):
    """``fn`` applied to every element (a tuple unpacked into arguments), on threads if asked."""

    name = "map"

    def __init__(self, fn: Callable[..., Any], workers: int) -> None:
        self._fn, self._workers = fn, workers

    def _call(self, element: Any) -> Any:
        return structure.to_tensors(structure.apply_unpacked(self._fn, element))

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        if self._workers == 1:
            return (self._call(e) for e in inputs[0])
        return parallel_map(self._call, iter(inputs[0]), self._workers)

    def cardinality(self, inputs: Sequence[int]) -> int:
        return inputs[0]

    def shard_block_below(self, block: int) -> int | None:
        return block  # one output per input, in order


class Filter(Op):
    """Only the elements for which the predicate is true."""

    name = "filter"

    def __init__(self, predicate: Callable[..., Any]) -> None:
        self._predicate = predicate

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return (e for e in inputs[0] if _truth(structure.apply_unpacked(self._predicate, e)))

    def cardinality(self, inputs: Sequence[int]) -> int:
        return UNKNOWN


def _truth(value: Any) -> bool:
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(
            "filter's predicate must return a bool or a one-element tensor. Received a tensor of "
            f"shape {tuple(value.shape)}. HINT: reduce it, e.g. with .all() or .any()."
        )
    return bool(value)


class Enumerate(Op):
    """``(index, element)`` pairs, the index an int64 scalar tensor counting from ``start``."""

    name = "enumerate"

    def __init__(self, start: int) -> None:
        self._start = start

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return ((torch.tensor(i), e) for i, e in enumerate(inputs[0], self._start))

    def cardinality(self, inputs: Sequence[int]) -> int:
        return inputs[0]


class WithOptions(Op):
    """The input unchanged, with options merged over the input's."""

    name = "with_options"

    def __init__(self, options: Options) -> None:
        self._options = options.copy()

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return iter(inputs[0])

    def cardinality(self, inputs: Sequence[int]) -> int:
        return inputs[0]

    @property
    def options(self) -> Options | None:
        return self._options

    def shard_block_below(self, block: int) -> int | None:
        return block


class Cache(Op):
    """The first complete pass kept in memory; later passes replay it.

    A pass abandoned part-way is not kept (the next pass reads the input again), as with
    tf.data's in-memory cache.
    """

    name = "cache"

    def __init__(self) -> None:
        self._elements: list[Any] | None = None
        self._lock = threading.Lock()

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        with self._lock:
            stored = self._elements
        return iter(stored) if stored is not None else self._fill(inputs[0])

    def _fill(self, source: Input) -> Iterator[Any]:
        elements = []
        for e in source:
            elements.append(e)
            yield e
        with self._lock:
            if self._elements is None:
                self._elements = elements

    def cardinality(self, inputs: Sequence[int]) -> int:
        return inputs[0]

    def fresh(self) -> Op:
        return Cache()
