"""The fit / evaluate / predict loops: global batches in, `strategy.run` per step, global logs out."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from phalanx.checkpoint.failure_handling.elastic import is_recoverable
from phalanx.keras._elastic_loop import elastic_sync_of, elastic_train_epoch
from phalanx.keras._epoch import Epoch

if TYPE_CHECKING:
    from phalanx.keras.data_adapter import DataHandler

__all__ = ["LoopModel", "evaluate_loop", "predict_loop", "train_epoch", "validation_pass"]


class LoopModel(Protocol):
    """What the loops use of a `phalanx.keras.Model` (the one implementation), named here so
    this module does not import model.py, which imports it."""

    stop_training: bool
    training: bool
    _steps_done: int

    @property
    def strategy(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...
    def eval(self) -> Any: ...
    def _logs(self) -> dict[str, float]: ...
    def _train_step(self, x: Any, y: Any, sample_weight: Any = None) -> None: ...
    def _test_step(self, x: Any, y: Any, sample_weight: Any = None) -> None: ...
    def _predict_step(self, x: Any, y: Any = None, sample_weight: Any = None) -> Any: ...
    def _reset_metrics(self) -> None: ...


def _distributed(model: LoopModel, handler: DataHandler, epoch: int, skip: int) -> Any:
    return model.strategy.experimental_distribute_dataset(Epoch(handler.epoch(epoch, skip)))


def train_epoch(
    model: LoopModel, handler: DataHandler, epoch: int, skip: int, callbacks: Any
) -> dict[str, float]:
    """Trains one epoch from step ``skip``; returns the epoch's global logs."""
    strategy = model.strategy
    if strategy._schedules_steps:
        return _scheduled_train_epoch(model, handler, epoch, skip, callbacks)
    if getattr(strategy, "membership", None) is not None:  # an elastic MultiWorkerMirrored job
        return elastic_train_epoch(model, handler, epoch, skip, callbacks)
    logs: dict[str, float] = {}
    for step, batch in enumerate(_distributed(model, handler, epoch, skip), start=skip):
        callbacks.on_train_batch_begin(step)
        strategy.run(model._train_step, args=batch)
        model._steps_done = step + 1
        logs = model._logs()
        callbacks.on_train_batch_end(step, logs)
        if model.stop_training:
            break
    return logs or model._logs()


def _scheduled_train_epoch(
    model: LoopModel, handler: DataHandler, epoch: int, skip: int, callbacks: Any
) -> dict[str, float]:
    """One epoch under a strategy whose steps run on remote workers (ParameterServerStrategy):
    every global batch becomes a function scheduled on some worker, asynchronously; the epoch
    ends when all have run. Batch callbacks see the logs of the last finished epoch (as with
    TF, per-batch metrics are not fetched while steps are in flight)."""
    from phalanx.coordinator import ClusterCoordinator

    strategy = model.strategy
    coordinator = strategy.cluster_coordinator or ClusterCoordinator(strategy)  # type: ignore[attr-defined]
    last = dict(getattr(model, "_last_epoch_logs", {}))
    for step, batch in enumerate(handler.epoch(epoch, skip), start=skip):
        callbacks.on_train_batch_begin(step)
        coordinator.schedule(_train_step_on_worker, args=(model, batch))
        model._steps_done = step + 1
        callbacks.on_train_batch_end(step, last)
        if model.stop_training:
            break
    coordinator.join()  # the coordinator's copies (metrics included) now hold the ps values
    logs = model._logs()
    object.__setattr__(model, "_last_epoch_logs", logs)
    return logs


def _train_step_on_worker(model: LoopModel, batch: tuple[Any, ...]) -> None:
    """Runs on a worker: the model, its optimizer and metrics resolve to the worker's copies."""
    model.strategy.run(model._train_step, args=batch)


def evaluate_loop(model: LoopModel, handler: DataHandler, callbacks: Any) -> dict[str, float]:
    """Runs the test step over one pass of ``handler``; returns global logs."""
    strategy = model.strategy
    model._reset_metrics()
    callbacks.on_test_begin()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step, batch in enumerate(_distributed(model, handler, 0, 0)):
                callbacks.on_test_batch_begin(step)
                strategy.run(model._test_step, args=batch)
                callbacks.on_test_batch_end(step, model._logs())
    finally:
        model.train(was_training)
    logs = model._logs()
    callbacks.on_test_end(logs)
    return logs


def validation_pass(model: LoopModel, handler: DataHandler, callbacks: Any) -> dict[str, float]:
    """``fit``'s validation pass: `evaluate_loop`. In an elastic job a worker lost during it
    makes the members re-form the group and run the pass again from its start, split over the
    members there are now: the pass changes no state, so the redo is exact and the same on
    every member (skipping it would leave the epoch without ``val_`` logs, which
    ``EarlyStopping`` and ``ModelCheckpoint`` read).

    Raises:
        BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
    """
    if getattr(model.strategy, "membership", None) is None:
        return evaluate_loop(model, handler, callbacks)
    sync, _ = elastic_sync_of(model)
    while True:
        try:
            return evaluate_loop(model, handler, callbacks)
        except Exception as exc:
            if not is_recoverable(model.strategy, exc):
                raise
            sync.recover(exc)


def predict_loop(model: LoopModel, handler: DataHandler, callbacks: Any) -> Any:
    """Predictions for every example, in input order, gathered over replicas and workers."""
    strategy = model.strategy
    outputs: list[Any] = []
    callbacks.on_predict_begin()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for step, batch in enumerate(_distributed(model, handler, 0, 0)):
                callbacks.on_predict_batch_begin(step)
                per_replica = strategy.run(model._predict_step, args=batch)
                gathered = strategy.gather(per_replica, axis=0)
                outputs.append(gathered)
                callbacks.on_predict_batch_end(step, {"outputs": gathered})
    finally:
        model.train(was_training)
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("predict got no data: the input is empty.")
    return _concat(outputs)


def _concat(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([o.cpu() for o in outputs], dim=0)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outputs]) for k in first}
    raise TypeError(f"predict outputs must be tensors or nests of them. Received: {type(first).__name__}.")
