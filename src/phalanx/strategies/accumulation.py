"""Gradient accumulation: backward passes that only accumulate, and the one that sums.

A strategy's ``no_sync()`` marks the ``run`` calls inside it as *accumulate-only*: their
backward passes add to each replica's local ``.grad`` and nothing moves between replicas or
workers; the next backward pass outside it sums everything accumulated since the last sum,
across every replica and worker, exactly once. With ``k`` micro-batches of global batch
``B`` (losses scaled by ``B``, as `phalanx.nn.compute_average_loss` does) and the first
``k - 1`` runs inside ``no_sync()``, the gradients at the step are ``k`` times the mean
gradient of the ``k * B`` examples; divide the loss by ``k`` (or the learning rate) to take
the step of global batch ``k * B``::

    for i, batch in enumerate(dist_dataset):
        last = (i + 1) % k == 0
        with contextlib.nullcontext() if last else strategy.no_sync():
            strategy.run(backward_step, args=(batch,))   # loss / k, backward(), no step
        if last:
            strategy.run(apply_step)                      # optimizer.step(), zero_grad()

Why a switch on the strategy, entered around ``run`` (and not DDP's ``model.no_sync()``):
in phalanx the strategy, not a model wrapper, owns every gradient path (in-process replica
sums, MultiWorkerMirrored's buckets, FSDP2's reduce-scatters, the ps workers' pushes), a
user's loop calls ``strategy.run`` and not a wrapped model, and one ``run`` is one step of
every replica: the switch is decided once per ``run`` so all replicas and workers agree.

Every strategy honours the one switch (`SyncSwitch`) through its gradient paths:

* in-process replicas and MultiWorkerMirrored's buckets: the round engine's accumulate-only
  rounds (`phalanx.communication.engine.rounds`) keep the deltas local and hand their sum to the
  next synchronised round;
* FullyShardedStrategy: FSDP2's own ``set_requires_gradient_sync(False)`` on its units;
* one replica in one process (default, OneDevice) and parameter-server workers: nothing
  moves during backward anyway (a ps worker pushes once, at ``optimizer.step()``).

``optimizer.step()`` inside ``no_sync()`` is refused: it would apply gradients that are not
summed.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["SyncSwitch", "pending_error"]


class SyncSwitch:
    """Whether a strategy's backward passes sum across replicas and workers now.

    One per strategy. ``no_sync()`` is entered and left by the thread that calls ``run``
    (cross-replica context, every worker alike); the replicas' gradient paths read
    ``syncing()`` when a backward pass opens.

    Gradient paths that keep a switch of their own (FSDP2's) read ``syncing()`` before each
    ``run``. The switch holds no reference to its strategy: the round engine's hooks on the
    parameters hold ``syncing``, and must not keep the strategy alive.

    Args:
        owner: Names the strategy in error messages.
    """

    def __init__(self, owner: str) -> None:
        self._owner = owner
        self._depth = 0
        self._lock = threading.Lock()

    def syncing(self) -> bool:
        """False inside ``no_sync()``: backward passes only accumulate."""
        return self._depth == 0

    @contextlib.contextmanager
    def no_sync(self, in_replica_context: bool) -> Iterator[None]:
        """Backward passes of the ``run`` calls inside only accumulate (see module docstring).

        Args:
            in_replica_context: Whether the caller is inside ``run`` (refused).

        Raises:
            RuntimeError: Entered inside ``run`` (in a replica's function).
        """
        if in_replica_context:
            raise RuntimeError(
                f"{self._owner}.no_sync() must be entered around strategy.run, in cross-replica "
                "context: every replica and worker must agree on which backward passes only "
                "accumulate. Received: a call inside strategy.run. HINT: `with strategy.no_sync(): "
                "strategy.run(step_fn, args=...)`."
            )
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1

    def check_step(self) -> None:
        """Refuses ``optimizer.step()`` while backward passes only accumulate (every replica).

        Raises:
            RuntimeError: Called inside ``no_sync()``.
        """
        if self._depth:
            raise RuntimeError(
                f"optimizer.step() ran inside {self._owner}.no_sync(): the gradients there are "
                "only this replica's local sums, so each replica or worker would apply different "
                "ones. Received: a step while no_sync() is active. HINT: run the last backward "
                "pass of the accumulation, and the step, outside no_sync()."
            )


def pending_error(owner: str) -> RuntimeError:
    """The error of a step whose gradients accumulate-only passes left unsummed."""
    return RuntimeError(
        f"optimizer.step() under {owner} found gradients that backward passes inside "
        "strategy.no_sync() accumulated and no backward pass outside it has summed across "
        "replicas and workers yet. Received: a step after accumulate-only passes only. HINT: run "
        "the last micro-batch's backward pass outside no_sync(), before the step."
    )
