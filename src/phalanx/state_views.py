"""Which state dicts FullyShardedStrategy's modules give: full tensors, or this worker's
shards (DTensors) while `sharded_state_dicts` is open on the thread (what
``torch.distributed.checkpoint`` reads and writes; `phalanx.checkpoint` opens it)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["sharded_state_dicts", "sharded_views_open"]

_views = threading.local()  # .sharded: sharded_state_dicts() is open on this thread


@contextlib.contextmanager
def sharded_state_dicts() -> Iterator[None]:
    """Inside, sharded modules' ``state_dict()`` gives this worker's shards (DTensors) and
    ``load_state_dict`` takes them, as ``torch.distributed.checkpoint`` wants (this thread).
    Outside, FullyShardedStrategy's modules give and take full tensors."""
    previous = getattr(_views, "sharded", False)
    _views.sharded = True
    try:
        yield
    finally:
        _views.sharded = previous


def sharded_views_open() -> bool:
    """Whether `sharded_state_dicts` is open on this thread."""
    return bool(getattr(_views, "sharded", False))
