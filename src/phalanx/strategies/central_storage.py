"""CentralStorageStrategy: variables live once, compute is replicated.

TF: tf.distribute.experimental.CentralStorageStrategy.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.communication.local.cross_device_ops import CrossDeviceOps
from phalanx.communication.local.packing import unpack
from phalanx.devices import canonical_name, torch_device
from phalanx.strategies.mirrored import default_devices
from phalanx.strategies.replicas.rendezvous import ReplicaRendezvous
from phalanx.strategies.replicas.variable_policy import VariablePolicy
from phalanx.strategies.strategy import DEFAULT_TIMEOUT_SECONDS, Strategy
from phalanx.variables import (
    _GRAD_SET,
    _REQUIRES_GRAD_SET,
    AGGREGATION_MARK,
    DistributedVariable,
    MirroredVariable,
    VariableAggregation,
    in_optimizer_step,
)

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["CentralStoragePolicy", "CentralStorageStrategy"]


class CentralVariable(MirroredVariable):
    """A variable stored once on the parameter device; each replica computes with a view or copy.

    Replicas read their compute leaf (an alias of the central storage on the same device,
    else a copy refreshed after every step); inside ``optimizer.step()`` replica 0 updates
    the central storage itself and the other replicas see no gradient.
    """

    def __init__(
        self,
        primary: torch.Tensor,
        strategy: DistributionStrategy,
        aggregation: VariableAggregation = VariableAggregation.NONE,
        is_parameter: bool = True,
    ) -> None:
        super().__init__(primary, strategy, aggregation, is_parameter)
        self._compute: list[torch.Tensor] = []  # one leaf per local replica, once materialised

    def resolve(self, replica: tuple[Any, int] | None) -> torch.Tensor:
        if replica is not None and replica[0] is self._strategy:
            if replica[1] == 0 and in_optimizer_step():
                return self._components[0]
            return self._compute[replica[1]]
        return self._components[0]

    def replica_leaf(self, index: int) -> torch.Tensor:
        return self._compute[index]

    def holds(self, tensor: Any) -> bool:
        """Whether ``tensor`` is the central storage or one of the compute leaves."""
        return super().holds(tensor) or any(tensor is leaf for leaf in self._compute)

    @property
    def has_compute_leaves(self) -> bool:
        """Whether the replicas' compute leaves were made (`make_compute_leaves`)."""
        return bool(self._compute)

    def make_compute_leaves(self, devices: Sequence[torch.device]) -> None:
        """Makes one compute leaf per replica device: an alias of the central storage on its
        own device, else a copy (called by `CentralStoragePolicy.materialize`)."""
        self._compute = [_compute_leaf(self.primary, d) for d in devices]

    def refresh(self, indices: Iterable[int]) -> None:
        """Copies the central storage into the compute leaves ``indices`` that are copies
        (after an update or a cross-replica write)."""
        central = self.primary
        with torch.no_grad():
            for i in indices:
                leaf = self._compute[i]
                if leaf.data_ptr() != central.data_ptr():
                    leaf.copy_(central)

    def _cross_replica_call(
        self, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
    ) -> Any:
        if func in (_GRAD_SET, _REQUIRES_GRAD_SET):
            # Gradients accumulate on the compute leaves: `zero_grad()` or freezing outside
            # `run` must reach them too, not only the central storage.
            for leaf in self._compute:
                func(leaf, *args[1:])
        return super()._cross_replica_call(func, args, kwargs)


