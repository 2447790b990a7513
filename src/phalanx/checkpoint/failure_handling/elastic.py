"""Step boundaries of an elastic MultiWorkerMirrored job: admitting joiners, recovering from a
lost worker, and handing every new member the chief's state (used by ``Model.fit`` and
`PreemptionCheckpointHandler.run`).

* **Joiners** are admitted at a step boundary: one small all-reduce (MAX) per step tells
  every member whether any of them sees a task waiting (`Membership.join_pending`); then all
  re-form together and the chief broadcasts its state.
* **A lost worker** makes a collective of the step fail on the survivors
  (`PeerUnavailableError`). Each survivor re-forms (`MultiWorkerMirroredStrategy.reform`), and
  the new chief (the lowest live task) broadcasts its state: the weights, the optimizer state,
  the counters and the position. Updates follow the gradient all-reduce, so a survivor whose
  step failed changed only gradients (which the next backward overwrites); a survivor whose
  step completed (the lost worker's bytes had arrived) is set back to, or forward to, the
  chief's state, so every survivor continues from one state and no step is applied twice.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError
from phalanx.communication.membership.membership import BelowMinimumWorkersError

__all__ = ["MAX_RECOVERIES", "ElasticSync", "is_recoverable"]

log = logging.getLogger("phalanx")

MAX_RECOVERIES = 10  # losses in a row, while re-forming, before a worker gives up


def is_recoverable(strategy: Any, exc: BaseException) -> bool:
    """Whether ``exc`` is a lost worker that an elastic ``strategy`` survives by re-forming."""
    return (
        getattr(strategy, "membership", None) is not None
        and isinstance(exc, PeerUnavailableError)
        and not isinstance(exc, (BelowMinimumWorkersError, CollectiveMismatchError))
    )


class ElasticSync:
    """The step-boundary protocol of one training loop (every member, at the same boundaries).

    Args:
        strategy: An elastic `MultiWorkerMirroredStrategy` (its ``membership`` is set).
        get_state: This worker's training state (picklable by ``torch.save``).
        set_state: Loads a state `get_state` returned on the chief (every member, the chief too).
    """

    def __init__(self, strategy: Any, get_state: Callable[[], Any], set_state: Callable[[Any], None]) -> None:
        self.strategy, self._get_state, self._set_state = strategy, get_state, set_state
        # a task that joined a running job (restarted, or late for the first group) takes the
        # chief's state at its first boundary
        self._needs_state = strategy.membership.joined
        self._synced = False  # the state was handed over and no step ran since
        self.last_loss_at: float | None = None
        self.recoveries = 0

    @property
    def joining(self) -> bool:
        """Whether this task joined a running job and has not taken the chief's state yet."""
        return self._needs_state

    def step_done(self) -> None:
        """Records that a step ran (the next boundary agrees on joiners again)."""
        self._synced = False

    def boundary(self) -> bool:
        """At a step boundary: takes the chief's state if this task just joined, and admits
        waiting joiners (all members). True when the state was replaced.

        Right after a handover (until `step_done`) a boundary does nothing, on every member:
        a joiner that moves to the chief's epoch reaches its first step through another
        boundary than the members, which go straight on to the step."""
        if self._needs_state:
            self._needs_state = False
            self.sync_state()
            return True
        if self._synced:
            return False
        group = self.strategy.worker_group
        flag = torch.tensor([int(self.strategy.membership.join_pending)], dtype=torch.int64)
        group.all_reduce(flag, torch.distributed.ReduceOp.MAX, what="the elastic join agreement")
        if not flag.item():
            return False
        self.strategy.reform()
        self.sync_state()
        return True

    def recover(self, exc: BaseException, admit: bool = True) -> None:
        """After ``exc`` (a lost worker) in a step: re-forms and takes the chief's state.
        ``admit=False``: the re-form admits no waiting joiner (an evaluation or prediction pass:
        a joiner meets the members at a training step boundary only).

        Raises:
            BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
        """
        self.last_loss_at = time.monotonic()
        for attempt in range(MAX_RECOVERIES):
            reason = str(exc).split(". HINT")[0]
            log.warning("%s re-forms the group after: %s", self.strategy.membership.own_name, reason)
            try:
                self.strategy.reform(admit=admit)
                self.sync_state()
                break
            except Exception as again:  # another worker lost while re-forming: once more
                if attempt == MAX_RECOVERIES - 1 or not is_recoverable(self.strategy, again):
                    raise
                exc = again
        self.recoveries += 1

    def sync_state(self) -> None:
        """Every member takes the chief's state: one broadcast of its size, one of its bytes."""
        group = self.strategy.worker_group
        payload = torch.zeros(0, dtype=torch.uint8)
        if group.rank == 0:
            buffer = io.BytesIO()
            torch.save(self._get_state(), buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        group.broadcast(size, 0, what="the size of the chief's state")
        if group.rank != 0:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        group.broadcast(payload, 0, what="the chief's state")
        # tensors and plain values only; the chief loads its own too (it sets back what a step
        # cut short had counted, such as the strategy's run count)
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
        self._set_state(state)
        self.strategy.handed_over()
        self._synced = True
