"""The step-synchronisation protocol: what a strategy does around ``optimizer.step()``.

`StepSync` is defined with the other protocols between the layers (`phalanx.protocols`);
each strategy holds one object that satisfies it (``Strategy.step_sync``):

* `phalanx.strategies.replicas.gradients.GradientSync`: in-process replicas meet and sum gradients
  (Mirrored, CentralStorage, MultiWorkerMirrored with several local replicas);
* MultiWorkerMirrored's bucket sync: waits for the gradient buckets all-reduced during backward;
* the parameter-server coordinator's: refuses steps (they belong in scheduled functions);
* the parameter-server worker's: pushes the gradients to the ps tasks.

See docs/architecture.md, "Extension points".
"""

from __future__ import annotations

from phalanx.protocols import StepSync

__all__ = ["StepSync"]
