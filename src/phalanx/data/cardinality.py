"""Cardinality: how many elements a dataset has, when the chain of transformations tells.

`INFINITE` and `UNKNOWN` are tf.data's sentinel values (``tf.data.INFINITE_CARDINALITY``,
``tf.data.UNKNOWN_CARDINALITY``); a known cardinality is a count >= 0.
"""

from __future__ import annotations

__all__ = ["INFINITE", "UNKNOWN", "describe", "is_known"]

INFINITE = -1
UNKNOWN = -2


def is_known(cardinality: int) -> bool:
    """Whether ``cardinality`` is a count rather than `INFINITE` or `UNKNOWN`."""
    return cardinality >= 0


def describe(cardinality: int) -> str:
    """A word for a cardinality in error messages: the count, "infinite" or "unknown"."""
    if cardinality == INFINITE:
        return "infinite"
    if cardinality == UNKNOWN:
        return "unknown"
    return str(cardinality)
