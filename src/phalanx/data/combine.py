"""Combinations of datasets: zip and concatenate."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from phalanx.data.cardinality import INFINITE, UNKNOWN, is_known
from phalanx.data.op import Input, Op

__all__ = ["Concatenate", "Zip"]


class Zip(Op):
    """Elements of several datasets taken together, as a tuple or a dict; stops at the shortest."""

    name = "zip"

    def __init__(self, keys: list[str] | None) -> None:
        self._keys = keys  # None: tuples; else the dict keys, one per input

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        together = zip(*inputs, strict=False)
        if self._keys is None:
            return together
        keys = self._keys
        return (dict(zip(keys, parts, strict=True)) for parts in together)

    def cardinality(self, inputs: Sequence[int]) -> int:
        if UNKNOWN in inputs:
            return UNKNOWN
        finite = [n for n in inputs if is_known(n)]
        return min(finite) if finite else INFINITE


class Concatenate(Op):
    """The first input's elements, then the second's."""

    name = "concatenate"

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return itertools.chain(inputs[0], inputs[1])

    def cardinality(self, inputs: Sequence[int]) -> int:
        if INFINITE in inputs:
            return INFINITE
        if UNKNOWN in inputs:
            return UNKNOWN
        return sum(inputs)
