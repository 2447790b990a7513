"""Optimizer state on the chief: it lives on the ps tasks, next to the variables it updates.

The first time a scheduled function carries an optimizer, the chief adopts it: the state it
holds (a checkpoint loaded before training) moves to the ps tasks, and from then on its
``state_dict()`` reads the ps tasks' state and ``load_state_dict()`` writes it there. A
sharded variable's state is cut into the shards' rows and joined back the same way.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from phalanx.ps import sharding
from phalanx.ps.coordinator.local_copies import LocalCopies
from phalanx.ps.messages import hyperparameters, optimizer_key
from phalanx.ps.variables import PSClient, VariableHandle

__all__ = ["OptimizerStates"]

_all_states: weakref.WeakSet[OptimizerStates] = weakref.WeakSet()
_adopted: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()  # by any chief, once each


class OptimizerStates:
    """Keeps the state of the chief's optimizers on the ps tasks. Thread-safe.

    Args:
        ps: The client of the ps tasks.
        copies: The chief's variables (an optimizer must hold only these).
    """

    def __init__(self, ps: PSClient, copies: LocalCopies) -> None:
        self._ps, self._copies = ps, copies
        self._lock = threading.RLock()
        _all_states.add(self)

    def owns(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` trains the chief's variables."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return bool(params) and self._copies.handle_of(params[0]) is not None

    def _key(self, optimizer: torch.optim.Optimizer) -> tuple[str, list[list[VariableHandle]]]:
        groups = []
        for group in optimizer.param_groups:
            handles = []
            for p in group["params"]:
                handle = self._copies.handle_of(p)
                if handle is None:
                    raise ValueError(
                        "An optimizer used in a scheduled function holds a tensor that was not created in "
                        f"strategy.scope() (shape {tuple(p.shape)}). HINT: create the model in the scope."
                    )
                handles.append(handle)
            groups.append(handles)
        return optimizer_key(optimizer, groups), groups

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """First sight of an optimizer a scheduled function uses (once per optimizer): its
        state moves to the ps tasks, and its ``state_dict`` / ``load_state_dict`` read and
        write the ps tasks' state from now on.

        Raises:
            ValueError: It holds a tensor not created in ``strategy.scope()``.
        """
        with self._lock:
            if optimizer in _adopted:
                return
            _adopted.add(optimizer)
            if optimizer.state:
                self.push(optimizer)
            optimizer.register_state_dict_post_hook(_state_from_ps)
            optimizer.register_load_state_dict_post_hook(_state_to_ps)

    @staticmethod
    def adopted(optimizer: torch.optim.Optimizer) -> bool:
        """Whether `adopt` took ``optimizer`` already (its state lives on the ps tasks)."""
        return optimizer in _adopted

    def push(self, optimizer: torch.optim.Optimizer) -> None:
        """Writes ``optimizer``'s state to the ps tasks and clears it here (functions must not
        carry it)."""
        key, groups = self._key(optimizer)
        hyper = [hyperparameters(g) for g in optimizer.param_groups]
        self._ps.create_optimizer(key, type(optimizer), list(zip(groups, hyper, strict=True)))
        states: list[dict[str, Any]] = [{"state": {}, "groups": hyper} for _ in range(self._ps.num_ps)]
        for group, handles in zip(optimizer.param_groups, groups, strict=True):
            for p, handle in zip(group["params"], handles, strict=True):
                if p in optimizer.state:
                    state = dict(optimizer.state[p])
                    parts = sharding.split_state(handle, state) if handle.shards else [state]
                    for shard, part in zip(handle.physical(), parts, strict=True):
                        states[shard.ps]["state"][shard.name] = part
        self._ps.load_optimizer_state(key, states)
        optimizer.state.clear()

    def pull(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Fills ``state_dict["state"]`` (torch's layout) from the ps tasks' state; nothing
        if the optimizer never stepped."""
        key, groups = self._key(optimizer)
        try:
            per_ps = self._ps.optimizer_state(key)
        except Exception as exc:
            if "KeyError" not in f"{type(exc).__name__} {exc}":
                raise
            return  # it never stepped: no state yet
        index = 0
        for handles in groups:
            for handle in handles:
                parts = [per_ps[p.ps]["state"].get(p.name) or {} for p in handle.physical()]
                entry = sharding.join_state(handle, parts) if handle.shards else parts[0]
                if entry:
                    state_dict["state"][index] = entry
                index += 1


# ---------------------------------------------------------------------- optimizer hooks
def _owner(optimizer: torch.optim.Optimizer) -> OptimizerStates | None:
    return next((states for states in list(_all_states) if states.owns(optimizer)), None)


def _state_from_ps(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    states = _owner(optimizer)
    if states is not None:
        states.pull(optimizer, state_dict)
    return state_dict


def _state_to_ps(optimizer: torch.optim.Optimizer) -> None:
    states = _owner(optimizer)
    if states is not None and optimizer.state:
        states.push(optimizer)
