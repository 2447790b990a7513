"""Gradient synchronisation at ``optimizer.step()``: TF's apply_gradients merge point.

See docs/architecture.md, "The optimizer step".

Every replica packs its gradients (in its own thread), the replicas meet, the last to arrive
sums the packs (and all-reduces them across workers), and each replica then installs its
own copy of the sum as the gradients of its components before the step runs.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from phalanx.communication.packing import pack, spec_of, unpack
from phalanx.strategies._optimizer_state import PerReplicaState
from phalanx.values import ReduceOp
from phalanx.variables import DistributedVariable, set_in_optimizer_step

if TYPE_CHECKING:
    from phalanx.strategies.strategy import Strategy

__all__ = ["GradientSync"]


class GradientSync:
    """The optimizer-step merge point of one strategy's local replicas."""

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._local = threading.local()

    def _distributed_params(self, optimizer: torch.optim.Optimizer) -> list[DistributedVariable]:
        s = self._strategy
        params: list[DistributedVariable] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(p, DistributedVariable) and p._strategy is s:
                    params.append(p)
                elif s._num_local_replicas > 1:
                    raise RuntimeError(
                        f"optimizer.step() inside {s!r}.run got a parameter that was not created "
                        "in this strategy's scope, so every replica would update it once. "
                        "HINT: create the model and the optimizer inside `with strategy.scope():`."
                    )
        return params

    def before_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Sums gradients across replicas before the step (every replica calls it)."""
        if self._strategy.num_replicas_in_sync == 1:
            set_in_optimizer_step(True)  # nothing to sum; the update itself may write variables
            if self._strategy._variables:  # one replica of a distributed strategy
                params = self._distributed_params(optimizer)
                none = [p._replica_leaf(0).grad is None for p in params]
                self._strategy._install_summed_in_place(params, none, 0)
            return
        params = self._distributed_params(optimizer)
        if not params:
            return
        like = [p._replica_leaf(index) for p in params]
        if self._strategy._sums_in_shared_memory():
            all_none = self._sum_in_place(optimizer, index, like)
            self._strategy._install_summed_in_place(params, all_none, index)
            set_in_optimizer_step(True)
            return
        grads = [c.grad for c in like]
        if any(g is not None and g.is_sparse for g in grads):
            raise NotImplementedError(
                f"Sparse gradients (nn.Embedding(sparse=True)) are summed by {self._strategy!r} "
                "only with CPU replicas of one worker and the default cross-device ops. HINT: "
                "use sparse=False, or CPU replicas."
            )
        packed = pack(grads, like)
        none_mask = [g is None for g in grads]
        reduced, all_none = self._strategy._rendezvous.exchange(
            index,
            (packed, none_mask),
            lambda values: self._lead(optimizer, values),
            what="optimizer.step()",
        )
        self._strategy._install_gradients(params, reduced, all_none, index, spec_of(like))
        set_in_optimizer_step(True)

    def _sum_in_place(
        self, optimizer: torch.optim.Optimizer, index: int, leaves: list[torch.Tensor]
    ) -> list[bool]:
        """All replicas share one memory: replica i sums slice i of every gradient over all
        replicas and writes the sum back into each replica's gradient (a reduce-scatter and
        all-gather done by plain memory copies, in parallel, with no packing).

        Returns:
            Per parameter, whether no replica had a gradient (it stays None).
        """
        s = self._strategy
        n = s._num_local_replicas
        mask = [leaf.grad is None for leaf in leaves]
        for leaf, missing in zip(leaves, mask, strict=True):
            if missing:
                leaf.grad = torch.zeros_like(leaf)

        def lead(values: list[Any]) -> list[Any]:
            if not isinstance(optimizer.state, PerReplicaState):
                optimizer.state = PerReplicaState(optimizer.state, s)  # type: ignore[assignment]
            return values

        values = s._rendezvous.exchange(
            index, ([leaf.grad for leaf in leaves], mask), lead, what="optimizer.step()"
        )
        whole: dict[int, torch.Tensor] = {}  # sums this replica made of sparse gradients
        with torch.no_grad():
            for k in range(len(leaves)):
                grads = [v[0][k] for v in values]
                if all(g.is_contiguous() for g in grads):
                    _sum_slice(grads, n, index)
                elif k % n == index:  # strided or sparse: one replica sums the whole tensor
                    total = _sum_whole(grads)
                    if total is not None:
                        whole[k] = total
        sparse = s._rendezvous.exchange(index, whole, _merge_dicts, what="optimizer.step() (gradient sum)")
        for k, total in sparse.items():
            leaves[k].grad = total.clone()
        return [all(v[1][k] for v in values) for k in range(len(leaves))]

    def _lead(
        self, optimizer: torch.optim.Optimizer, values: list[Any]
    ) -> tuple[dict[torch.dtype, torch.Tensor], list[bool]]:
        s = self._strategy
        if not isinstance(optimizer.state, PerReplicaState):
            optimizer.state = PerReplicaState(optimizer.state, s)  # type: ignore[assignment]
        all_none = [all(mask[k] for _, mask in values) for k in range(len(values[0][1]))]
        home = s._devices[0]
        reduced = {}
        for dtype in values[0][0]:
            total = s._cross_device_ops.reduce_to(ReduceOp.SUM, [v[0][dtype] for v in values], home)
            reduced[dtype] = s._cross_worker_all_reduce(total, ReduceOp.SUM)
        return reduced, all_none

    def after_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Ends the step's write permission; lets the strategy finish the step (all replicas)."""
        set_in_optimizer_step(False)
        if self._strategy._variables and self._distributed_params(optimizer):
            self._strategy._after_optimizer_step(index)

    def reset_thread(self) -> None:
        """Clears per-thread step state after a replica's run ends (also after an error)."""
        set_in_optimizer_step(False)


def _sum_slice(grads: list[torch.Tensor], n: int, index: int) -> None:
    """Writes the sum of slice ``index`` (of ``n``) of contiguous ``grads`` into all of them."""
    chunks = [torch.tensor_split(g.view(-1), n)[index] for g in grads]
    for chunk in chunks[1:]:
        chunks[0].add_(chunk)
    for chunk in chunks[1:]:
        chunk.copy_(chunks[0])


def _sum_whole(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """Sums whole gradients: writes a dense sum into every one, returns a sparse one."""
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    if total.is_sparse:
        return total.coalesce()
    for g in grads:
        g.copy_(total)
    return None


def _merge_dicts(values: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {k: v for d in values for k, v in d.items()}


def install_own_copy(
    params: list[DistributedVariable],
    reduced: dict[torch.dtype, torch.Tensor],
    all_none: list[bool],
    index: int,
    device: torch.device,
    spec: Any,
    owned: bool = False,
) -> None:
    """Gives replica ``index`` its own copy of the summed gradients, as views of one buffer.

    ``owned``: the buffers already belong to this replica (no copy needed).
    """
    mine = {
        dtype: (buf if (owned or index == 0) and buf.device == device else buf.to(device, copy=True))
        for dtype, buf in reduced.items()
    }
    for p, view, none in zip(params, unpack(mine, spec), all_none, strict=True):
        p._replica_leaf(index).grad = None if none else view
