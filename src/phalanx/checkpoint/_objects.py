"""What a checkpoint saves of each tracked object, and how it puts it back (the single-file
and the sharded formats alike)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["load_into", "state_of"]


def state_of(obj: Any) -> Any:
    """What a checkpoint saves of ``obj``: a tensor's copy, a plain value, or its ``state_dict()``."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, (int, float, str, bool)):
        return obj
    state_dict = getattr(obj, "state_dict", None)
    if callable(state_dict):
        with torch.no_grad():
            return state_dict()
    raise TypeError(
        f"Checkpoint cannot save an object of type {type(obj).__name__}: it needs state_dict() "
        "and load_state_dict(), or must be a tensor. HINT: wrap counters in "
        "phalanx.checkpoint.Counter."
    )


def load_into(obj: Any, state: Any, name: str) -> None:
    """Puts saved ``state`` back into ``obj`` (a tensor in place, else ``load_state_dict``)."""
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():
            obj.copy_(state)
        return
    load = getattr(obj, "load_state_dict", None)
    if not callable(load):
        raise TypeError(f"Checkpoint cannot restore {name!r} of type {type(obj).__name__}.")
    load(state)
