"""``Model.fit``'s epoch under an elastic MultiWorkerMirroredStrategy: survives lost workers and
admits joiners at step boundaries (`phalanx.checkpoint.failure_handling.elastic`).

The global batch is kept: after a membership change every global batch is split among the
members there are now (each replica's share grows when a worker is lost). The position is the
chief's: after a re-form every member continues at the chief's next step, re-reading the epoch
from there (`DataHandler.epoch(epoch, skip)`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from phalanx.checkpoint.failure_handling.elastic import is_recoverable
from phalanx.checkpoint.failure_handling.fit_state import FitState, elastic_sync_of
from phalanx.keras._epoch import Epoch
from phalanx.keras.data_adapter import DataHandler, pack_batch

__all__ = ["MoveTo", "elastic_train_epoch"]

_END = object()  # the epoch has no batch left


class MoveTo(Exception):  # noqa: N818 - control flow, not an error
    """The chief is in another epoch: fit continues at ``(epoch, step)``."""

    def __init__(self, epoch: int, step: int) -> None:
        super().__init__(f"continue at epoch {epoch}, step {step}")
        self.epoch, self.step = epoch, step


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
                return model.get_metrics_result()  # type: ignore[no-any-return]
            if sync.boundary():
                iterator = _reposition(model, handler, state, epoch)
            data = next(iterator, _END)
            if data is _END:
                return model.get_metrics_result()  # type: ignore[no-any-return]
            step = state.next_step
            callbacks.on_train_batch_begin(step)
            model.train_function(data)
            sync.step_done()
            state.next_step = step + 1
            state.run_count = model.strategy.run_count
            callbacks.on_train_batch_end(step, model.get_metrics_result())
        except Exception as exc:
            if not is_recoverable(model.strategy, exc):
                raise
            sync.recover(exc)
            iterator = _reposition(model, handler, state, epoch)


def _batches(model: Any, handler: DataHandler, epoch: int, skip: int) -> Iterator[Any]:
    """The epoch's distributed batches from step ``skip``, as the steps take them (`pack_batch`)."""
    batches = model.strategy.experimental_distribute_dataset(Epoch(handler.epoch(epoch, skip)))
    return (pack_batch(*batch) for batch in batches)


def _reposition(model: Any, handler: DataHandler, state: FitState, epoch: int) -> Any:
    """The batches from the chief's position (this epoch), or `MoveTo` another epoch."""
    if state.epoch != epoch:
        raise MoveTo(state.epoch, state.next_step)
    return _batches(model, handler, epoch, state.next_step)
