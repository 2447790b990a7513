"""What the chief of an elastic `Model.fit` hands a new member: weights, optimizer state,
counters, the position in the epoch and the callbacks' own counts (`FitState`), and the model's
elastic protocol for a fit (`elastic_sync_of`, used by the Keras loop and `BackupAndRestore`)."""

from __future__ import annotations

from typing import Any

from phalanx.checkpoint._objects import load_into, state_of
from phalanx.checkpoint.failure_handling.elastic import ElasticSync

__all__ = ["FitState", "elastic_sync_of"]


class FitState:
    """What the chief hands a new member: weights, optimizer, counters and the position."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.epoch, self.next_step = 0, 0
        self.run_count = model.strategy.run_count  # after the last step done (not one cut short)
        self.callbacks: list[Any] = []  # those of the running fit

    def get(self) -> dict[str, Any]:
        model = self.model
        return {
            "module": state_of(model.module),
            "optimizer": state_of(model.optimizer),
            "run_count": self.run_count,
            "epoch": self.epoch,
            "next_step": self.next_step,
            "callbacks": [_state_of_callback(c) for c in self.callbacks],
        }

    def set(self, state: dict[str, Any]) -> None:
        model = self.model
        load_into(model.module, state["module"], "module")
        load_into(model.optimizer, state["optimizer"], "optimizer")
        model.strategy.run_count = self.run_count = int(state["run_count"])
        self.epoch, self.next_step = int(state["epoch"]), int(state["next_step"])
        for callback, callback_state in zip(self.callbacks, state["callbacks"], strict=False):
            if callback_state is not None:
                callback.load_elastic_state(callback_state)


def _state_of_callback(callback: Any) -> Any:
    """What a callback counts across steps (``elastic_state()``; e.g. BackupAndRestore's batches
    since the last backup), so that every member saves at the same steps; None if nothing."""
    method = getattr(callback, "elastic_state", None)
    return method() if callable(method) else None


def elastic_sync_of(model: Any) -> tuple[ElasticSync, FitState]:
    """The model's elastic protocol for this fit (made once per model)."""
    found = getattr(model, "_elastic_sync", None)
    if found is None or found[0].strategy is not model.strategy:
        state = FitState(model)
        found = (ElasticSync(model.strategy, state.get, state.set), state)
        object.__setattr__(model, "_elastic_sync", found)
    return found  # type: ignore[no-any-return]
