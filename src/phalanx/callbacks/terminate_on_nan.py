"""TerminateOnNaN: stop training as soon as the loss is NaN or infinite."""

from __future__ import annotations

import math

from phalanx.callbacks.callback import Callback, Logs
from phalanx.strategies.workers.distributed_files import chief_print

__all__ = ["TerminateOnNaN"]


class TerminateOnNaN(Callback):
    """Sets ``model.stop_training`` when a batch's ``loss`` log is NaN or infinite.

    The logged loss is the global one, so every worker stops at the same step.
    """

    def on_batch_end(self, batch: int, logs: Logs = None) -> None:
        loss = (logs or {}).get("loss")
        if loss is not None and not math.isfinite(float(loss)):
            chief_print(self.model, f"Batch {batch}: Invalid loss, terminating training")
            self.model.stop_training = True
