# mypy: disable-error-code="misc"
# (methods type `self` as the Strategy they are mixed into, which mypy cannot prove)
"""reduce, gather and local results: turning per-replica values into one value (cross-replica)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx import context
from phalanx.values import DistributedValues, ReduceOp, local_results
from phalanx.variables import DistributedVariable

if TYPE_CHECKING:
    from phalanx.strategies.strategy import Strategy

__all__ = ["ReductionMixin"]


def _map_values(fn: Any, value: Any) -> Any:
    if isinstance(value, (DistributedValues, torch.Tensor)) or not isinstance(value, (list, tuple, dict)):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_values(fn, v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_values(fn, v) for v in value))
    return type(value)(_map_values(fn, v) for v in value)


class ReductionMixin:
    """`reduce`, `gather` and `experimental_local_results` for `Strategy`."""

    def experimental_local_results(self: Strategy, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker's replicas, in replica order.

        A distributed variable gives its per-replica tensors (one for a CentralStorage
        variable, which is stored once); a plain value gives ``(value,)``.
        """
        if isinstance(value, DistributedVariable):
            return value.components
        return local_results(value)

    def _check_cross_replica(self: Strategy, what: str, instead: str) -> None:
        replica = context._state.replica
        if replica is not None and replica[0] is self and not self._is_default:
            raise RuntimeError(
                f"strategy.{what} must be called in cross-replica context (outside "
                f"strategy.run), but was called inside it. HINT: {instead}"
            )

    def reduce(self: Strategy, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces a per-replica value across all replicas and workers (cross-replica context).

        Args:
            reduce_op: SUM or MEAN.
            value: A per-replica value (or nest of them), as returned by `run`; a plain value
                counts as identical on every local replica (MEAN gives it back; SUM gives it
                times the local replicas, summed over workers).
            axis: None reduces across replicas only. An axis also reduces along it; MEAN
                then divides by the true number of elements across replicas, so partial
                batches give the right mean.

        Raises:
            RuntimeError: Called inside `run` (use ``get_replica_context().all_reduce``).
        """
        op = ReduceOp.coerce(reduce_op)
        self._check_cross_replica(
            "reduce", "inside strategy.run use phalanx.get_replica_context().all_reduce."
        )
        if axis is None and type(value) is torch.Tensor and self.num_replicas_in_sync == 1:
            return value  # one replica: nothing to reduce
        return _map_values(lambda v: self._reduce_one(op, v, axis), value)

    def _reduce_one(self: Strategy, op: ReduceOp, value: Any, axis: int | None) -> torch.Tensor:
        home = self._devices[0]
        if isinstance(value, DistributedValues):
            components = [torch.as_tensor(c) for c in value.values]
            copies = 1
        else:  # a plain value is the same on every local replica
            components = [torch.as_tensor(value)]
            copies = self._num_local_replicas
        if axis is not None:
            count = copies * sum(c.shape[axis] for c in components)
            components = [c.sum(dim=axis) for c in components]
        if copies > 1:
            components = [components[0] * copies]
        if len(components) == 1 and self._num_workers == 1:
            total = components[0]
        else:
            total = self._cross_device_ops.reduce_to(ReduceOp.SUM, components, home)
            total = self._cross_worker_all_reduce(total, ReduceOp.SUM)
        if op is ReduceOp.SUM:
            return total
        if axis is None:
            return total / self.num_replicas_in_sync if self.num_replicas_in_sync > 1 else total
        if self._num_workers > 1:
            count = int(
                self._cross_worker_all_reduce(torch.tensor(float(count), device=home), ReduceOp.SUM).item()
            )
        return total / count

    def gather(self: Strategy, value: Any, axis: int) -> Any:
        """Concatenates every replica's value along ``axis``, in global replica order (cross-replica).

        Shapes may differ along ``axis`` (partial batches). Raises RuntimeError inside `run`.
        """
        self._check_cross_replica(
            "gather", "inside strategy.run use phalanx.get_replica_context().all_gather."
        )
        return _map_values(lambda v: self._gather_one(v, axis), value)

    def _gather_one(self: Strategy, value: Any, axis: int) -> torch.Tensor:
        components = [torch.as_tensor(c) for c in local_results(value)]
        home = self._devices[0]
        components = [c.reshape(1) if c.dim() == 0 else c for c in components]
        local = torch.cat([c.to(home) for c in components], dim=axis)
        gathered, _ = self._cross_worker_all_gather(local, axis, [c.shape[axis] for c in components])
        return gathered
