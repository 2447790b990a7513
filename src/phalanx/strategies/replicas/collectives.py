"""Differentiable all-reduce and all-gather between the replicas of `Strategy.run`.

Local replicas meet at the strategy's rendezvous; the last to arrive reduces for all (to the
first local device) and, with several workers, runs the cross-worker collective once on
behalf of this process. Each replica then takes its own copy on its own device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx.communication.checks.signatures import shapes_of
from phalanx.values import ReduceOp, flatten

if TYPE_CHECKING:
    from phalanx.communication.local.options import CommunicationOptions
    from phalanx.protocols import DistributionStrategy

__all__ = ["all_gather_structure", "all_reduce_structure"]


def _own_copy(result: torch.Tensor, device: torch.device, index: int) -> torch.Tensor:
    if index == 0:
        return result if result.device == device else result.to(device)
    return result.to(device, copy=True)


def _sum_across_replicas(
    strategy: DistributionStrategy,
    index: int,
    tensors: list[torch.Tensor],
    options: CommunicationOptions | None,
) -> list[torch.Tensor]:
    ops = strategy.cross_device_ops
    home = strategy.local_devices[0]

    def lead(values: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        out = []
        for k in range(len(values[0])):
            total = ops.reduce_to(ReduceOp.SUM, [v[k] for v in values], home)
            out.append(strategy.cross_worker_all_reduce(total, ReduceOp.SUM, options))
        return out

    reduced = strategy.rendezvous.exchange(
        index, tensors, lead, what="all_reduce", signature=shapes_of(tensors)
    )
    device = strategy.local_devices[index]
    return [_own_copy(r, device, index) for r in reduced]


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        strategy: DistributionStrategy,
        index: int,
        op: ReduceOp,
        options: Any,
        *tensors: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.strategy, ctx.index, ctx.op, ctx.options = strategy, index, op, options
        out = _sum_across_replicas(strategy, index, list(tensors), options)
        if op is ReduceOp.MEAN:
            out = [_mean(t, strategy.num_replicas_in_sync) for t in out]
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        grads_in = [g.contiguous() for g in grads]
        out = _sum_across_replicas(ctx.strategy, ctx.index, grads_in, ctx.options)
        if ctx.op is ReduceOp.MEAN:
            out = [g / ctx.strategy.num_replicas_in_sync for g in out]
        return (None, None, None, None, *out)


def _mean(t: torch.Tensor, n: int) -> torch.Tensor:
    return t / n if t.is_floating_point() or t.is_complex() else torch.div(t, n, rounding_mode="floor")


def _rebuild(structure: Any, leaves: list[Any]) -> Any:
    it = iter(leaves)

    def build(s: Any) -> Any:
        if isinstance(s, tuple) and hasattr(s, "_fields"):
            return type(s)(*(build(v) for v in s))
        if isinstance(s, (list, tuple)):
            return type(s)(build(v) for v in s)
        if isinstance(s, dict):
            return type(s)((k, build(v)) for k, v in s.items())
        return next(it)

    return build(structure)


def all_reduce_structure(
    strategy: DistributionStrategy, index: int, op: ReduceOp, value: Any, options: CommunicationOptions | None
) -> Any:
    """All-reduces every tensor leaf of ``value`` (one rendezvous for the whole structure),
    for local replica ``index`` of ``strategy``."""
    leaves = [torch.as_tensor(leaf) for leaf in flatten(value)]
    if not leaves:
        return value
    if strategy.num_replicas_in_sync == 1:
        return value
    device = strategy.local_devices[index]
    leaves = [t if t.device == device else t.to(device) for t in leaves]
    out = _AllReduce.apply(strategy, index, op, options, *leaves)
    return _rebuild(value, list(out))


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, strategy: DistributionStrategy, index: int, axis: int, options: Any, tensor: torch.Tensor
    ) -> torch.Tensor:
        home = strategy.local_devices[0]

        def lead(values: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
            local = torch.cat([v.to(home) for v in values], dim=axis)
            sizes = [v.shape[axis] for v in values]
            gathered, all_sizes = strategy.cross_worker_all_gather(local, axis, sizes, options)
            return gathered, all_sizes

        gathered, sizes = strategy.rendezvous.exchange(index, tensor, lead, what="all_gather")
        ctx.strategy, ctx.index, ctx.axis, ctx.options = strategy, index, axis, options
        global_index = strategy.first_replica_id + index
        ctx.start = sum(sizes[:global_index])
        ctx.length = sizes[global_index]
        return _own_copy(gathered, strategy.local_devices[index], index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (total,) = _sum_across_replicas(ctx.strategy, ctx.index, [grad.contiguous()], ctx.options)
        return (None, None, None, None, total.narrow(ctx.axis, ctx.start, ctx.length))


def all_gather_structure(
    strategy: DistributionStrategy, index: int, value: Any, axis: int, options: CommunicationOptions | None
) -> Any:
    """All-gathers every tensor leaf of ``value`` along ``axis``, for local replica ``index``."""
    device = strategy.local_devices[index]
    out = []
    for leaf in flatten(value):
        t = torch.as_tensor(leaf)
        t = t if t.device == device else t.to(device)
        if t.dim() == 0:
            t = t.reshape(1)
        out.append(
            t if strategy.num_replicas_in_sync == 1 else _AllGather.apply(strategy, index, axis, options, t)
        )
    return _rebuild(value, out)