class CentralStoragePolicy(VariablePolicy):
    """CentralStorage's variable policy: each parameter is stored once, on the parameter device.

    Replicas compute with `CentralVariable` leaves (aliases of the storage on its device,
    else copies); the summed gradient goes to the storage only, replica 0's optimizer step
    updates it, and the other replicas refresh their copies after that step. Buffers stay
    per replica, as in the mirrored policy.

    Args:
        strategy: The strategy the variables belong to.
        rendezvous: Where its local replicas meet.
        cross_device_ops: How the replicas' values are summed.
        parameter_device: Where the parameters are stored.
    """

    def __init__(
        self,
        strategy: Strategy,
        rendezvous: ReplicaRendezvous,
        cross_device_ops: CrossDeviceOps,
        parameter_device: torch.device,
    ) -> None:
        super().__init__(strategy, rendezvous, cross_device_ops)
        self.parameter_device = parameter_device

    def create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        """A `CentralVariable` stored on the parameter device (None: already distributed)."""
        if isinstance(param, DistributedVariable):
            return None
        central = param.detach().to(self.parameter_device).requires_grad_(param.requires_grad)
        aggregation = getattr(param, AGGREGATION_MARK, VariableAggregation.NONE)
        return self.register(CentralVariable(central, self.strategy, aggregation, is_parameter=True))

    _materialize_every_run = True  # a central variable's compute leaves are built apart

    def materialize(self, var: DistributedVariable) -> None:
        """Makes the compute leaves of a central variable, or refreshes them after a
        cross-replica write; other variables as mirrored."""
        if not isinstance(var, CentralVariable):
            super().materialize(var)
            return
        if not var.has_compute_leaves:
            var.make_compute_leaves(self.strategy.local_devices)
        elif var.dirty:
            var.refresh(range(self.strategy.num_local_replicas))
        var.mark_clean()

    def install_gradients(
        self,
        params: list[DistributedVariable],
        reduced: dict[torch.dtype, torch.Tensor],
        all_none: list[bool],
        index: int,
        spec: Any,
    ) -> None:
        """Replica 0 gives the sums to the central storage; the other replicas no gradient."""
        if index != 0:
            for p in params:
                p.replica_leaf(index).grad = None
            return
        mine = {dtype: buf.to(self.parameter_device) for dtype, buf in reduced.items()}
        for p, view, none in zip(params, unpack(mine, spec), all_none, strict=True):
            target = p.primary if isinstance(p, CentralVariable) else p.replica_leaf(0)
            target.grad = None if none else view

    def install_summed_in_place(
        self, params: list[DistributedVariable], all_none: list[bool], index: int
    ) -> None:
        """Replica 0 moves its (already total) gradients to the central storage."""
        for p, none in zip(params, all_none, strict=True):
            leaf = p.replica_leaf(index)
            if index == 0 and isinstance(p, CentralVariable):
                central = p.primary
                grad = leaf.grad
                central.grad = None if none or grad is None else grad.to(central.device)
            if index != 0 or none:
                leaf.grad = None

    def _write_merged_once(
        self, var: DistributedVariable, func: Callable[..., Any], merged: torch.Tensor
    ) -> bool:
        if not isinstance(var, CentralVariable):
            return False
        central = var.primary
        with torch.no_grad():
            func(central, merged.to(central.device))
        if var.has_compute_leaves:
            var.refresh(range(self.strategy.num_local_replicas))
        return True

    def after_optimizer_step(self, index: int) -> None:
        """Replicas wait for replica 0's update of the central variables, then refresh their
        copies (every replica; blocks until all arrive)."""
        self._rendezvous.exchange(index, None, what="the end of optimizer.step()")
        for ref in self._variables:  # not self.variables(): a generator costs more per step
            var = ref()
            if isinstance(var, CentralVariable) and var.has_compute_leaves:
                var.refresh((index,))


def _compute_leaf(central: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Same device: share storage, so replicas see every update at once.
    leaf = central.detach() if device == central.device else central.detach().to(device, copy=True)
    return leaf.requires_grad_(central.requires_grad)


class CentralStorageStrategy(Strategy):
    """Keeps one copy of each variable on the parameter device and replicates computation.

    Gradients of all replicas are summed onto the parameter device and the update is applied
    once, by replica 0's optimizer step; replicas wait for it before they read the variables
    again (see `CentralStoragePolicy`).

    Args:
        compute_devices: The replicas' devices (default: all GPUs, else one CPU replica).
        parameter_device: Where variables live (default: the compute device if there is
            one, else the CPU).
        timeout_seconds: How long a replica waits for the others at a meeting point.
        sync_batch_norm: Batch-norm layers registered in ``scope()`` become
            `phalanx.nn.SyncBatchNorm` (global-batch statistics), as in `MirroredStrategy`.
    """

    def __init__(
        self,
        compute_devices: Sequence[str | torch.device] | None = None,
        parameter_device: str | torch.device | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        sync_batch_norm: bool = False,
    ) -> None:
        devices = list(compute_devices) if compute_devices is not None else default_devices()
        if parameter_device is None:
            parameter_device = devices[0] if len(devices) == 1 else "cpu:0"
        # Read by _make_variable_policy, which Strategy.__init__ calls.
        self._parameter_device = torch_device(canonical_name(parameter_device))
        super().__init__(devices, None, timeout_seconds)
        self._sync_batch_norm = sync_batch_norm

    def _parameter_devices(self) -> tuple[str, ...]:
        return (canonical_name(self._parameter_device),)

    def _make_variable_policy(self) -> VariablePolicy:
        return CentralStoragePolicy(self, self._rendezvous, self._cross_device_ops, self._parameter_device)

    def __repr__(self) -> str:
        return (
            f"CentralStorageStrategy(compute_devices={list(self._device_names)}, "
            f"parameter_device={str(self._parameter_device)!r})"
        )
