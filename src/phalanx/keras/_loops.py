"""The fit / evaluate / predict loops: global batches in, `strategy.run` per step, global logs out."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import torch

from phalanx.checkpoint._objects import load_into, state_of
from phalanx.checkpoint.failure_handling.elastic import ElasticSync, is_recoverable
from phalanx.keras._elastic_loop import elastic_train_epoch
from phalanx.keras._epoch import Epoch
from phalanx.keras.data_adapter import DataHandler, pack_batch

__all__ = ["LoopModel", "TrainLoop", "evaluate_loop", "predict_loop", "validation_pass"]

T = TypeVar("T")


class LoopModel(Protocol):
    """What the loops use of a `phalanx.keras.Model` (the one implementation), named here so
    this module does not import model.py, which imports it: Keras 3's public step methods."""

    stop_training: bool
    training: bool

    @property
    def strategy(self) -> Any: ...
    @property
    def module(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...
    def eval(self) -> Any: ...
    def get_metrics_result(self) -> dict[str, float]: ...
    def train_function(self, data: Any) -> None: ...
    def test_step(self, data: Any) -> None: ...
    def predict_step(self, data: Any) -> Any: ...
    def reset_metrics(self) -> None: ...


def _distributed(model: LoopModel, handler: DataHandler, epoch: int, skip: int) -> Iterator[Any]:
    """The epoch's batches distributed over the replicas, each as the steps take it
    (`pack_batch`: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``)."""
    batches = model.strategy.experimental_distribute_dataset(Epoch(handler.epoch(epoch, skip)))
    return (pack_batch(*batch) for batch in batches)


class TrainLoop:
    """``fit``'s training epochs for one model, and what outlives an epoch: the logs of the
    last finished epoch, which a ParameterServer epoch hands its batch callbacks."""

    def __init__(self) -> None:
        self.last_epoch_logs: dict[str, float] = {}

    def epoch(
        self, model: LoopModel, handler: DataHandler, epoch: int, skip: int, callbacks: Any
    ) -> dict[str, float]:
        """Trains one epoch from step ``skip``; returns the epoch's global logs.

        Raises:
            MoveTo: An elastic job's chief is in another epoch (`elastic_train_epoch`).
            BelowMinimumWorkersError: Fewer workers are left than an elastic job's minimum.
        """
        strategy = model.strategy
        if strategy.schedules_steps:
            return self._scheduled_epoch(model, handler, epoch, skip, callbacks)
        if getattr(strategy, "membership", None) is not None:  # an elastic MultiWorkerMirrored job
            return elastic_train_epoch(model, handler, epoch, skip, callbacks)
        logs: dict[str, float] = {}
        reads = callbacks.reads_batch_logs("train")  # else no step's logs: no cross-worker sum per step
        for step, data in enumerate(_distributed(model, handler, epoch, skip), start=skip):
            callbacks.on_train_batch_begin(step)
            model.train_function(data)
            if reads:
                logs = model.get_metrics_result()
            callbacks.on_train_batch_end(step, logs)
            if model.stop_training:
                break
        return logs or model.get_metrics_result()

    def _scheduled_epoch(
        self, model: LoopModel, handler: DataHandler, epoch: int, skip: int, callbacks: Any
    ) -> dict[str, float]:
        """One epoch under a strategy whose steps run on remote workers (ParameterServerStrategy):
        every global batch becomes a function scheduled on some worker, asynchronously; the
        epoch ends when all have run. Batch callbacks see the logs of the last finished epoch
        (as with TF, per-batch metrics are not fetched while steps are in flight)."""
        from phalanx.coordinator import ClusterCoordinator

        strategy = model.strategy
        coordinator = strategy.cluster_coordinator or ClusterCoordinator(strategy)
        last = dict(self.last_epoch_logs)
        for step, batch in enumerate(handler.epoch(epoch, skip), start=skip):
            callbacks.on_train_batch_begin(step)
            coordinator.schedule(_train_step_on_worker, args=(model, pack_batch(*batch)))
            callbacks.on_train_batch_end(step, last)
            if model.stop_training:
                break
        coordinator.join()  # the coordinator's copies (metrics included) now hold the ps values
        self.last_epoch_logs = model.get_metrics_result()
        return self.last_epoch_logs


def _train_step_on_worker(model: LoopModel, data: tuple[Any, ...]) -> None:
    """Runs on a worker: the model, its optimizer and metrics resolve to the worker's copies."""
    model.train_function(data)


def evaluate_loop(model: LoopModel, handler: DataHandler, callbacks: Any) -> dict[str, float]:
    """Runs the test step over one pass of ``handler``; returns global logs. Elastic: a worker
    lost during the pass makes the members re-form and run it again (`_elastic_pass`).

    Raises:
        BelowMinimumWorkersError: Fewer workers are left than the job's minimum (elastic).
    """
    model.reset_metrics()
    callbacks.on_test_begin()
    fired = _Fired(callbacks.on_test_batch_begin, callbacks.on_test_batch_end)
    reads = callbacks.reads_batch_logs("test")  # else no step's logs: no cross-worker sum per step
    logs: dict[str, float] = _elastic_pass(model, lambda redo: _test_pass(model, handler, fired, redo, reads))
    callbacks.on_test_end(logs)
    return logs


def _test_pass(
    model: LoopModel, handler: DataHandler, fired: _Fired, redo: bool, reads: bool
) -> dict[str, float]:
    if redo:
        model.reset_metrics()
    for step, data in enumerate(_distributed(model, handler, 0, 0)):
        fired.begin(step)
        model.strategy.run(model.test_step, args=(data,))
        fired.end(step, model.get_metrics_result() if reads else {})
    return model.get_metrics_result()


def validation_pass(model: LoopModel, handler: DataHandler, callbacks: Any) -> dict[str, float]:
    """``fit``'s validation pass: `evaluate_loop` (elastic as it is: skipping the pass after a
    loss would leave the epoch without the ``val_`` logs that ``EarlyStopping`` and
    ``ModelCheckpoint`` read)."""
    return evaluate_loop(model, handler, callbacks)


def predict_loop(model: LoopModel, handler: DataHandler, callbacks: Any) -> Any:
    """Predictions for every example, in input order, gathered over replicas and workers.
    Elastic: a worker lost during the pass makes the members re-form and run it again.

    Raises:
        ValueError: The input is empty.
        BelowMinimumWorkersError: Fewer workers are left than the job's minimum (elastic).
    """
    callbacks.on_predict_begin()
    fired = _Fired(callbacks.on_predict_batch_begin, callbacks.on_predict_batch_end)
    outputs: list[Any] = _elastic_pass(model, lambda redo: _predict_pass(model, handler, fired))
    callbacks.on_predict_end()
    if not outputs:
        raise ValueError("predict got no data: the input is empty.")
    return _concat(outputs)


def _predict_pass(model: LoopModel, handler: DataHandler, fired: _Fired) -> list[Any]:
    outputs: list[Any] = []
    for step, data in enumerate(_distributed(model, handler, 0, 0)):
        fired.begin(step)
        per_replica = model.strategy.run(model.predict_step, args=(data,))
        gathered = model.strategy.gather(per_replica, axis=0)
        outputs.append(gathered)
        fired.end(step, {"outputs": gathered})
    return outputs


class _Fired:
    """A pass's batch callbacks, when the pass may be run again from its start (an elastic job
    after a loss): each batch's begin and end fire once, the first time the pass reaches it, so
    callbacks see every batch once and in order (a batch cut short: its begin, then, redone,
    its end)."""

    def __init__(self, on_begin: Callable[[int], Any], on_end: Callable[[int, Any], Any]) -> None:
        self._on_begin, self._on_end = on_begin, on_end
        self._begun = self._ended = 0  # batches whose begin / end fired

    def begin(self, step: int) -> None:
        if step >= self._begun:
            self._begun = step + 1
            self._on_begin(step)

    def end(self, step: int, logs: Any) -> None:
        if step >= self._ended:
            self._ended = step + 1
            self._on_end(step, logs)


def _elastic_pass(model: LoopModel, run: Callable[[bool], T]) -> T:
    """``run(redo)``: one evaluation or prediction pass, in eval mode without gradients.

    In an elastic job a worker lost during it makes the members re-form the group and run it
    again from its start (``redo=True``), split over the members there are now: the pass
    changes no state but the run count (which keys dropout), so the members take the chief's
    weights and its run count at the pass's start, and the redo is exact and the same on every
    member. The re-form admits no joiner:
    a restarted task runs its program from the start, and meets the members only at a training
    step boundary (`fit`, `PreemptionCheckpointHandler.run`), where they admit it.

    Raises:
        BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
    """
    strategy = model.strategy
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if getattr(strategy, "membership", None) is None:
                return run(False)
            start = strategy.run_count
            sync = ElasticSync(
                strategy,
                lambda: {"module": state_of(model.module), "run_count": start},
                lambda state: _load_pass_state(model, state),
            )
            redo = False
            while True:
                try:
                    return run(redo)
                except Exception as exc:
                    if not is_recoverable(strategy, exc):
                        raise
                    sync.recover(exc, admit=False)
                    redo = True
    finally:
        model.train(was_training)


def _load_pass_state(model: LoopModel, state: dict[str, Any]) -> None:
    """The chief's weights (the same as every member's, unless a loss cut short the broadcast
    of initial values) and the run count at the pass's start."""
    load_into(model.module, state["module"], "module")
    model.strategy.run_count = int(state["run_count"])


def _concat(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([o.cpu() for o in outputs], dim=0)
    if isinstance(first, (list, tuple)):
        return type(first)(_concat([o[i] for o in outputs]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _concat([o[k] for o in outputs]) for k in first}
    raise TypeError(f"predict outputs must be tensors or nests of them. Received: {type(first).__name__}.")
