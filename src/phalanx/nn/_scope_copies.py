"""Copies (``copy.deepcopy``) of modules made in a strategy's scope, and naming a parameter
that an optimizer holds but the strategy never made.

* `mark_made_in_scope`: the hooks (`phalanx._hooks`) mark every module that registers a tensor
  in a strategy's scope, and remember which plain tensors the strategy kept as they were.
* `register_copies`: when a module is registered as a submodule in the scope, the copies in
  it (``nn.TransformerEncoder``'s ``_get_clones`` deep-copies its layer) get their new plain
  tensors made by the strategy, like the original's (a plain parameter tracked by
  MultiWorkerMirrored's gradient buckets, ...). Distributed variables copy themselves into
  variables (`phalanx.variables.DistributedVariable.__deepcopy__`).
* `describe_foreign`: which parameter (its path in the live modules) and why it is not the
  strategy's, for the optimizer-step errors.
"""

from __future__ import annotations

import gc
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx import _hooks
from phalanx.variables import COPY_MARK, DistributedVariable

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["describe_foreign", "mark_made_in_scope", "register_copies"]

_SCOPE_MARK = "_phalanx_scope"  # module.__dict__ key: id() of the strategy it was made in
# Plain tensors the strategies' hooks already saw (originals, not copies), by id: a mark in the
# tensor's __dict__ would travel with torch's deepcopy of it. Pruned as it grows.
_seen: dict[int, weakref.ref[torch.Tensor]] = {}


def mark_made_in_scope(module: nn.Module, strategy: DistributionStrategy, tensor: Any) -> None:
    """Remembers that ``module`` registered ``tensor`` in ``strategy``'s scope.

    Called by the registration hooks in cross-replica context. A deep copy of the module
    carries the mark; its new tensors are not in `_seen` (see `register_copies`).
    """
    module.__dict__[_SCOPE_MARK] = id(strategy)
    if tensor is not None and not isinstance(tensor, DistributedVariable):
        if len(_seen) >= 1024 and len(_seen) & (len(_seen) - 1) == 0:  # prune at powers of two
            for key in [k for k, ref in _seen.items() if ref() is None]:
                del _seen[key]
        _seen[id(tensor)] = weakref.ref(tensor)


def register_copies(submodule: nn.Module, strategy: DistributionStrategy) -> None:
    """Registers again, in ``strategy``'s scope, the tensors of copies of modules made there.

    Called by the submodule-registration hook in the scope (cross-replica context). A module
    copied with ``copy.deepcopy`` keeps its scope mark but holds new plain tensors (torch's
    ``Parameter.__deepcopy__``): registering them again lets the strategy's hooks make them,
    as for the original. Tensors the hooks saw and distributed variables are left alone.
    """
    for module in submodule.modules():
        if module.__dict__.get(_SCOPE_MARK) != id(strategy):
            continue
        for name, tensor in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            if _is_unseen_copy(tensor):
                module.register_parameter(name, tensor)
        transient = _hooks.non_persistent_buffer_names(module)
        for name, buffer in list(module.named_buffers(recurse=False, remove_duplicate=False)):
            if _is_unseen_copy(buffer):
                module.register_buffer(name, buffer, persistent=name not in transient)


def _is_unseen_copy(tensor: Any) -> bool:
    if tensor is None or isinstance(tensor, DistributedVariable):
        return False
    ref = _seen.get(id(tensor))
    return ref is None or ref() is not tensor


def describe_foreign(param: torch.Tensor, owner: object) -> str:
    """Names a parameter an optimizer holds that is not ``owner``'s, and says why.

    Only for error messages: it searches the live modules (``gc``) for the parameter's path.
    """
    return f"{_describe(param)}, which was not created in this strategy's scope: {_why(param, owner)}"


def _why(param: torch.Tensor, owner: object) -> str:
    if isinstance(param, DistributedVariable):
        return f"it was made in the scope of another strategy, {param.strategy!r}"
    copied_from = param.__dict__.get(COPY_MARK)
    if copied_from is not None:
        return f"it was copied (copy.deepcopy) outside the scope from a variable of {copied_from}"
    if any(module.__dict__.get(_SCOPE_MARK) == id(owner) for module, _ in _holders(param)):
        return (
            "it belongs to a copy (copy.deepcopy) of a module made in the scope, and the copy was "
            "not registered as a submodule in the scope, so the strategy never made its tensors"
        )
    return "it was made outside the scope"


def _describe(tensor: torch.Tensor) -> str:
    path = _path_of(tensor)
    shape = tuple(tensor.shape)
    return f"`{path}` (shape {shape})" if path else f"a parameter of shape {shape} held by no live module"


def _live_modules() -> list[nn.Module]:
    # type(), not isinstance: isinstance reads __class__, which warns on some torch objects
    return [m for m in gc.get_objects() if issubclass(type(m), nn.Module)]


def _holders(tensor: torch.Tensor) -> list[tuple[nn.Module, str]]:
    found = []
    for module in _live_modules():
        for attribute in ("_parameters", "_buffers"):
            for name, value in module.__dict__.get(attribute, {}).items():
                if value is tensor:
                    found.append((module, name))
    return found


def _path_of(tensor: torch.Tensor) -> str | None:
    """``0.layers.1.linear1.weight``: the path from the outermost live module holding it."""
    holders = _holders(tensor)
    if not holders:
        return None
    parents: dict[int, tuple[nn.Module, str]] = {}
    for module in _live_modules():
        for name, child in module.__dict__.get("_modules", {}).items():
            if child is not None:
                parents.setdefault(id(child), (module, name))
    module, name = holders[0]
    parts = [name]
    visited = {id(module)}
    while id(module) in parents:
        module, child_name = parents[id(module)]
        if id(module) in visited:
            break
        visited.add(id(module))
        parts.append(child_name)
    return ".".join(reversed(parts))
