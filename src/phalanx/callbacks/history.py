"""History: every epoch's logs, returned by `Model.fit`."""

from __future__ import annotations

from typing import Any

from phalanx.callbacks.callback import Callback, Logs

__all__ = ["History"]


class History(Callback):
    """Records ``history[key]`` per epoch and the ``epoch`` indices; set as ``model.history``."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, list[Any]] = {}
        self.epoch: list[int] = []

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        model.history = self

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        self.epoch.append(epoch)
        for key, value in (logs or {}).items():
            self.history.setdefault(key, []).append(value)
