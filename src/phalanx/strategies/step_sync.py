"""The step-synchronisation protocol: what a strategy does around ``optimizer.step()``.

`phalanx._hooks` calls these methods from torch's global optimizer-step hooks whenever an
optimizer steps inside ``strategy.run`` (a replica context). Each strategy holds one object
that satisfies `StepSync` (``Strategy._step_sync``):

* `phalanx.strategies._gradients.GradientSync`: in-process replicas meet and sum gradients
  (Mirrored, CentralStorage, MultiWorkerMirrored with several local replicas);
* MultiWorkerMirrored's bucket sync: waits for the gradient buckets all-reduced during backward;
* the parameter-server coordinator's: refuses steps (they belong in scheduled functions);
* the parameter-server worker's: pushes the gradients to the ps tasks.

See docs/architecture.md, "Extension points".
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["StepSync"]


class StepSync(Protocol):
    """Called around every ``optimizer.step()`` made in a replica context of the strategy."""

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Runs before the update (every local replica calls it, each on its own thread):
        makes ``.grad`` hold what the update must apply, or raises."""

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Runs after the update (every local replica)."""

    def reset_thread(self) -> None:
        """Clears this thread's step state when a replica's ``run`` ends (also after an error)."""
