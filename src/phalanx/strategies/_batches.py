"""What a distributed iterator knows about each batch it hands out, kept for the `run` that
receives the batch: the global batch size and each replica's offset of its first example."""

from __future__ import annotations

from typing import Any

from phalanx.values import iter_leaves

__all__ = ["BatchLedger"]

_KEEP = 16  # batches handed out but never given to run are forgotten beyond this


class BatchLedger:
    """Batch facts by identity of the batch's first leaf (two iterators may alternate)."""

    def __init__(self) -> None:
        # id of the batch's first leaf -> (that leaf, global count, offsets); read as a whole
        # by `Strategy.run` (empty: nothing to take, the lean run applies)
        self.entries: dict[int, tuple[Any, int | None, list[int] | None]] = {}

    def remember(self, batch: Any, global_count: int | None, offsets: list[int] | None) -> None:
        """Notes a batch's global example count and per-replica example offsets."""
        first = next(iter_leaves(batch), None)
        if first is not None:
            self.entries[id(first)] = (first, global_count, offsets)
            if len(self.entries) > _KEEP:
                del self.entries[next(iter(self.entries))]

    def take(self, args: Any, kwargs: dict[str, Any] | None) -> tuple[int | None, list[int] | None]:
        """The facts of the remembered batch among ``args``/``kwargs`` (found by identity),
        else of the latest batch handed out; (None, None) when none is remembered."""
        if not self.entries:
            return None, None
        for leaf in iter_leaves((args, kwargs)):  # the batch is usually the first leaf
            entry = self.entries.get(id(leaf))
            if entry is not None and entry[0] is leaf:
                del self.entries[id(leaf)]
                return entry[1], entry[2]
        latest = self.entries.pop(next(reversed(self.entries)))
        return latest[1], latest[2]
