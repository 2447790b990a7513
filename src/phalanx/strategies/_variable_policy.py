# mypy: disable-error-code="misc"
# (methods type `self` as the Strategy they are mixed into, which mypy cannot prove)
"""How a multi-replica strategy makes, mirrors and reads its distributed variables.

The default implementation is MirroredStrategy's: parameters become `MirroredVariable`s
with an independent copy per replica, buffers become `SyncOnReadVariable`s. Other
strategies override single methods (CentralStorage aliases components; one-device
strategies only move tensors).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.strategies._gradients import install_own_copy
from phalanx.values import ReduceOp
from phalanx.variables import (
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    VariableAggregation,
    VariableSynchronization,
)

if TYPE_CHECKING:
    from phalanx.strategies.replica_context import ReplicaContext
    from phalanx.strategies.strategy import Strategy

__all__ = ["VariablePolicyMixin"]

_MERGEABLE = ("copy_", "add_", "sub_")


class VariablePolicyMixin:
    """Variable creation and resolution for `Strategy` (see module docstring)."""

    # ------------------------------------------------------------------ creation
    def _create_parameter(self: Strategy, module: torch.nn.Module, name: str, param: Any) -> Any:
        if isinstance(param, DistributedVariable):
            return None
        primary = param.detach().to(self._devices[0]).requires_grad_(param.requires_grad)
        aggregation = getattr(param, "_phalanx_aggregation", VariableAggregation.NONE)
        return self._register(MirroredVariable(primary, self, aggregation, is_parameter=True))

    def _create_buffer(self: Strategy, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        if isinstance(buffer, DistributedVariable):
            return None
        floating = buffer.is_floating_point() or buffer.is_complex()
        default = VariableAggregation.MEAN if floating else VariableAggregation.ONLY_FIRST_REPLICA
        aggregation = getattr(buffer, "_phalanx_aggregation", default)
        sync = getattr(buffer, "_phalanx_synchronization", VariableSynchronization.ON_READ)
        primary = buffer.detach().to(self._devices[0])
        cls = MirroredVariable if sync is VariableSynchronization.ON_WRITE else SyncOnReadVariable
        return self._register(cls(primary, self, aggregation, is_parameter=False))

    def _register(self: Strategy, var: DistributedVariable) -> DistributedVariable:
        self._variables.append(weakref.ref(var))
        return var

    def _reassign_buffer(
        self: Strategy, module: torch.nn.Module, name: str, value: Any, ctx: ReplicaContext
    ) -> Any:
        existing = module._buffers.get(name)
        if not isinstance(existing, DistributedVariable) or existing._strategy is not self:
            return None
        if value is existing:
            return existing
        with torch.no_grad():
            existing._components[ctx.local_replica_index].copy_(value)
        return existing

    # ------------------------------------------------------------------ components
    def _make_component(self: Strategy, var: DistributedVariable, index: int) -> torch.Tensor:
        primary = var._components[0]
        device = self._devices[index]
        if isinstance(var, SyncOnReadVariable) and var._aggregation is VariableAggregation.SUM:
            return torch.zeros_like(primary, device=device)
        copy = primary.detach().to(device, copy=True)
        return copy.requires_grad_(primary.requires_grad)

    def _materialize(self: Strategy, var: DistributedVariable) -> None:
        """Makes missing components from the primary, or re-mirrors after cross-replica writes."""
        components = var._components
        if len(components) < self._num_local_replicas:
            with torch.no_grad():
                components.extend(
                    self._make_component(var, i) for i in range(len(components), self._num_local_replicas)
                )
            var._dirty = False
        elif var._dirty:
            self._mirror(var)
            var._dirty = False

    def _mirror(self: Strategy, var: DistributedVariable) -> None:
        if not isinstance(var, MirroredVariable):
            return
        primary = var._components[0]
        with torch.no_grad():
            for component in var._components[1:]:
                if component.dtype != primary.dtype or component.shape != primary.shape:
                    # the primary was converted (model.double()) or resized through `.data`
                    component.data = primary.detach().to(component.device, copy=True)
                elif component.data_ptr() != primary.data_ptr():
                    component.copy_(primary)

    # ------------------------------------------------------------------ reads and writes
    def _aggregate_sync_on_read(self: Strategy, var: DistributedVariable) -> torch.Tensor:
        components = var._components
        aggregation = var._aggregation
        if aggregation in (VariableAggregation.ONLY_FIRST_REPLICA, VariableAggregation.NONE):
            return components[0]
        total = components[0]
        if len(components) > 1:
            total = self._cross_device_ops.reduce_to(ReduceOp.SUM, components, self._devices[0])
        if self._num_workers > 1:
            total = self._cross_worker_all_reduce(total.clone(), ReduceOp.SUM)
        count = len(components) * self._num_workers  # before the first run: one component
        if aggregation is VariableAggregation.MEAN and count > 1:
            total = total / count
        return total

    def _merged_assign(
        self: Strategy,
        var: DistributedVariable,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        index: int,
    ) -> Any:
        name = getattr(func, "__name__", repr(func))
        if var._aggregation is VariableAggregation.NONE:
            raise RuntimeError(
                f"In a replica context, `{name}` on a MirroredVariable needs an aggregation to "
                "keep the replicas equal, and this variable has none. HINT: annotate it with "
                "phalanx.variables.set_aggregation(tensor, 'mean') before the module registers "
                "it, or write it outside strategy.run (cross-replica context)."
            )
        if name not in _MERGEABLE or len(args) < 2 or kwargs:
            raise NotImplementedError(
                f"In a replica context a MirroredVariable supports only {list(_MERGEABLE)} "
                f"with one tensor argument. Received: `{name}`. HINT: use merge_call and "
                "strategy.extended.update for other writes."
            )
        value = torch.as_tensor(args[1]).to(self._devices[index])

        def combine(values: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
            merged = self._aggregate_values(var._aggregation, values)
            return merged, self._write_merged_once(var, func, merged)

        merged, written = self._rendezvous.exchange(index, value, combine, what=f"MirroredVariable.{name}")
        if not written:
            with torch.no_grad():
                func(var._components[index], merged.to(self._devices[index]))
        return var

    def _write_merged_once(
        self: Strategy, var: DistributedVariable, func: Callable[..., Any], merged: torch.Tensor
    ) -> bool:
        """Applies a merged replica write once for all replicas, before any goes on; False if
        each replica writes its own component instead (the default)."""
        return False

    def _aggregate_values(
        self: Strategy, aggregation: VariableAggregation, values: list[torch.Tensor]
    ) -> torch.Tensor:
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return values[0]
        total = self._cross_device_ops.reduce_to(ReduceOp.SUM, values, self._devices[0])
        total = self._cross_worker_all_reduce(total, ReduceOp.SUM)
        if aggregation is VariableAggregation.MEAN:
            total = total / self.num_replicas_in_sync
        return total

    # ------------------------------------------------------------------ optimizer step
    def _install_gradients(
        self: Strategy,
        params: list[DistributedVariable],
        reduced: dict[torch.dtype, torch.Tensor],
        all_none: list[bool],
        index: int,
        spec: Any,
        owned: bool = False,
    ) -> None:
        install_own_copy(params, reduced, all_none, index, self._devices[index], spec, owned)

    def _install_summed_in_place(
        self: Strategy, params: list[DistributedVariable], all_none: list[bool], index: int
    ) -> None:
        """After an in-place sum every replica's gradients already hold the total."""
        for p, none in zip(params, all_none, strict=True):
            if none:
                p._replica_leaf(index).grad = None

    def _after_optimizer_step(self: Strategy, index: int) -> None:
        """Called in every replica after its optimizer step (nothing to do when mirrored)."""
