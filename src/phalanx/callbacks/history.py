"""History: every epoch's logs; `Model.fit` returns it."""

from __future__ import annotations

from typing import Any

from phalanx.callbacks.callback import Callback, Logs

__all__ = ["History"]


class History(Callback):
    """Records ``history[key]`` (one value per epoch) and the ``epoch`` indices.

    It becomes ``model.history`` as soon as it is bound to the model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def set_model(self, model: Any) -> None:
        """Binds to ``model`` and sets ``model.history``."""
        super().set_model(model)
        model.history = self

    def on_train_begin(self, logs: Logs = None) -> None:
        """Starts a new list of epochs (the history keeps growing, as in Keras)."""
        self.epoch = []

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        """Appends the epoch's logs."""
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)
        if self.model is not None:
            self.model.history = self
