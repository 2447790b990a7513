"""shuffle: tf.data's buffered shuffle, seeded per pass so that every epoch is reproducible."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from phalanx.data.op import Input, Op
from phalanx.data.rows import Order, Rows, indices

__all__ = ["Shuffle", "buffer_shuffle"]


def buffer_shuffle(source: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    """tf.data's algorithm: fill a buffer of ``size``, then emit a random slot and refill it.

    With ``size`` >= the number of elements this is a uniform shuffle; smaller buffers only
    mix elements that are close in the input.
    """
    buffer = list(itertools.islice(source, size))
    for element in source:
        i = rng.randrange(len(buffer))
        yield buffer[i]
        buffer[i] = element
    rng.shuffle(buffer)
    yield from buffer


class Shuffle(Op):
    """Elements in a random order drawn through a buffer of ``buffer_size``.

    Each pass uses a generator seeded from ``seed`` and the pass number (always pass 0 unless
    ``reshuffle_each_iteration``), so a seeded pipeline repeats exactly, epoch by epoch. Without
    a seed, one is drawn from torch's global generator when the dataset is built, so
    ``torch.manual_seed`` makes unseeded pipelines reproducible too (like TF's global seed).
    """

    name = "shuffle"

    def __init__(self, buffer_size: int, seed: int | None, reshuffle_each_iteration: bool) -> None:
        self._size = buffer_size
        self._seed = int(torch.randint(0, 2**62, ()).item()) if seed is None else seed
        self._reshuffle = reshuffle_each_iteration
        self._passes = itertools.count()

    def _rng(self) -> random.Random:
        epoch = next(self._passes) if self._reshuffle else 0
        return random.Random(f"phalanx-shuffle/{self._seed}/{epoch}")

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return buffer_shuffle(iter(inputs[0]), self._size, self._rng())

    def cardinality(self, inputs: Sequence[int]) -> int:
        return inputs[0]

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        rows = inputs[0].source_rows()
        if rows is None:
            return None
        return Rows(rows.data, self._shuffled(rows.order))

    def _shuffled(self, order: Order) -> Order:
        return lambda: buffer_shuffle(indices(order), self._size, self._rng())

    def fresh(self) -> Op:
        return Shuffle(self._size, self._seed, self._reshuffle)

    def describe(self) -> str:
        return f"shuffle({self._size})"
