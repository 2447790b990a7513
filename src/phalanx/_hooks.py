"""The global torch hooks through which strategies see modules and optimizers.

See docs/architecture.md, "Distributed variables" and "The optimizer step".

Installed once, the first time any strategy scope is entered (never at import). Each hook
asks the strategy current on *this thread*; outside a scope it changes nothing.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from phalanx import context
from phalanx.variables import DistributedVariable

__all__ = ["install"]

_lock = threading.Lock()
_installed = False


def install() -> None:
    """Installs the hooks (idempotent, thread-safe)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        register_module_parameter_registration_hook(_on_parameter)
        register_module_buffer_registration_hook(_on_buffer)
        register_module_module_registration_hook(_on_submodule)
        register_optimizer_step_pre_hook(_before_step)
        register_optimizer_step_post_hook(_after_step)
        _installed = True
    if os.environ.get("PHALANX_TIMELINE"):  # opt-in tracing starts with the first scope
        from phalanx import timeline

        timeline.start()


def _on_parameter(module: torch.nn.Module, name: str, param: Any) -> Any:
    frame = context._top()
    if param is None or frame is None or frame.replica_context is not None:
        return None
    made = frame.strategy._create_parameter(module, name, param)
    _made_in_scope(module, "_parameters", frame.strategy, param if made is None else made)
    return made


def _on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> Any:
    frame = context._top()
    if buffer is None or frame is None:
        return None
    if frame.replica_context is None:
        made = frame.strategy._create_buffer(module, name, buffer)
        _made_in_scope(module, "_buffers", frame.strategy, buffer if made is None else made)
        return made
    # A module re-assigning its buffer inside `run` (self.buf = new): keep the distributed
    # variable and write the new value into this replica's component.
    return frame.strategy.variable_policy.reassign_buffer(module, name, buffer, frame.replica_context)


def _made_in_scope(module: torch.nn.Module, attribute: str, strategy: Any, tensor: Any) -> None:
    """Marks a module that registered ``tensor`` in a strategy's scope (copies of it are
    recognised when they are registered, see `_on_submodule`); a module holding a distributed
    variable reads it as the replica's plain component inside ``run``."""
    if strategy._is_default:
        return
    from phalanx.nn import _module_tensors, _scope_copies

    _scope_copies.mark_made_in_scope(module, strategy, tensor)
    if isinstance(tensor, DistributedVariable):
        _module_tensors.serve_plain_components(module, attribute)


def _on_submodule(module: torch.nn.Module, name: str, submodule: Any) -> Any:
    frame = context._top()
    if frame is None or submodule is None or frame.strategy._is_default:
        return None
    from phalanx.nn.dropout import attach_keyed_dropout

    attach_keyed_dropout(submodule)
    if frame.replica_context is not None:
        return None
    from phalanx.nn import _scope_copies

    # deep copies of modules made in the scope (nn.TransformerEncoder's clones)
    _scope_copies.register_copies(submodule, frame.strategy)
    replacement = None
    if frame.strategy._sync_batch_norm:
        from phalanx.nn.sync_batch_norm import converted_in_scope

        replacement = converted_in_scope(submodule)  # None: not a batch-norm layer, keep it
    frame.strategy._note_submodule(module, submodule if replacement is None else replacement)
    return replacement


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context._state.replica
    if replica is not None:
        replica[0]._step_sync.before_step(optimizer, replica[1])
        return
    frame = context._top()
    if frame is not None:
        frame.strategy._step_outside_run(optimizer)
    from phalanx.strategies._optimizer_state import PerReplicaState

    if isinstance(optimizer.state, PerReplicaState):
        strategy = optimizer.state.owner
        raise RuntimeError(
            f"optimizer.step() was called outside {strategy!r}.run, but this optimizer keeps "
            "one state per replica (it stepped inside run before): stepping here would update "
            "replica 0's state only and the replicas would drift apart. HINT: call "
            "optimizer.step() inside strategy.run, as the training step does."
        )


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context._state.replica
    if replica is not None:
        replica[0]._step_sync.after_step(optimizer, replica[1])
        guard = context._state.write_guard
        if guard is not None:
            guard.snapshot()  # the step wrote the components: its writes are the allowed ones
