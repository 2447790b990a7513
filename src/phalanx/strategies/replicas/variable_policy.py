"""How a strategy makes, mirrors, reads and writes its distributed variables.

A composed object rather than a mixin: every `Strategy` owns one `VariablePolicy`
(``strategy.variable_policy``), made by its ``_make_variable_policy`` hook. The policy keeps
the strategy's registry of variables and answers the questions the variables and the
gradient path ask (materialise the components, aggregate a sync-on-read read, merge a
replica write, install the summed gradients), so those callers depend on this small
interface instead of on the strategy's internals.

This class is MirroredStrategy's policy: parameters become `MirroredVariable`s with an
independent copy per replica, buffers become `SyncOnReadVariable`s.
`phalanx.strategies.central_storage.CentralStoragePolicy` stores each parameter once.
One-device strategies keep this policy but never create distributed variables.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx import _hooks
from phalanx.communication.local.packing import unpack
from phalanx.values import ReduceOp
from phalanx.variables import (
    AGGREGATION_MARK,
    SYNCHRONIZATION_MARK,
    DistributedVariable,
    MirroredVariable,
    SyncOnReadVariable,
    VariableAggregation,
    VariableSynchronization,
)

if TYPE_CHECKING:
    from phalanx.communication.local.cross_device_ops import CrossDeviceOps
    from phalanx.protocols import DistributionStrategy
    from phalanx.strategies.replica_context import ReplicaContext
    from phalanx.strategies.replicas.rendezvous import ReplicaRendezvous

__all__ = ["VariablePolicy", "install_own_copy"]

_MERGEABLE = ("copy_", "add_", "sub_")
_SUMMED = (VariableAggregation.SUM, VariableAggregation.MEAN)  # aggregations a read sums


class VariablePolicy:
    """The mirrored variable policy of one strategy (see module docstring).

    The policy reads the strategy's replica layout through its public properties at each
    call (a multi-worker strategy learns its workers after the policy is made) and reduces
    across workers through the strategy's ``cross_worker_all_reduce`` hook.

    Args:
        strategy: The strategy the variables belong to (their ``_strategy``).
        rendezvous: Where the strategy's local replicas meet (merged replica writes).
        cross_device_ops: How the local replicas' values are summed.
    """

    def __init__(
        self, strategy: DistributionStrategy, rendezvous: ReplicaRendezvous, cross_device_ops: CrossDeviceOps
    ) -> None:
        self._strategy = strategy
        self._rendezvous = rendezvous
        self._ops = cross_device_ops
        self._variables: list[weakref.ref[DistributedVariable]] = []
        # Whether any variable is registered (and, after `materialize_all`, alive): a plain
        # attribute because `run` and the gradient path read it at every step.
        self.has_variables = False
        # Changes whenever the set of live variables or their components may have: readers
        # that cache something per variable (the replica write guard) compare it.
        self.generation = 0
        # `reading_together`'s aggregates, by id: (variable, value)
        self._read_together: dict[int, tuple[DistributedVariable, torch.Tensor]] | None = None

    @property
    def strategy(self) -> DistributionStrategy:
        """The strategy whose variables this policy makes."""
        return self._strategy

    # ------------------------------------------------------------------ registry
    # Whether `materialize_all` calls `materialize` for every variable (a policy whose
    # variables need more than their components and dirty flag looked at says True).
    _materialize_every_run = False

    def register(self, var: DistributedVariable) -> DistributedVariable:
        """Remembers ``var`` (weakly) so that `materialize_all` readies it before each run."""
        self._variables.append(weakref.ref(var))
        self.has_variables = True
        self.generation += 1
        return var

    def variables(self) -> Iterator[DistributedVariable]:
        """The registered variables still alive, in creation order."""
        for ref in self._variables:
            var = ref()
            if var is not None:
                yield var

    def owns(self, tensor: Any) -> bool:
        """Whether ``tensor`` is a distributed variable of this policy's strategy."""
        return isinstance(tensor, DistributedVariable) and tensor.strategy is self._strategy

    def materialize_all(self) -> None:
        """Readies every live variable for a step and forgets the dead ones (before each run)."""
        alive = []
        n = self._strategy.num_local_replicas
        every = self._materialize_every_run
        for ref in self._variables:
            var = ref()
            if var is not None:
                # `materialize`'s own test, inlined: this runs for every variable at every step
                if every or var.dirty or len(var.stored_components) < n:
                    self.materialize(var)
                    self.generation += 1
                alive.append(ref)
        if len(alive) != len(self._variables):
            self.generation += 1
        self._variables = alive
        self.has_variables = bool(alive)

    # ------------------------------------------------------------------ creation
    def create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        """A `MirroredVariable` for a parameter registered in the strategy's scope (None: keep it)."""
        if isinstance(param, DistributedVariable):
            return None
        primary = param.detach().to(self._strategy.local_devices[0]).requires_grad_(param.requires_grad)
        aggregation = getattr(param, AGGREGATION_MARK, VariableAggregation.NONE)
        return self.register(MirroredVariable(primary, self._strategy, aggregation, is_parameter=True))

    def create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        """A `SyncOnReadVariable` (or `MirroredVariable` if annotated ON_WRITE) for a buffer."""
        if isinstance(buffer, DistributedVariable):
            return None
        floating = buffer.is_floating_point() or buffer.is_complex()
        default = VariableAggregation.MEAN if floating else VariableAggregation.ONLY_FIRST_REPLICA
        aggregation = getattr(buffer, AGGREGATION_MARK, default)
        sync = getattr(buffer, SYNCHRONIZATION_MARK, VariableSynchronization.ON_READ)
        primary = buffer.detach().to(self._strategy.local_devices[0])
        cls = MirroredVariable if sync is VariableSynchronization.ON_WRITE else SyncOnReadVariable
        return self.register(cls(primary, self._strategy, aggregation, is_parameter=False))

    def reassign_buffer(self, module: torch.nn.Module, name: str, value: Any, ctx: ReplicaContext) -> Any:
        """A module re-assigned its buffer inside ``run``: writes ``value`` into this replica's
        component and keeps the variable (None: not one of ours, let torch assign)."""
        existing = _hooks.own_buffers(module).get(name)
        if not isinstance(existing, DistributedVariable) or not self.owns(existing):
            return None
        if value is existing:
            return existing
        with torch.no_grad():
            existing.stored_components[ctx.local_replica_index].copy_(value)
        return existing

    # ------------------------------------------------------------------ components
    def materialize(self, var: DistributedVariable) -> None:
        """Makes missing components from the primary, or re-mirrors after cross-replica writes."""
        components = var.stored_components
        n = self._strategy.num_local_replicas
        if len(components) < n:
            with torch.no_grad():
                components.extend(self._make_component(var, i) for i in range(len(components), n))
            var.mark_clean()
        elif var.dirty:
            self._mirror(var)
            var.mark_clean()

    def _make_component(self, var: DistributedVariable, index: int) -> torch.Tensor:
        primary = var.primary
        device = self._strategy.local_devices[index]
        if isinstance(var, SyncOnReadVariable) and var.aggregation is VariableAggregation.SUM:
            return torch.zeros_like(primary, device=device)
        copy = primary.detach().to(device, copy=True)
        return copy.requires_grad_(primary.requires_grad)

    def _mirror(self, var: DistributedVariable) -> None:
        if not isinstance(var, MirroredVariable):
            return
        primary = var.primary
        with torch.no_grad():
            for component in var.stored_components[1:]:
                if component.dtype != primary.dtype or component.shape != primary.shape:
                    # the primary was converted (model.double()) or resized through `.data`
                    component.data = primary.detach().to(component.device, copy=True)
                elif component.data_ptr() != primary.data_ptr():
                    component.copy_(primary)

    # ------------------------------------------------------------------ reads and writes
    def aggregate_sync_on_read(self, var: DistributedVariable) -> torch.Tensor:
        """The cross-replica value of a sync-on-read variable (all workers, when several:
        the cross-worker sum is a collective; inside `reading_together`, made on entry)."""
        if self._read_together is not None:
            found = self._read_together.get(id(var))
            if found is not None and found[0] is var:
                return found[1]
        components = var.stored_components
        if var.aggregation in (VariableAggregation.ONLY_FIRST_REPLICA, VariableAggregation.NONE):
            return components[0]
        total = self._local_sum(components)
        if self._strategy.num_workers_in_sync > 1:
            total = self._across_workers(total.clone())
        return self._finish_aggregate(var, total)

    def _local_sum(self, components: Sequence[torch.Tensor]) -> torch.Tensor:
        """This worker's replicas' components summed onto its first device."""
        if len(components) == 1:
            return components[0]
        return self._ops.reduce_to(ReduceOp.SUM, list(components), self._strategy.local_devices[0])

    def _across_workers(self, total: torch.Tensor) -> torch.Tensor:
        """The sum of every worker's ``total`` (all workers; may be written in place)."""
        return self._strategy.cross_worker_all_reduce(total, ReduceOp.SUM)

    def _finish_aggregate(self, var: DistributedVariable, total: torch.Tensor) -> torch.Tensor:
        """A SUM over every replica and worker as ``var``'s aggregation reads it (MEAN: divided)."""
        count = len(var.stored_components) * self._strategy.num_workers_in_sync  # before a run: one
        if var.aggregation is VariableAggregation.MEAN and count > 1:
            return total / count
        return total

    @contextlib.contextmanager
    def reading_together(self, variables: Iterable[Any]) -> Iterator[None]:
        """Inside, reads of the sync-on-read ``variables`` (others are ignored) come from one
        cross-worker all-reduce per dtype and device, made on entry, instead of one each
        (cross-replica context; all workers, with the same variables in the same order).

        The sums are those the reads would make one by one (the same local sums, the same
        cross-worker sum of each element). `Model.fit` reads its metrics' states this way at
        every step. A variable written inside is read afresh. With one worker: no effect.
        """
        if self._strategy.num_workers_in_sync == 1 or self._read_together is not None:
            yield
            return
        packs: dict[tuple[torch.dtype, torch.device], list[tuple[SyncOnReadVariable, torch.Tensor]]] = {}
        for var in variables:
            if isinstance(var, SyncOnReadVariable) and var.aggregation in _SUMMED:
                local = self._local_sum(var.stored_components)
                packs.setdefault((local.dtype, local.device), []).append((var, local))
        read: dict[int, tuple[DistributedVariable, torch.Tensor]] = {}
        for members in packs.values():
            flat = self._across_workers(torch.cat([local.reshape(-1) for _, local in members]))  # a copy
            start = 0
            for var, local in members:
                total = flat[start : start + local.numel()].view_as(local)
                start += local.numel()
                read[id(var)] = (var, self._finish_aggregate(var, total))
        self._read_together = read
        try:
            yield
        finally:
            self._read_together = None

    def forget_read(self, var: DistributedVariable) -> None:
        """Drops what `reading_together` aggregated for ``var`` (called when it is written)."""
        if self._read_together is not None:
            self._read_together.pop(id(var), None)

    def merged_assign(
        self,
        var: DistributedVariable,
        func: Callable[..., Any],
        args: Sequence[Any],
        kwargs: dict[str, Any],
        index: int,
    ) -> Any:
        """A replica's ``copy_``/``add_``/``sub_`` on a mirrored variable: the replicas' values
        are aggregated and every component gets the same write (all local replicas; blocks).

        Raises:
            RuntimeError: The variable has no aggregation.
            NotImplementedError: Another write, or one with keyword arguments.
        """
        name = getattr(func, "__name__", repr(func))
        if var.aggregation is VariableAggregation.NONE:
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
        device = self._strategy.local_devices[index]
        value = torch.as_tensor(args[1]).to(device)

        def combine(values: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
            merged = self._aggregate_values(var.aggregation, values)
            return merged, self._write_merged_once(var, func, merged)

        merged, written = self._rendezvous.exchange(index, value, combine, what=f"MirroredVariable.{name}")
        if not written:
            with torch.no_grad():
                func(var.stored_components[index], merged.to(device))
        return var

    def _write_merged_once(
        self, var: DistributedVariable, func: Callable[..., Any], merged: torch.Tensor
    ) -> bool:
        """Applies a merged replica write once for all replicas, before any goes on; False if
        each replica writes its own component instead (the default)."""
        return False

    def _aggregate_values(self, aggregation: VariableAggregation, values: list[torch.Tensor]) -> torch.Tensor:
        if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
            return values[0]
        total = self._ops.reduce_to(ReduceOp.SUM, values, self._strategy.local_devices[0])
        total = self._across_workers(total)
        if aggregation is VariableAggregation.MEAN:
            total = total / self._strategy.num_replicas_in_sync
        return total

    # ------------------------------------------------------------------ optimizer step
    def install_gradients(
        self,
        params: list[DistributedVariable],
        reduced: dict[torch.dtype, torch.Tensor],
        all_none: list[bool],
        index: int,
        spec: Any,
    ) -> None:
        """Sets replica ``index``'s gradients to the packed sums ``reduced`` (its own copy).

        Called by the gradient path in every replica, after the sum, before the update.
        """
        install_own_copy(params, reduced, all_none, index, self._strategy.local_devices[index], spec)

    def install_summed_in_place(
        self, params: list[DistributedVariable], all_none: list[bool], index: int
    ) -> None:
        """After an in-place sum every replica's gradients already hold the total; parameters
        no replica had a gradient for go back to None (every replica)."""
        for p, none in zip(params, all_none, strict=True):
            if none:
                p.replica_leaf(index).grad = None

    def after_optimizer_step(self, index: int) -> None:
        """Called in every replica after its optimizer step (nothing to do when mirrored)."""


def install_own_copy(
    params: list[DistributedVariable],
    reduced: dict[torch.dtype, torch.Tensor],
    all_none: list[bool],
    index: int,
    device: torch.device,
    spec: Any,
) -> None:
    """Gives replica ``index`` its own copy of the summed gradients, as views of one buffer
    (replica 0 keeps the sum itself when it is already on its device)."""
    mine = {
        dtype: (buf if index == 0 and buf.device == device else buf.to(device, copy=True))
        for dtype, buf in reduced.items()
    }
    for p, view, none in zip(params, unpack(mine, spec), all_none, strict=True):
        p.replica_leaf(index).grad = None if none else view
