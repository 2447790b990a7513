"""``Model.fit``'s epoch under an elastic MultiWorkerMirroredStrategy: survives lost workers and
admits joiners at step boundaries (`phalanx.checkpoint.failure_handling.elastic`).

The global batch is kept: after a membership change every global batch is split among the
members there are now (each replica's share grows when a worker is lost). The position is the
chief's: after a re-form every member continues at the chief's next step, re-reading the epoch
from there (`DataHandler.epoch(epoch, skip)`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.checkpoint._objects import load_into, state_of
from phalanx.checkpoint.failure_handling.elastic import ElasticSync, is_recoverable
from phalanx.keras._epoch import Epoch

if TYPE_CHECKING:
    from phalanx.keras.data_adapter import DataHandler

__all__ = ["MoveTo", "elastic_sync_of", "elastic_train_epoch"]

_END = object()  # the epoch has no batch left


class MoveTo(Exception):  # noqa: N818 - control flow, not an error
    """The chief is in another epoch: fit continues at ``(epoch, step)``."""

    def __init__(self, epoch: int, step: int) -> None:
        super().__init__(f"continue at epoch {epoch}, step {step}")
        self.epoch, self.step = epoch, step


class _FitState:
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


def elastic_sync_of(model: Any) -> tuple[ElasticSync, _FitState]:
    """The model's elastic protocol for this fit (made once per model)."""
    found = getattr(model, "_elastic_sync", None)
    if found is None or found[0].strategy is not model.strategy:
        state = _FitState(model)
        found = (ElasticSync(model.strategy, state.get, state.set), state)
        object.__setattr__(model, "_elastic_sync", found)
    return found  # type: ignore[no-any-return]


def elastic_train_epoch(
    model: Any, handler: DataHandler, epoch: int, skip: int, callbacks: Any
) -> dict[str, float]:
    """`train_epoch` of an elastic job (every member).

    Raises:
        MoveTo: The chief's state is in another epoch (after a re-form).
        BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
    """
    sync, state = elastic_sync_of(model)
    state.epoch, state.next_step, state.run_count = epoch, skip, model.strategy.run_count
    state.callbacks = list(getattr(callbacks, "callbacks", []))
    iterator = _batches(model, handler, epoch, skip)
    while True:
        try:
            # the epoch's logs are a collective: every member makes it at the epoch's end,
            # whatever it did in this call (one handed the chief's state at the epoch's last
            # boundary, a joiner, ran no step here); a loss there is survived like one in a step
            if model.stop_training:  # a callback stopped the training after the last step
                return model._logs()  # type: ignore[no-any-return]
            if sync.boundary():
                iterator = _reposition(model, handler, state, epoch)
            batch = next(iterator, _END)
            if batch is _END:
                return model._logs()  # type: ignore[no-any-return]
            step = state.next_step
            callbacks.on_train_batch_begin(step)
            model.strategy.run(model._train_step, args=batch)
            sync.step_done()
            state.next_step = model._steps_done = step + 1
            state.run_count = model.strategy.run_count
            callbacks.on_train_batch_end(step, model._logs())
        except Exception as exc:
            if not is_recoverable(model.strategy, exc):
                raise
            sync.recover(exc)
            iterator = _reposition(model, handler, state, epoch)


def _batches(model: Any, handler: DataHandler, epoch: int, skip: int) -> Any:
    return iter(model.strategy.experimental_distribute_dataset(Epoch(handler.epoch(epoch, skip))))


def _reposition(model: Any, handler: DataHandler, state: _FitState, epoch: int) -> Any:
    """The batches from the chief's position (this epoch), or `MoveTo` another epoch."""
    if state.epoch != epoch:
        raise MoveTo(state.epoch, state.next_step)
    return _batches(model, handler, epoch, state.next_step)
