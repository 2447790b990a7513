"""SidecarEvaluator: evaluates each checkpoint a training job writes, on a task of its own
(tf.keras.utils.SidecarEvaluator; the ``evaluator`` task of a cluster).

    evaluator = phalanx.SidecarEvaluator(model, data=(x_val, y_val), checkpoint_dir=dir,
                                         max_evaluations=5)
    evaluator.start()  # until the 5th checkpoint was evaluated

The training program saves with `phalanx.checkpoint.CheckpointManager` (the model under
the name ``"model"``); parameter-server training suits it well, as its coordinator trains
without stopping to evaluate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.checkpoint import Checkpoint
from phalanx.checkpoint.manager import latest_checkpoint

if TYPE_CHECKING:
    from phalanx.keras.model import Model

__all__ = ["SidecarEvaluator"]

log = logging.getLogger("phalanx")
LOG_EVERY_SECONDS = 60.0


class SidecarEvaluator:
    """Waits for new checkpoints in ``checkpoint_dir`` and evaluates each with ``model``.

    Args:
        model: A compiled `phalanx.Model` of the trained model's structure.
        data: The evaluation data: ``(x, y)``, ``(x, y, sample_weight)`` or what
            ``model.evaluate(x)`` takes.
        checkpoint_dir: Where the training job's `CheckpointManager` saves.
        steps: Evaluation steps per checkpoint (None: all the data).
        max_evaluations: Stop after this many evaluations (None: until ``timeout_seconds``).
        callbacks: Given to every ``model.evaluate``.
        checkpoint_key: The model's name in the checkpoint (``Checkpoint(model=...)``).
        poll_seconds: How often to look for a new checkpoint.
        timeout_seconds: Stop when no new checkpoint appeared for this long (None: wait for
            ever, logging every minute that it waits).
        clock, sleep: Time functions (fakes in tests).

    Raises:
        ValueError: ``model`` is not compiled, or a bound is not positive.
    """

    def __init__(
        self,
        model: Model,
        data: Any,
        checkpoint_dir: str,
        steps: int | None = None,
        max_evaluations: int | None = None,
        callbacks: list[Any] | None = None,
        checkpoint_key: str = "model",
        poll_seconds: float = 1.0,
        timeout_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not model.compiled:
            raise ValueError(
                "SidecarEvaluator needs a compiled model. HINT: model.compile(loss=..., metrics=[...]) "
                "with the training job's loss and metrics."
            )
        for name, value in (("max_evaluations", max_evaluations), ("timeout_seconds", timeout_seconds)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be positive or None. Received: {value!r}.")
        if not poll_seconds > 0:
            raise ValueError(f"poll_seconds must be positive. Received: {poll_seconds!r}.")
        self.model, self.data, self.checkpoint_dir = model, data, checkpoint_dir
        self.steps, self.max_evaluations, self.callbacks = steps, max_evaluations, callbacks
        self._checkpoint = Checkpoint(**{checkpoint_key: model})
        self._poll, self._timeout = poll_seconds, timeout_seconds
        self._clock, self._sleep = clock, sleep

    def start(self) -> list[dict[str, Any]]:
        """Evaluates new checkpoints until ``max_evaluations`` or ``timeout_seconds``.

        Returns:
            One ``{"checkpoint": path, **logs}`` per evaluation, in order.
        """
        results: list[dict[str, Any]] = []
        last: str | None = None
        since = last_log = self._clock()
        while self.max_evaluations is None or len(results) < self.max_evaluations:
            path = latest_checkpoint(self.checkpoint_dir)
            now = self._clock()
            if path is not None and path != last:
                results.append({"checkpoint": path, **self._evaluate(path)})
                last, since = path, self._clock()
                continue
            if self._timeout is not None and now - since >= self._timeout:
                log.warning(
                    "SidecarEvaluator: no new checkpoint in %s for %gs; stopping after %d evaluation(s).",
                    self.checkpoint_dir,
                    self._timeout,
                    len(results),
                )
                break
            if now - last_log >= LOG_EVERY_SECONDS:
                log.warning("SidecarEvaluator: waiting for a new checkpoint in %s.", self.checkpoint_dir)
                last_log = now
            self._sleep(self._poll)
        return results

    def _evaluate(self, path: str) -> dict[str, Any]:
        self._checkpoint.read(path)
        data = self.data if isinstance(self.data, tuple) else (self.data,)
        x, y, sample_weight = (*data, None, None)[:3]
        logs = self.model.evaluate(
            x,
            y,
            sample_weight=sample_weight,
            steps=self.steps,
            callbacks=self.callbacks,
            verbose=0,
            return_dict=True,
        )
        log.info("SidecarEvaluator: %s: %s", path, ", ".join(f"{k} {v:.4g}" for k, v in logs.items()))
        return dict(logs)
