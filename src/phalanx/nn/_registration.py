"""What happens to a module that registers a tensor or a submodule in a strategy's scope.

`phalanx._hooks` hands each registration to the current strategy
(`Strategy.parameter_registered` and its siblings, through the hooks ``_made_in_scope`` and
``_registered_submodule``), which calls these functions (the default strategy does not):
copies of scope-made modules are recognised, modules holding distributed variables read their
replica's plain components inside ``run``, dropout is keyed per example and batch-norm layers
may become `SyncBatchNorm`.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.nn import _module_tensors, _scope_copies
from phalanx.nn.dropout import attach_keyed_dropout
from phalanx.nn.sync_batch_norm import converted_in_scope
from phalanx.variables import DistributedVariable

__all__ = ["made_in_scope", "registered_submodule"]


def made_in_scope(module: torch.nn.Module, attribute: str, strategy: Any, tensor: Any) -> None:
    """Marks a module that registered ``tensor`` in ``strategy``'s scope (copies of it are
    recognised when they are registered, see `registered_submodule`); a module holding a
    distributed variable reads it as the replica's plain component inside ``run``."""
    _scope_copies.mark_made_in_scope(module, strategy, tensor)
    if isinstance(tensor, DistributedVariable):
        _module_tensors.serve_plain_components(module, attribute)


def registered_submodule(
    submodule: torch.nn.Module, strategy: Any, in_replica: bool, sync_batch_norm: bool
) -> Any:
    """What replaces ``submodule``, registered in ``strategy``'s scope (None: keep it).

    Dropout layers draw replica-count-invariant masks; outside ``run``, deep copies of modules
    made in the scope (``nn.TransformerEncoder``'s clones) are registered as the originals
    were, and with ``sync_batch_norm`` a batch-norm layer becomes a `SyncBatchNorm`.
    """
    attach_keyed_dropout(submodule)
    if in_replica:
        return None
    _scope_copies.register_copies(submodule, strategy)
    if sync_batch_norm:
        return converted_in_scope(submodule)  # None: not a batch-norm layer, keep it
    return None
