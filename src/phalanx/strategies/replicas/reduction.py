"""Cross-replica reduce and gather: turning per-replica values into one value.

A composed object rather than a mixin: `Strategy.reduce`, `Strategy.gather` and
`Strategy.reduce_to` keep their documented signatures on the strategy and delegate here, so
the arithmetic (partial batches, plain values counted once per replica, the cross-worker
step) lives in one place that depends only on the strategy's public replica layout, its
cross-device ops and its ``cross_worker_*`` hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx import context
from phalanx.values import DistributedValues, ReduceOp, local_results

if TYPE_CHECKING:
    from phalanx.communication.local.cross_device_ops import CrossDeviceOps
    from phalanx.protocols import DistributionStrategy

__all__ = ["CrossReplicaReduction"]


def _map_values(fn: Any, value: Any) -> Any:
    if isinstance(value, (DistributedValues, torch.Tensor)) or not isinstance(value, (list, tuple, dict)):
        return fn(value)
    if isinstance(value, dict):
        return type(value)((k, _map_values(fn, v)) for k, v in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_values(fn, v) for v in value))
    return type(value)(_map_values(fn, v) for v in value)


class CrossReplicaReduction:
    """Reduces and gathers per-replica values of one strategy (cross-replica context).

    Args:
        strategy: The strategy whose replicas' values are reduced: its local devices and
            replicas are read here (they are fixed when the strategy is made), its workers at
            each call (a multi-worker strategy learns them later); its
            ``cross_worker_all_reduce``/``cross_worker_all_gather`` hooks cross workers.
        cross_device_ops: Sums the local replicas' values onto the first local device.
    """

    def __init__(self, strategy: DistributionStrategy, cross_device_ops: CrossDeviceOps) -> None:
        self._strategy = strategy
        self._ops = cross_device_ops
        self._home = strategy.local_devices[0]
        self._num_local = strategy.num_local_replicas

    def _refuse_replica_context(self, what: str, instead: str) -> None:
        """Raises RuntimeError if called inside the strategy's ``run`` (a replica context)."""
        replica = context.current_replica()
        if replica is not None and replica[0] is self._strategy and not self._strategy.is_default:
            raise RuntimeError(
                f"strategy.{what} must be called in cross-replica context (outside "
                f"strategy.run), but was called inside it. HINT: {instead}"
            )

    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> Any:
        """`Strategy.reduce` for a nest of values (see there; all workers, when several).

        Raises:
            RuntimeError: Called inside the strategy's ``run``.
        """
        if context.current_replica() is not None:  # checked inline: reduce runs at every step
            self._refuse_replica_context(
                "reduce", "inside strategy.run use phalanx.get_replica_context().all_reduce."
            )
        if axis is None and type(value) is torch.Tensor and self._strategy.num_replicas_in_sync == 1:
            return value  # one replica: nothing to reduce
        if isinstance(value, (DistributedValues, torch.Tensor)):  # one value: no nest to map
            return self.reduce_one(op, value, axis)
        return _map_values(lambda v: self.reduce_one(op, v, axis), value)

    def reduce_one(self, op: ReduceOp, value: Any, axis: int | None) -> torch.Tensor:
        """Reduces one per-replica (or plain) value onto the first local device."""
        s = self._strategy
        home = self._home
        workers = s.num_workers_in_sync
        if isinstance(value, DistributedValues):
            components = [torch.as_tensor(c) for c in value.values]
            copies = 1
        else:  # a plain value is the same on every local replica
            components = [torch.as_tensor(value)]
            copies = self._num_local
        if axis is not None:
            count = copies * sum(c.shape[axis] for c in components)
            components = [c.sum(dim=axis) for c in components]
        if copies > 1:
            components = [components[0] * copies]
        if len(components) == 1 and workers == 1:
            total = components[0]
        else:
            total = self._ops.reduce_to(ReduceOp.SUM, components, home)
            total = s.cross_worker_all_reduce(total, ReduceOp.SUM)
        if op is ReduceOp.SUM:
            return total
        if axis is None:
            return total / s.num_replicas_in_sync if s.num_replicas_in_sync > 1 else total
        if workers > 1:
            count = int(
                s.cross_worker_all_reduce(torch.tensor(float(count), device=home), ReduceOp.SUM).item()
            )
        return total / count

    def gather(self, value: Any, axis: int) -> Any:
        """`Strategy.gather` for a nest of values (see there; all workers, when several).

        Raises:
            RuntimeError: Called inside the strategy's ``run``.
        """
        self._refuse_replica_context(
            "gather", "inside strategy.run use phalanx.get_replica_context().all_gather."
        )
        return _map_values(lambda v: self._gather_one(v, axis), value)

    def _gather_one(self, value: Any, axis: int) -> torch.Tensor:
        components = [torch.as_tensor(c) for c in local_results(value)]
        home = self._home
        components = [c.reshape(1) if c.dim() == 0 else c for c in components]
        local = torch.cat([c.to(home) for c in components], dim=axis)
        gathered, _ = self._strategy.cross_worker_all_gather(local, axis, [c.shape[axis] for c in components])
        return gathered
