"""MultiWorkerMirrored's DDP layout (one local replica per worker): its gradient buckets over the
workers' group, and its optimizer-step hook."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from phalanx.communication.compression import make_compressor
from phalanx.communication.compression.base import WHAT
from phalanx.communication.engine.bucketing import GradientBuckets
from phalanx.strategies.accumulation import pending_error
from phalanx.strategies.replicas.gradients import GradientSync
from phalanx.variables import DistributedVariable

__all__ = ["BucketSync", "group_buckets"]


def group_buckets(strategy: Any, group: Any) -> GradientBuckets:
    """The gradient buckets of ``strategy`` (a MultiWorkerMirroredStrategy) over its worker
    ``group``: all-reduced on the group's transport, announced a pass ahead where it can, active
    while the strategy runs a step (held weakly: the buckets' hooks must not keep it alive),
    compressed as its options ask (a new group, a new compressor: an elastic re-form starts
    error feedback afresh)."""
    me = weakref.ref(strategy)

    def is_active() -> bool:
        owner = me()
        return owner is not None and owner.running

    options = strategy.communication_options
    return GradientBuckets(
        # nothing another worker waits for is issued before the round's end waits for it
        lambda tensor: group.all_reduce_async(tensor, may_block=True, what=WHAT),
        group.wait,
        is_active,
        bucket_bytes=options.bytes_per_pack,
        sum_sparse=strategy.cross_worker_sparse_sum,
        workers=strategy.num_workers_in_sync,
        announce=lambda specs: group.announce_all_reduces(specs, tail=group.announced_tail),
        announce_tail=group.announced_tail,
        wait_at_end=lambda work, what: group.wait(work, what, where_issued=True),
        syncing=strategy.sync_switch.syncing,
        compressor=make_compressor(options.compression, group.world_size),
    )


class BucketSync:
    """The optimizer-step hook of the DDP layout (one local replica, several workers).

    The gradient buckets summed the plain parameters' gradients by the end of each backward
    pass; parameters kept as distributed variables (annotated ones) were summed by the
    in-process gradient path ``gradients`` at the same point. Before the step this checks
    that every parameter is one of them and lets ``gradients`` hand its sums over.

    Args:
        gradients: The strategy's in-process gradient path.
        buckets: The gradient buckets all-reduced while backward runs.
        owner: The strategy, named in error messages.
    """

    def __init__(self, gradients: GradientSync, buckets: GradientBuckets, owner: object) -> None:
        self._gradients = gradients
        self._buckets = buckets
        self._owner = owner
        self._checked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Checks the parameters; hands the summed gradients to the update (all workers)."""
        self._check_params(optimizer)
        if self._buckets.holds():
            raise pending_error(repr(self._owner))
        self._gradients.before_step(optimizer, replica_index)

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Ends the step (as the in-process gradient path does)."""
        self._gradients.after_step(optimizer, replica_index)

    def reset_thread(self) -> None:
        """Clears this thread's step state when its ``run`` ends."""
        self._gradients.reset_thread()

    def _check_params(self, optimizer: torch.optim.Optimizer) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if self._checked.get(optimizer) == len(params):
            return
        for p in params:
            if not isinstance(p, DistributedVariable) and not self._buckets.tracks(p):
                from phalanx.nn._scope_copies import describe_foreign  # error path only

                raise RuntimeError(
                    f"optimizer.step() inside {self._owner!r}.run got a parameter that is not "
                    "the strategy's, so its gradient would not be summed across workers and the "
                    f"workers would drift apart. Received: {describe_foreign(p, self._owner)}. "
                    "HINT: create the model and the optimizer inside `with strategy.scope():`; "
                    "copy modules inside it too."
                )
        self._checked[optimizer] = len(params)
