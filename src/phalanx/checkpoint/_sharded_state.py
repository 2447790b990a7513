"""What a sharded checkpoint holds of each object, and how it is put back.

Modules give their state dict (under FullyShardedStrategy its shards, DTensors; elsewhere full
tensors, which DCP writes once however many workers hold them). Optimizers give
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``'s form: keyed by the
parameters' names, not their positions, so that it restores into any layout of the same
model. Anything else gives what the single-file format saves of it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor

from phalanx.checkpoint._objects import load_into, state_of
from phalanx.checkpoint._sharded import SUFFIX
from phalanx.checkpoint.weights.safetensors_files import SUFFIX as SAFETENSORS_SUFFIX
from phalanx.distribution import loads as meta_loads
from phalanx.state_views import sharded_state_dicts

__all__ = ["FORMAT", "apply", "collect", "is_sharded", "prepare", "sharded_state_dicts", "writes_sharded"]

FORMAT = "phalanx.checkpoint.sharded/1"


def is_sharded(objects: Mapping[str, Any]) -> bool:
    """Whether a module among ``objects`` is sharded (FullyShardedStrategy's DTensors)."""
    return any(
        isinstance(p, DTensor)
        for obj in objects.values()
        if isinstance(obj, nn.Module)
        for p in obj.parameters()
    )


def _model_of(optimizer: torch.optim.Optimizer, modules: list[nn.Module], name: str) -> nn.Module:
    wanted = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if wanted <= {id(p) for p in module.parameters()}:
            return module
    raise ValueError(
        f"A sharded checkpoint saves optimizer {name!r} by its parameters' names, from the "
        "module that holds them, but no module of this Checkpoint holds all of them. HINT: "
        "Checkpoint(model=model, optimizer=optimizer)."
    )


def _prepare(objects: Mapping[str, Any], strategy: Any) -> list[nn.Module]:
    if callable(getattr(strategy, "adopt", None)):
        for obj in objects.values():
            if isinstance(obj, torch.optim.Optimizer):
                strategy.adopt(obj)  # the sharded parameters, if it was made before sharding
    return [obj for obj in objects.values() if isinstance(obj, nn.Module)]


def prepare(objects: Mapping[str, Any], saved: Collection[str]) -> None:
    """Before a read: gives modules built on the meta device memory for what the checkpoint
    fills (``saved``: its flattened keys, ``model.layer.weight``), and no initial values
    (`phalanx.distribution.loads`; every worker calls it)."""
    for name, obj in objects.items():
        if isinstance(obj, nn.Module):
            meta_loads.prepare(obj, {key[len(name) + 1 :] for key in saved if key.startswith(name + ".")})


def collect(objects: Mapping[str, Any], strategy: Any) -> dict[str, Any]:
    """Every object's state for DCP (every worker calls it)."""

    modules = _prepare(objects, strategy)
    state: dict[str, Any] = {}
    with sharded_state_dicts(), torch.no_grad():
        for name, obj in objects.items():
            if isinstance(obj, nn.Module):
                state[name] = obj.state_dict()
            elif isinstance(obj, torch.optim.Optimizer):
                state[name] = get_optimizer_state_dict(_model_of(obj, modules, name), obj)
            else:
                state[name] = state_of(obj)
    return state


def apply(objects: Mapping[str, Any], state: Mapping[str, Any], strategy: Any) -> None:
    """Puts the loaded ``state`` back into every object (every worker calls it)."""

    modules = _prepare(objects, strategy)
    with sharded_state_dicts():
        for name, obj in objects.items():
            if isinstance(obj, nn.Module):
                obj.load_state_dict(state[name])
            elif isinstance(obj, torch.optim.Optimizer):
                set_optimizer_state_dict(_model_of(obj, modules, name), obj, state[name])
            else:
                load_into(obj, state[name], name)


def writes_sharded(model: Any, filepath: str) -> bool:
    """Whether a save of ``model`` to ``filepath`` writes a sharded folder: the path ends in
    ``.dcp``, or the model is sharded (FullyShardedStrategy: each worker writes its part, and
    no worker gathers the whole model). A ``.safetensors`` path is written by every worker
    alike (each its own rows; the chief what no worker shards)."""
    module = getattr(model, "module", None)  # a callback may be given any model-like object
    sharded = isinstance(module, nn.Module) and is_sharded({"model": module})
    return str(filepath).endswith((SUFFIX, SAFETENSORS_SUFFIX)) or sharded
