"""Rows: the fast path of `batch` over tensor slices (optionally shuffled, sharded, repeated).

When a chain only reorders or selects rows of source tensors, `batch` cuts a batch out of
them in one indexing call (a view when the rows are a contiguous range) instead of stacking
single-row elements, which is what makes ``from_tensor_slices(x).shuffle(n).batch(b)`` fast.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.data import structure

__all__ = ["Order", "Rows", "batch_rows", "indices"]

# The order rows are read in: a range (slicing gives views) or a callable giving a fresh
# iterator of row numbers for each pass.
Order = range | Callable[[], Iterable[int]]


@dataclass(frozen=True)
class Rows:
    """Source tensors and the order of the rows a chain yields.

    Attributes:
        data: A structure of tensors (or lists of strings) sharing a first dimension.
        order: The row numbers, in order, for one pass.
    """

    data: Any
    order: Order


def indices(order: Order) -> Iterator[int]:
    """A fresh iterator over the row numbers of ``order``."""
    return iter(order) if isinstance(order, range) else iter(order())


def batch_rows(rows: Rows, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
    """Batches of ``rows`` cut by slicing (ranges) or gathering (any other order)."""
    if isinstance(rows.order, range):
        return _sliced(rows.data, rows.order, batch_size, drop_remainder)
    return _gathered(rows.data, indices(rows.order), batch_size, drop_remainder)


def _sliced(data: Any, order: range, batch_size: int, drop_remainder: bool) -> Iterator[Any]:
    stop = len(order) - len(order) % batch_size if drop_remainder else len(order)
    for i in range(0, stop, batch_size):
        part = order[i : i + batch_size]
        yield structure.index(data, slice(part.start, part.stop, part.step))  # a view: no copy


def _gathered(data: Any, order: Iterator[int], batch_size: int, drop_remainder: bool) -> Iterator[Any]:
    while True:
        chunk = list(itertools.islice(order, batch_size))
        if not chunk or (drop_remainder and len(chunk) < batch_size):
            return
        yield structure.index(data, torch.tensor(chunk, dtype=torch.long))
