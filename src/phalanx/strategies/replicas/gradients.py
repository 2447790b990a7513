"""The gradient path of in-process replicas: sums at the end of every backward pass.

See docs/architecture.md, "The optimizer step", and `phalanx.strategies.replicas.backward_rounds`.

DDP's contract under every synchronous strategy: once ``backward()`` returns inside ``run``,
every replica's ``.grad`` holds the gradient summed over all replicas (and workers), so
clipping, unscaling or logging between backward and ``optimizer.step()`` acts on the sum,
and the step applies what ``.grad`` holds. At the end of each backward pass the replicas
meet (a merge point) and sum what this pass added to their gradients:

* when the cross-device ops can sum in place on the replicas' devices (CPU replicas of one
  worker, the default reduction), replica ``i`` sums slice ``i`` of every gradient over
  shared memory, no packing;
* otherwise every replica packs its gradients, the last to arrive sums the packs (and
  all-reduces them across workers) and each replica installs its own copy of the sum.

The optimizer step then only hands the gradients to the variable policy (CentralStorage
moves them to its central storage). A step whose gradients no backward pass made since
this optimizer's last step (gradients assigned by hand, as TF's ``apply_gradients`` takes
them) sums them at the step instead.

`GradientSync` receives every piece it uses (the devices, the rendezvous, the cross-device
ops, the cross-worker reduce and the variable policy) as constructor arguments; it reads
nothing else of the strategy.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx.communication.local.packing import pack, spec_of, unpack
from phalanx.communication.local.sparse import SPARSE, kind, plus, sum_sparse
from phalanx.strategies.accumulation import pending_error
from phalanx.strategies.replicas.backward_rounds import BackwardRounds
from phalanx.strategies.replicas.optimizer_state import PerReplicaState
from phalanx.values import ReduceOp
from phalanx.variables import DistributedVariable, set_in_optimizer_step

if TYPE_CHECKING:
    from phalanx.communication.local.cross_device_ops import CrossDeviceOps
    from phalanx.strategies.replicas.rendezvous import ReplicaRendezvous
    from phalanx.strategies.replicas.variable_policy import VariablePolicy

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
        cross_worker_sparse_sum: ``fn(sparse) -> sparse`` summing a sparse COO tensor
            across workers (default: the identity, one process).
        policy: The strategy's variable policy: says which parameters are distributed and
            installs the sums as the replicas' gradients.
        num_workers: The number of workers taking part in each step, read at the first
            step (a multi-worker strategy knows it only after this object is made).
        syncing: Whether a backward pass opening now sums (False inside the strategy's
            ``no_sync()``; `phalanx.strategies.accumulation`).
    """

    def __init__(
        self,
        *,
        devices: Sequence[torch.device],
        rendezvous: ReplicaRendezvous,
        cross_device_ops: CrossDeviceOps,
        cross_worker_all_reduce: CrossWorkerReduce,
        policy: VariablePolicy,
        num_workers: Callable[[], int],
        cross_worker_sparse_sum: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
        syncing: Callable[[], bool] = lambda: True,
    ) -> None:
        self._devices = tuple(devices)
        self._rendezvous = rendezvous
        self._ops = cross_device_ops
        self._cross_worker_all_reduce = cross_worker_all_reduce
        self._cross_worker_sparse_sum = cross_worker_sparse_sum
        self._policy = policy
        self._owner = policy.strategy  # whose variables the optimizer must hold
        self._num_workers = num_workers
        # (replicas in sync, whether they sum in place): fixed once the first step runs, as
        # the devices, the ops and the workers are; decided then, not at every step.
        self._layout: tuple[int, bool] | None = None
        self._rounds = BackwardRounds(len(self._devices), self._merge, self._alive_anywhere, syncing)
        # optimizer -> per replica, the rounds completed at its last step
        self._last_step: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[int]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def _alive_anywhere(self, alive: list[bool]) -> list[bool]:
        """Whether each slot is alive on some worker (all workers when there are several; blocks)."""
        if self._num_workers() == 1:
            return alive
        counts = self._cross_worker_all_reduce(torch.tensor(alive, dtype=torch.float32), ReduceOp.SUM)
        return [n > 0 for n in counts.tolist()]

    def _distributed_params(self, optimizer: torch.optim.Optimizer) -> list[DistributedVariable]:
        params: list[DistributedVariable] = []
        owner = self._owner
        for group in optimizer.param_groups:
            for p in group["params"]:
                # policy.owns(p), inlined: this runs for every parameter at every step
                if isinstance(p, DistributedVariable) and p.strategy is owner:
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
        ops that can sum in place on these devices (fixed once decided)."""
        layout = self._layout
        if layout is None:
            workers = self._num_workers()
            in_place = workers == 1 and self._ops.can_sum_in_place(self._devices)
            layout = self._layout = (len(self._devices) * workers, in_place)
        return layout

    def replicas_in_sync(self) -> int:
        """The replicas whose gradients this path sums (all workers'); fixed once asked
        (`Strategy.run` takes its lean path when it is 1)."""
        return self._decide_layout()[0]

    # ---------------------------------------------------------------- around run
    def prepare_run(self) -> None:
        """Hooks the replica leaves of new parameters and lets backward passes merge
        (before each ``run``, on the calling thread)."""
        if self._decide_layout()[0] > 1 and self._policy.has_variables:
            self._rounds.track(self._policy.variables())
            self._rounds.active = True

    def end_run(self) -> None:
        """Stops merging at the end of backward passes (after each ``run``, also after an
        error: rounds a failed backward left open give their gradients back). A run that did
        not merge (one replica in the job) opened no round: nothing to end."""
        if self._rounds.active:
            self._rounds.active = False
            self._rounds.abort()

    # ---------------------------------------------------------------- the merge point
    def _merge(
        self,
        index: int,
        leaves: list[torch.Tensor],
        bases: list[Any],
        deltas: list[Any],
        what: str = "the gradient sum at the end of backward()",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """Sums ``deltas`` over all replicas and sets each leaf's gradient to its base plus
        the sum (every local replica, each with its own leaves; blocks until all arrive, and
        across workers for the cross-worker sum). A leaf no replica has a delta for keeps
        its gradient. ``optimizer``: its state becomes per replica at the first step.

        """
        if self._decide_layout()[1]:
            totals = self._sum_in_place(index, deltas, what, optimizer)
        else:
            totals = self._sum_packed(index, leaves, deltas, what, optimizer)
        for leaf, base, total in zip(leaves, bases, totals, strict=True):
            if total is not None and leaf.requires_grad:  # not a dead variable's placeholder
                leaf.grad = plus(base, total)

    def _sum_in_place(
        self, index: int, deltas: list[Any], what: str, optimizer: torch.optim.Optimizer | None
    ) -> list[torch.Tensor | None]:
        """All replicas share one memory: replica i sums slice i of every delta over all
        replicas and writes it back into each (a reduce-scatter and all-gather by plain
        memory copies, in parallel, no packing). Returns each leaf's total (None: nobody had one)."""
        n = len(self._devices)
        values = self._rendezvous.exchange(index, deltas, self._lead_in_place(optimizer), what=what)
        whole: dict[int, torch.Tensor] = {}  # sums this replica made of sparse gradients
        sliced: list[list[torch.Tensor]] = []
        for k in range(len(deltas)):
            present = [v[k] for v in values if v[k] is not None]
            if not present:
                continue
            if all(g.layout == torch.strided and g.is_contiguous() for g in present):
                sliced.append(present)
            elif k % n == index:  # strided or sparse: one replica sums the whole tensor
                total = _sum_whole(present)
                if total is not None:
                    whole[k] = total
        _sum_slices(sliced, n, index)
        sparse = self._rendezvous.exchange(index, whole, _merge_dicts, what=f"{what} (gradient sum)")
        totals: list[torch.Tensor | None] = []
        for k, own in enumerate(deltas):
            if k in sparse:
                totals.append(sparse[k].clone())
            elif own is not None:
                totals.append(own)  # holds the sum now
            else:
                first = next((v[k] for v in values if v[k] is not None), None)
                totals.append(None if first is None else first.clone())
        return totals

    def _lead_in_place(self, optimizer: torch.optim.Optimizer | None) -> Callable[[list[Any]], list[Any]]:
        def lead(values: list[Any]) -> list[Any]:
            if optimizer is not None and not isinstance(optimizer.state, PerReplicaState):
                self._per_replica_state(optimizer)
            return values

        return lead

    def _sum_packed(
        self,
        index: int,
        leaves: list[torch.Tensor],
        deltas: list[Any],
        what: str,
        optimizer: torch.optim.Optimizer | None,
    ) -> list[torch.Tensor | None]:
        """Packs the deltas; the last replica to arrive sums the packs over the replicas and
        across workers; each replica takes its own copy (views of one buffer per dtype).
        Sparse deltas are summed apart (`phalanx.communication.local.sparse`)."""
        dense = [None if d is None or d.is_sparse else d for d in deltas]
        mine = (pack(dense, leaves), [kind(d) for d in deltas], deltas)
        copies, kinds, sparse = self._rendezvous.exchange(
            index, mine, lambda values: self._lead_packed(optimizer, leaves, values), what=what
        )
        views = unpack(copies[index], spec_of(leaves))
        totals: list[torch.Tensor | None] = []
        for k, view in enumerate(views):
            if k in sparse[index]:
                totals.append(sparse[index][k])
            else:
                totals.append(None if kinds[k] == 0 else view)
        return totals

    def _lead_packed(
        self, optimizer: torch.optim.Optimizer | None, leaves: list[torch.Tensor], values: list[Any]
    ) -> tuple[list[dict[torch.dtype, torch.Tensor]], list[float], list[dict[int, torch.Tensor]]]:
        """Sums the packs (the last replica to arrive) and makes every replica's own copy
        before any replica goes on: a replica may edit its gradients in place as soon as
        its backward returns, so none may still be copying from another's buffer.

        Returns:
            Per replica its copy of the sums; per gradient its kind summed over all replicas
            of all workers (0: nobody has one); per replica its copies of the sparse sums.
        """
        if optimizer is not None and not isinstance(optimizer.state, PerReplicaState):
            self._per_replica_state(optimizer)
        home = self._devices[0]
        # one more small collective: every worker must agree on who has what
        local_kinds = torch.tensor([v[1] for v in values], dtype=torch.float64).sum(0)  # (num_gradients,)
        kinds = self._cross_worker_all_reduce(local_kinds, ReduceOp.SUM).tolist()
        reduced = {}
        for dtype in values[0][0]:
            total = self._ops.reduce_to(ReduceOp.SUM, [v[0][dtype] for v in values], home)
            reduced[dtype] = self._cross_worker_all_reduce(total, ReduceOp.SUM)
        sparse = {
            k: sum_sparse([v[2][k] for v in values], leaves[k], home, self._cross_worker_sparse_sum)
            for k in range(len(leaves))
            if kinds[k] >= SPARSE
        }
        copies = [
            {k: b if i == 0 and b.device == d else b.to(d, copy=True) for k, b in reduced.items()}
            for i, d in enumerate(self._devices)
        ]
        sparse_copies = [{k: t.to(d, copy=True) for k, t in sparse.items()} for d in self._devices]
        return copies, kinds, sparse_copies

    def _per_replica_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Gives each replica its own optimizer state (at the first step; the last replica to
        arrive calls it, and only while ``optimizer.state`` is not yet a `PerReplicaState`)."""
        state = PerReplicaState(optimizer.state, self._owner, self._devices)
        optimizer.state = state  # type: ignore[assignment]
        _prefer_foreach(optimizer)

    # ---------------------------------------------------------------- the step
    def before_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Hands the summed gradients to the update (every replica calls it).

        After a backward pass inside ``run`` the gradients are already summed; otherwise
        (gradients assigned by hand) they are summed here (blocks until all local replicas
        arrive, and across workers for the cross-worker sum).

        Raises:
            RuntimeError: A parameter of the optimizer was not created in the strategy's scope.
        """
        replicas_in_sync, _ = self._decide_layout()
        if replicas_in_sync == 1:
            # nothing to sum; the update itself may write variables (none: nothing reads the flag)
            if self._policy.has_variables:  # one replica of a distributed strategy
                set_in_optimizer_step(True)
                params = self._distributed_params(optimizer)
                none = [p.replica_leaf(0).grad is None for p in params]
                self._policy.install_summed_in_place(params, none, 0)
            return
        params = self._distributed_params(optimizer)
        if not params:
            return
        if self._rounds.holds(index):
            raise pending_error(repr(self._owner))
        leaves = [p.replica_leaf(index) for p in params]
        if self._summed_since_last_step(optimizer, index):
            if not isinstance(optimizer.state, PerReplicaState):  # the first step: all replicas
                self._rendezvous.exchange(
                    index, None, self._lead_in_place(optimizer), what="optimizer.step()"
                )
        else:
            grads = [leaf.grad for leaf in leaves]
            self._merge(index, leaves, [None] * len(leaves), grads, "optimizer.step()", optimizer)
        none = [leaf.grad is None for leaf in leaves]
        self._policy.install_summed_in_place(params, none, index)
        set_in_optimizer_step(True)

    def _summed_since_last_step(self, optimizer: torch.optim.Optimizer, index: int) -> bool:
        """Whether a backward pass summed this replica's gradients since ``optimizer``'s
        last step (and notes this step)."""
        done = self._rounds.completed(index)
        with self._lock:
            seen = self._last_step.get(optimizer)
            if seen is None:
                seen = self._last_step[optimizer] = [0] * len(self._devices)
        fresh = seen[index] != done
        seen[index] = done
        return fresh

    def after_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Ends the step's write permission; lets the policy finish the step (all replicas)."""
        if self._policy.has_variables:  # else `before_step` set no flag (nothing reads it)
            set_in_optimizer_step(False)
            if self._distributed_params(optimizer):
                self._policy.after_optimizer_step(index)

    def reset_thread(self) -> None:
        """Clears per-thread step state after a replica's run ends (also after an error)."""
        set_in_optimizer_step(False)


def _sum_slices(per_param: list[list[torch.Tensor]], n: int, index: int) -> None:
    """For each parameter's contiguous gradients (one per replica that has one), writes the
    sum of slice ``index`` (of ``n``, ``tensor_split``'s slices) into all of them.

    Adds in replica order, as one tensor at a time would, but with one foreach call per
    operation for all parameters (a model of many small parameters paid ~10 us of Python
    per parameter per replica at every step)."""
    columns: dict[int, list[list[torch.Tensor]]] = {}  # replicas present -> per replica, its slices
    for grads in per_param:
        q, r = divmod(grads[0].numel(), n)
        length = q + (1 if index < r else 0)
        if length == 0:
            continue
        start = index * q + min(index, r)
        column = columns.setdefault(len(grads), [[] for _ in grads])
        for j, g in enumerate(grads):
            column[j].append(g.view(-1).narrow(0, start, length))
    for column in columns.values():
        for other in column[1:]:
            torch._foreach_add_(column[0], other)
        for other in column[1:]:
            torch._foreach_copy_(other, column[0])


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


# torch.optim classes whose foreach update gives the per-tensor update's numbers bit for bit
# on CPU (checked; NAdam, RAdam and ASGD differ in the last bits and keep torch's default)
_SAME_NUMBERS_FOREACH = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Adamax,
    torch.optim.Rprop,
)


def _prefer_foreach(optimizer: torch.optim.Optimizer) -> None:
    """Has ``optimizer`` update with foreach kernels where its user left the choice to torch.

    With several replicas every torch call the update makes on a variable is a Python
    dispatch to the replica's component; foreach makes one call per operation for all
    parameters instead of one per parameter (AdamW over 27 parameters: ~270 dispatches per
    replica per step become ~15). torch's own default on CPU is the per-tensor loop.
    """
    if type(optimizer) not in _SAME_NUMBERS_FOREACH:
        return
    for group in optimizer.param_groups:
        if group.get("foreach", False) is None and not group.get("fused") and not group.get("differentiable"):
            group["foreach"] = True


def _merge_dicts(values: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    return {k: v for d in values for k, v in d.items()}
