"""How modules made in a strategy's scope hold their distributed variables inside a replica.

* `ReplicaTensors`: the ``_parameters``/``_buffers`` dict of a module whose tensors are
  distributed variables. ``nn.Module.__getattr__`` reads ``self._parameters[name]``, so inside
  a replica ``self.weight`` is that replica's *plain* component: no per-op Python dispatch
  (``DistributedVariable.__torch_function__``), and torch's fused kernels
  (``nn.MultiheadAttention``'s fast path) run exactly as on one device. The same aten ops run
  on the same tensors, so the numbers do not change. ``named_parameters()``, ``state_dict()``,
  ``.to()`` and the optimizer iterate the dict's items and still see the variables.
* `ReplicaWriteGuard`: an in-place write of a mirrored parameter inside ``run`` needs an
  aggregation (the replicas would differ); through a plain component the variable cannot
  see the write, so the guard compares version counters when the replica's function ends.
"""

from __future__ import annotations

import copy
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from phalanx import _hooks, context
from phalanx.variables import DistributedVariable, MirroredVariable

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["ReplicaBuffers", "ReplicaTensors", "ReplicaWriteGuard", "serve_plain_components"]


class ReplicaTensors(dict):  # type: ignore[type-arg]
    """A module's tensor dict that gives a replica its plain component (module docstring).

    Outside a replica, and for variables that merge their writes (aggregated mirrored
    variables), ``d[name]`` is the variable itself, as in a plain dict.
    """

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        value = dict.__getitem__(self, key)
        replica = context.current_replica()
        if (
            replica is not None
            and isinstance(value, DistributedVariable)
            and value.plain_in_replica
            and value.strategy is replica[0]
        ):
            return value.resolve(replica)
        return value

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (dict, (dict(self),))  # pickles (torch.save of a module) as a plain dict

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        copied = {key: copy.deepcopy(value, memo) for key, value in dict.items(self)}
        if any(isinstance(value, DistributedVariable) for value in copied.values()):
            return ReplicaTensors(copied)
        return copied  # copies outside the scope: plain tensors in a plain dict


class ReplicaBuffers(ReplicaTensors):
    """`ReplicaTensors` for ``_buffers``: a plain tensor stored over a distributed buffer in
    cross-replica context is written into the variable (TF's ``assign``) rather than replacing
    it. ``Module._apply`` (``model.double()``, ``.to()``) stores converted buffers with
    ``_buffers[name] = fn(buffer)``, past the registration hooks: without this, every replica
    would share (and race on) one plain tensor.
    """

    __slots__ = ()

    def __setitem__(self, key: str, value: Any) -> None:
        old = dict.get(self, key)
        if (
            isinstance(old, DistributedVariable)
            and isinstance(value, torch.Tensor)
            and not isinstance(value, DistributedVariable)
            and context.current_replica() is None
        ):
            with torch.no_grad():
                old.data = value  # Mirrored: the primary, re-mirrored; SyncOnRead: the aggregate
            value = old
        dict.__setitem__(self, key, value)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[str, Any]:
        copied = ReplicaTensors.__deepcopy__(self, memo)
        return ReplicaBuffers(copied) if type(copied) is ReplicaTensors else copied


def serve_plain_components(module: nn.Module, attribute: str) -> None:
    """Makes ``module._parameters`` a `ReplicaTensors`, ``module._buffers`` a `ReplicaBuffers`
    (idempotent).

    Not for recurrent layers: `nn.RNNBase` caches its weights in ``_flat_weights``, a list
    shared by every replica thread, and rebuilds it whenever ``getattr`` returns another tensor
    — a replica's plain component would overwrite the list under the other replicas (they
    would compute with its weights and their gradients would land on its leaves). Their
    weights keep the variables' per-op dispatch, which resolves each replica's component.
    """
    if isinstance(module, nn.RNNBase):
        return
    tensors = module.__dict__.get(attribute)
    kind = ReplicaBuffers if attribute == "_buffers" else ReplicaTensors
    if tensors is not None and type(tensors) is not kind:
        module.__dict__[attribute] = kind(tensors)


class ReplicaWriteGuard:
    """Notices in-place writes a replica makes to its plain mirrored components (not in the
    optimizer step), which would make the replicas differ, and raises as the variable would.

    Made when a replica frame is entered; `snapshot` again after each optimizer step
    (`phalanx._hooks`); `check` when the replica's function returns.

    Args:
        strategy: The strategy whose replica runs.
        index: The local replica index.
    """

    __slots__ = ("_index", "_leaves", "_strategy", "_vars", "_versions")

    def __init__(self, strategy: DistributionStrategy, index: int) -> None:
        self._strategy = strategy
        self._index = index
        self._vars, self._leaves = _plain_leaves(strategy, index)
        self._versions: list[int] = []
        self.snapshot()

    def snapshot(self) -> None:
        """Records the version of every plain mirrored component of this replica."""
        self._versions = [_hooks.tensor_version(leaf) for leaf in self._leaves]

    def check(self) -> None:
        """Raises if a component changed since the last snapshot.

        Raises:
            RuntimeError: This replica wrote a mirrored parameter without aggregation.
        """
        for var, leaf, version in zip(self._vars, self._leaves, self._versions, strict=True):
            if _hooks.tensor_version(leaf) != version:
                raise RuntimeError(
                    "In a replica context, an in-place write on a MirroredVariable needs an "
                    "aggregation to keep the replicas equal, and this variable has none. Received: "
                    f"a write to {_describe(var)} in replica {self._index}, outside "
                    "optimizer.step(). HINT: annotate it with "
                    "phalanx.variables.set_aggregation(tensor, 'mean') before the module registers "
                    "it, or write it outside strategy.run (cross-replica context)."
                )


# per strategy: replica index -> (policy generation, weak references to the variables
# and to their plain components: the cache must not keep a dropped model alive)
_Weak = tuple[list[weakref.ref[DistributedVariable]], list[weakref.ref[torch.Tensor]]]
_plain_leaves_cache: weakref.WeakKeyDictionary[Any, dict[int, tuple[int, _Weak]]] = (
    weakref.WeakKeyDictionary()
)


def _plain_leaves(
    strategy: DistributionStrategy, index: int
) -> tuple[list[DistributedVariable], list[torch.Tensor]]:
    """The mirrored variables replica ``index`` reads as plain components, and those
    components; the walk over every variable is cached until the policy's variables or
    components change (every step enters a replica frame: the walk cost ~1 us a variable)."""
    policy = strategy.variable_policy
    per_replica = _plain_leaves_cache.setdefault(strategy, {})
    cached = per_replica.get(index)
    if cached is None or cached[0] != policy.generation:
        weak: _Weak = ([], [])
        for var in policy.variables():
            if isinstance(var, MirroredVariable) and var.plain_in_replica:
                try:
                    leaf = var.replica_leaf(index)
                except (IndexError, AttributeError):  # not materialised: no replica read it
                    continue
                weak[0].append(weakref.ref(var))
                weak[1].append(weakref.ref(leaf))
        cached = per_replica[index] = (policy.generation, weak)
    variables, leaves = [], []
    for var_ref, leaf_ref in zip(*cached[1], strict=True):
        live_var, live_leaf = var_ref(), leaf_ref()
        if live_var is not None and live_leaf is not None:
            variables.append(live_var)
            leaves.append(live_leaf)
    return variables, leaves


def _describe(var: DistributedVariable) -> str:
    from phalanx.nn._scope_copies import _describe as describe  # error path only

    return describe(var)
