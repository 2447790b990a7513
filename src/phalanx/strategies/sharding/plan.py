"""Which modules of a model become FSDP2 units, from what the strategy saw in its scope.

FullyShardedStrategy learns a model the way every strategy does, through the registration
hooks (`phalanx._hooks`): each parameter with the module that registered it, and each
submodule with its parent. `ShardingPlan` keeps that (weakly) and, before the first step,
answers "which modules, children before parents, get ``fully_shard``": every module that registers
parameters of its own is a unit (one layer gathered at a time: the least memory), unless a
module above it registers parameters too (that one's forward may read its children's
parameters directly, as ``nn.MultiheadAttention`` reads its ``out_proj``'s: they are
gathered together); the model (the top module) is the root unit and takes what no unit
took. A parameter registered by two modules (tied weights, GPT-2's embedding and head)
goes to the root with every module on the way, since FSDP2 needs a shared parameter inside
one unit. A model whose forward reads the parameters of a module that is not its ancestor
otherwise needs MultiWorkerMirroredStrategy (FSDP2 gathers a unit's parameters only for
its own forward).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

__all__ = ["ShardingPlan"]


class ShardingPlan:
    """The modules and parameters made in one strategy's scope, not sharded yet."""

    def __init__(self) -> None:
        self._parents: weakref.WeakKeyDictionary[nn.Module, weakref.ref[nn.Module]] = (
            weakref.WeakKeyDictionary()
        )
        # id(param) -> (the parameter, the modules that registered it)
        self._owners: dict[int, tuple[weakref.ref[torch.Tensor], list[weakref.ref[nn.Module]]]] = {}

    def note_parameter(self, module: nn.Module, param: torch.Tensor) -> None:
        """Records that ``module`` registered ``param`` (again for a tied weight)."""
        entry = self._owners.get(id(param))
        if entry is None or entry[0]() is not param:
            entry = (weakref.ref(param), [])
            self._owners[id(param)] = entry
        if all(ref() is not module for ref in entry[1]):
            entry[1].append(weakref.ref(module))

    def note_submodule(self, parent: nn.Module, child: nn.Module) -> None:
        """Records that ``parent`` holds ``child`` (the last parent wins)."""
        if child is not parent:
            self._parents[child] = weakref.ref(parent)

    def knows(self, param: torch.Tensor) -> bool:
        """Whether ``param`` was registered in the scope and is not sharded yet."""
        entry = self._owners.get(id(param))
        return entry is not None and entry[0]() is param

    @property
    def pending(self) -> bool:
        """Whether parameters wait to be sharded."""
        return any(entry[0]() is not None for entry in self._owners.values())

    def roots(self) -> list[nn.Module]:
        """The top modules of what waits to be sharded (ModelParallelStrategy checks their layouts)."""
        owners, _ = self._live_owners()
        return list({id(r): r for r in (self.root_of(m) for m in owners.values())}.values())

    def root_of(self, module: nn.Module) -> nn.Module:
        """The top module above ``module`` (itself if it has no recorded parent)."""
        seen = {id(module)}
        while (ref := self._parents.get(module)) is not None and (parent := ref()) is not None:
            if id(parent) in seen:  # a module registered inside its own child: stop
                break
            seen.add(id(parent))
            module = parent
        return module

    def _ancestors(self, module: nn.Module) -> Iterator[nn.Module]:
        seen = {id(module)}
        while (ref := self._parents.get(module)) is not None and (parent := ref()) is not None:
            if id(parent) in seen:
                return
            seen.add(id(parent))
            yield parent
            module = parent

    def _link_subtrees(self, owners: Iterable[nn.Module]) -> None:
        """Records the parent of every module under a top module as the tree is now: a deep
        copy (``nn.TransformerEncoder``'s layers) holds submodules no hook saw registered."""
        known = {id(m): m for m in owners}
        for child, ref in list(self._parents.items()):
            parent = ref()
            known[id(child)] = child
            if parent is not None:
                known[id(parent)] = parent
        for top in [m for m in known.values() if self._parents.get(m) is None]:
            for parent in top.modules():
                for child in parent.children():
                    self._parents[child] = weakref.ref(parent)

    def _live_owners(self) -> tuple[dict[int, nn.Module], list[list[nn.Module]]]:
        """The live modules that registered parameters, by id, and the groups of modules
        that registered one parameter together (tied weights)."""
        owners: dict[int, nn.Module] = {}
        tied: list[list[nn.Module]] = []
        for ref, modules in self._owners.values():
            live = [m for m in (r() for r in modules) if m is not None]
            if ref() is None or not live:
                continue
            owners.update((id(m), m) for m in live)
            if len(live) > 1:
                tied.append(live)
        return owners, tied

    def take(self) -> dict[nn.Module, list[nn.Module]]:
        """Every root with its units, children before parents (the root last), and forgets them.

        Returns:
            ``{root: [unit, ..., root]}``: ``fully_shard`` each in order.
        """
        owners, tied = self._live_owners()
        self._owners = {}
        self._link_subtrees(owners.values())
        excluded: set[int] = set()
        for module in (m for group in tied for m in group):  # a tied parameter belongs to the root
            excluded.add(id(module))
            excluded.update(id(a) for a in self._ancestors(module))
        for module in owners.values():  # MultiheadAttention reads its out_proj's weight itself
            if any(id(a) in owners for a in self._ancestors(module)):
                excluded.add(id(module))
        roots = {id(r): r for r in (self.root_of(m) for m in owners.values())}
        plan: dict[nn.Module, list[nn.Module]] = {}
        for root in roots.values():  # children before parents, siblings in registration order:
            units = [m for m in _post_order(root, set()) if id(m) in owners and id(m) not in excluded]
            # the order modules built on a device initialise in (_meta_init)
            plan[root] = [m for m in units if m is not root] + [root]
        return plan


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    """Every module under ``module`` once, children (in registration order) before parents."""
    seen.add(id(module))
    for child in module.children():
        if id(child) not in seen:
            yield from _post_order(child, seen)
    yield module
