"""Which meta tensors a load is about to fill, and who gives them memory.

A model built on the meta device in the scope of a sharding strategy gets its memory when the
strategy shards it: at the first run, or at the first ``state_dict()`` / ``load_state_dict``.
Before a load, the strategy is told which meta tensors the load writes: a layer whose every
meta tensor is among them gets only this worker's shard of memory (no initial values on the
chief, no scatter); the load then writes each worker's rows. The strategy registers each module
it watches here (`register`), so that a loader that is handed a module (a safetensors file
read into ``model``) finds it without being told the strategy.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection, Container
from typing import Protocol

import torch
from torch import nn

__all__ = ["MetaOwner", "prepare", "register", "supplied"]


class MetaOwner(Protocol):
    """A strategy that gives meta tensors memory (FullyShardedStrategy)."""

    def materialize_meta(self, loaded: Collection[int] = ()) -> None: ...


_owners: weakref.WeakKeyDictionary[nn.Module, weakref.ref[MetaOwner]] = weakref.WeakKeyDictionary()


def register(module: nn.Module, owner: MetaOwner) -> None:
    """Records that ``owner`` gives ``module``'s meta tensors their memory (the strategy calls it)."""
    _owners[module] = weakref.ref(owner)


def supplied(module: nn.Module, prefix: str, names: Container[str]) -> set[int]:
    """``id``s of the meta parameters and of the buffers of ``module`` (and below) whose
    state-dict key (``prefix`` + name) is in ``names``: the tensors a load writes."""
    tensors: list[tuple[str, torch.Tensor]] = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return {id(t) for name, t in tensors if prefix + name in names}


def prepare(module: nn.Module, names: Collection[str]) -> None:
    """Gives ``module``'s meta tensors memory before a load writes the entries ``names``
    (every worker calls it, with the same names: the strategy shards collectively).

    A no-op for a module no sharding strategy watches, or one already sharded.
    """
    owners: dict[int, MetaOwner] = {}
    for child in module.modules():
        ref = _owners.get(child)
        owner = ref() if ref is not None else None
        if owner is not None:
            owners.setdefault(id(owner), owner)
    if owners:
        loaded = supplied(module, "", set(names))
        for owner in owners.values():
            owner.materialize_meta(loaded)
