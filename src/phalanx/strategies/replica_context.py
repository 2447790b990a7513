"""ReplicaContext: what code running inside `Strategy.run` sees (tf.distribute.ReplicaContext)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from phalanx import context
from phalanx.strategies.replicas.collectives import all_gather_structure, all_reduce_structure
from phalanx.values import ReduceOp, regroup, select_replica

if TYPE_CHECKING:
    from phalanx.communication.local.options import CommunicationOptions
    from phalanx.protocols import DistributionStrategy

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """The context of one replica inside `Strategy.run`.

    Args:
        strategy: The strategy running the replica.
        local_replica_index: The replica's index among this process's replicas.
    """

    def __init__(self, strategy: DistributionStrategy, local_replica_index: int) -> None:
        self._strategy = strategy
        self.local_replica_index = local_replica_index
        # Global examples of the step being run, when the distributed input knows it.
        self._global_batch_size: int | None = None
        # Global index of this replica's first example in the step (for keyed dropout).
        self._example_offset = 0
        self._dropout_calls = 0

    @property
    def strategy(self) -> DistributionStrategy:
        """The strategy this replica belongs to."""
        return self._strategy

    # ------------------------------------------------------------------ the step being run
    # Set by `Strategy.run` for each step; read by the loss helpers and keyed dropout.
    def begin_step(self, global_batch_size: int | None, example_offset: int) -> None:
        """Starts a step (called by `Strategy.run` before the replica's function): the step's
        global example count if the distributed input knows it, and the global index of this
        replica's first example."""
        self._global_batch_size = global_batch_size
        self._example_offset = example_offset
        self._dropout_calls = 0

    def end_step(self) -> None:
        """Forgets the step's global batch size (called by `Strategy.run` after a one-replica
        step: that replica context is also the one code outside any run sees)."""
        self._global_batch_size = None

    @property
    def global_batch_size(self) -> int | None:
        """Global examples of the step being run, when the distributed input knows it, else
        None (`phalanx.compute_average_loss` then counts the replicas' batches)."""
        return self._global_batch_size

    @property
    def example_offset(self) -> int:
        """The global index of this replica's first example in the step (keyed dropout)."""
        return self._example_offset

    def next_dropout_call(self) -> int:
        """The index of this keyed dropout call among the replica's calls in the step (0, 1, ...;
        `phalanx.nn.dropout`): the same on every replica, so masks agree across replica counts."""
        call = self._dropout_calls
        self._dropout_calls = call + 1
        return call

    @property
    def at_rest(self) -> bool:
        """Whether `begin_step(None, 0)` would change nothing (no global batch size, offset 0,
        no dropout call counted): the lean one-replica `run` then skips it."""
        return self._global_batch_size is None and self._example_offset == 0 and self._dropout_calls == 0

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas across all workers that take part in each step."""
        return self._strategy.num_replicas_in_sync

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's index among all replicas of all workers."""
        return self._strategy.first_replica_id + self.local_replica_index

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The device this replica computes on."""
        return (self._strategy.local_devices[self.local_replica_index],)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context (all replicas).

        Blocks until every local replica calls it; arguments of all replicas are regrouped
        into `PerReplica` values. Each replica receives its component of the result.
        """
        if not isinstance(args, (tuple, list)):
            raise TypeError(f"merge_call args must be a tuple or list. Received: {type(args).__name__}.")
        strategy = self._strategy

        def lead(values: list[Any]) -> Any:
            merged_args, merged_kwargs = regroup(values)
            with context.push_frame(strategy, None):
                return merge_fn(strategy, *merged_args, **(merged_kwargs or {}))

        result = strategy.rendezvous.exchange(
            self.local_replica_index, (tuple(args), kwargs or {}), lead, what="merge_call"
        )
        return select_replica(self.local_replica_index, result)

    def all_reduce(
        self, reduce_op: ReduceOp | str, value: Any, options: CommunicationOptions | None = None
    ) -> Any:
        """Reduces ``value`` across all replicas; every replica gets the result (all replicas).

        Differentiable: the gradient of a SUM all-reduce is the SUM all-reduce of the
        gradients (MEAN divides both ways by the replica count). ``value`` may be a nested
        structure of tensors; same shapes and dtypes on every replica.
        """
        return all_reduce_structure(
            self._strategy, self.local_replica_index, ReduceOp.coerce(reduce_op), value, options
        )

    def all_gather(self, value: Any, axis: int, options: CommunicationOptions | None = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis``, in replica order (all replicas).

        Shapes may differ along ``axis`` only. Differentiable: each replica's gradient is its
        slice of the summed gradient.
        """
        return all_gather_structure(self._strategy, self.local_replica_index, value, axis, options)

    def __repr__(self) -> str:
        return (
            f"ReplicaContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
