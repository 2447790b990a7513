"""The gradient path of in-process replicas: TF's apply_gradients merge point.

See docs/architecture.md, "The optimizer step".

Every replica packs its gradients (in its own thread), the replicas meet, the last to arrive
sums the packs (and all-reduces them across workers), and each replica then installs its
own copy of the sum as the gradients of its components before the step runs. When the
cross-device ops can sum in place on the replicas' devices (CPU replicas of one worker, the
default reduction), replica ``i`` instead sums slice ``i`` of every gradient over shared
memory and no packing happens.

`GradientSync` receives every piece it uses (the devices, the rendezvous, the cross-device
ops, the cross-worker reduce and the variable policy) as constructor arguments; it reads
nothing else of the strategy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.communication.packing import pack, spec_of
from phalanx.strategies._optimizer_state import PerReplicaState
from phalanx.values import ReduceOp
from phalanx.variables import DistributedVariable, set_in_optimizer_step

if TYPE_CHECKING:
    from phalanx.communication.cross_device_ops import CrossDeviceOps
    from phalanx.strategies._rendezvous import Rendezvous
    from phalanx.strategies._variable_policy import VariablePolicy

__all__ = ["GradientSync"]

CrossWorkerReduce = Callable[[torch.Tensor, ReduceOp], torch.Tensor]


class GradientSync:
    """The optimizer-step merge point of one strategy's local replicas (a `StepSync`).

    Args:
        devices: The local replicas' devices, in replica order.
        rendezvous: Where the local replicas meet (one exchange per step, two in place).
        cross_device_ops: Sums the replicas' packed gradients onto ``devices[0]``; asked
            whether it can sum in place on ``devices``.
        cross_worker_all_reduce: ``fn(tensor, ReduceOp.SUM) -> tensor`` summing across
            workers (the identity in one process); called by the last replica to arrive.
        policy: The strategy's variable policy: says which parameters are distributed and
            installs the sums as the replicas' gradients.
        num_workers: The number of workers taking part in each step, read at the first
            step (a multi-worker strategy knows it only after this object is made).
    """

    def __init__(
        self,
        *,
        devices: Sequence[torch.device],
        rendezvous: Rendezvous,
        cross_device_ops: CrossDeviceOps,
        cross_worker_all_reduce: CrossWorkerReduce,
        policy: VariablePolicy,
        num_workers: Callable[[], int],
    ) -> None:
        self._devices = tuple(devices)
        self._rendezvous = rendezvous
        self._ops = cross_device_ops
        self._cross_worker_all_reduce = cross_worker_all_reduce
        self._policy = policy
        self._owner = policy.strategy  # whose variables the optimizer must hold
        self._num_workers = num_workers
        # (replicas in sync, whether they sum in place): fixed once the first step runs, as
        # the devices, the ops and the workers are; decided then, not at every step.
        self._layout: tuple[int, bool] | None = None

    def _distributed_params(self, optimizer: torch.optim.Optimizer) -> list[DistributedVariable]:
        params: list[DistributedVariable] = []
        owner = self._owner
        for group in optimizer.param_groups:
            for p in group["params"]:
                # policy.owns(p), inlined: this runs for every parameter at every step
                if isinstance(p, DistributedVariable) and p._strategy is owner:
                    params.append(p)
                elif len(self._devices) > 1:
                    from phalanx.nn._scope_copies import describe_foreign  # error path only

                    raise RuntimeError(
                        f"optimizer.step() inside {owner!r}.run got a parameter that is not one of "
                        "the strategy's variables, so every replica would update it once. Received: "
                        f"{describe_foreign(p, owner)}. HINT: create the model and the optimizer "
                        "inside `with strategy.scope():`; copy modules inside it too."
                    )
        return params

    def _decide_layout(self) -> tuple[int, bool]:
        """The replicas in sync, and whether they sum in place: one worker, and cross-device
        ops that can sum in place on these devices."""
        workers = self._num_workers()
        in_place = workers == 1 and self._ops.can_sum_in_place(self._devices)
        return len(self._devices) * workers, in_place

    def before_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Sums gradients across replicas before the step (every replica calls it; blocks
        until all local replicas arrive, and across workers for the cross-worker sum).

        Raises:
            RuntimeError: A parameter of the optimizer was not created in the strategy's scope.
            NotImplementedError: Sparse gradients where they cannot be summed in place.
        """
        layout = self._layout
        if layout is None:
            layout = self._layout = self._decide_layout()
        replicas_in_sync, in_place = layout
        if replicas_in_sync == 1:
            set_in_optimizer_step(True)  # nothing to sum; the update itself may write variables
            if self._policy.has_variables:  # one replica of a distributed strategy
                params = self._distributed_params(optimizer)
                none = [p._replica_leaf(0).grad is None for p in params]
                self._policy.install_summed_in_place(params, none, 0)
            return
        params = self._distributed_params(optimizer)
        if not params:
            return
        like = [p._replica_leaf(index) for p in params]
        if in_place:
            all_none = self._sum_in_place(optimizer, index, like)
            self._policy.install_summed_in_place(params, all_none, index)
            set_in_optimizer_step(True)
            return
        grads = [c.grad for c in like]
        if any(g is not None and g.is_sparse for g in grads):
            raise NotImplementedError(
                f"Sparse gradients (nn.Embedding(sparse=True)) are summed by {self._owner!r} "
                "only with CPU replicas of one worker and the default cross-device ops. HINT: "
                "use sparse=False, or CPU replicas."
            )
        packed = pack(grads, like)
        none_mask = [g is None for g in grads]
        reduced, all_none = self._rendezvous.exchange(
            index,
            (packed, none_mask),
            lambda values: self._lead(optimizer, values),
            what="optimizer.step()",
        )
        self._policy.install_gradients(params, reduced, all_none, index, spec_of(like))
        set_in_optimizer_step(True)

    def _per_replica_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Gives each replica its own optimizer state (at the first step; the last replica to
        arrive calls it, and only while ``optimizer.state`` is not yet a `PerReplicaState`)."""
        state = PerReplicaState(optimizer.state, self._owner, self._devices)
        optimizer.state = state  # type: ignore[assignment]

    def _sum_in_place(
        self, optimizer: torch.optim.Optimizer, index: int, leaves: list[torch.Tensor]
    ) -> list[bool]:
        """All replicas share one memory: replica i sums slice i of every gradient over all
        replicas and writes the sum back into each replica's gradient (a reduce-scatter and
        all-gather done by plain memory copies, in parallel, with no packing).

        Returns:
            Per parameter, whether no replica had a gradient (it stays None).
        """
        n = len(self._devices)
        mask = [leaf.grad is None for leaf in leaves]
        for leaf, missing in zip(leaves, mask, strict=True):
            if missing:
                leaf.grad = torch.zeros_like(leaf)

        def lead(values: list[Any]) -> list[Any]:
            if not isinstance(optimizer.state, PerReplicaState):
                self._per_replica_state(optimizer)
            return values

        values = self._rendezvous.exchange(
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
        sparse = self._rendezvous.exchange(index, whole, _merge_dicts, what="optimizer.step() (gradient sum)")
        for k, total in sparse.items():
            leaves[k].grad = total.clone()
        return [all(v[1][k] for v in values) for k in range(len(leaves))]

    def _lead(
        self, optimizer: torch.optim.Optimizer, values: list[Any]
    ) -> tuple[dict[torch.dtype, torch.Tensor], list[bool]]:
        if not isinstance(optimizer.state, PerReplicaState):
            self._per_replica_state(optimizer)
        all_none = [all(mask[k] for _, mask in values) for k in range(len(values[0][1]))]
        home = self._devices[0]
        reduced = {}
        for dtype in values[0][0]:
            total = self._ops.reduce_to(ReduceOp.SUM, [v[0][dtype] for v in values], home)
            reduced[dtype] = self._cross_worker_all_reduce(total, ReduceOp.SUM)
        return reduced, all_none

    def after_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Ends the step's write permission; lets the policy finish the step (all replicas)."""
        set_in_optimizer_step(False)
        if self._policy.has_variables and self._distributed_params(optimizer):
            self._policy.after_optimizer_step(index)

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
