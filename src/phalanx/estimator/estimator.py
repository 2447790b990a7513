"""Estimator: train, evaluate, predict and export a model_fn (tf.estimator.Estimator).

Every call builds the model_fn's modules afresh (`phalanx.estimator.get_module`) and restores
the newest checkpoint of ``model_dir`` into them, as TF builds a graph and restores per call.
Training runs a `phalanx.train.MonitoredTrainingSession`: locally, or, on the chief and worker
tasks of a ``TF_CONFIG`` cluster with ps tasks, with between-graph replication
(`phalanx.train.BetweenGraphStrategy`: variables on the ps tasks, asynchronous updates,
chief-only initialisation and checkpoints, recovery of a restarted task).
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from phalanx import saved_model
from phalanx.checkpoint import Checkpoint
from phalanx.checkpoint.checkpoint import Counter
from phalanx.checkpoint.manager import latest_checkpoint
from phalanx.estimator._calls import batch_size, call_with, input_batches, split_batch
from phalanx.estimator._serving import serving_module
from phalanx.estimator._summaries import write_eval_summaries
from phalanx.estimator.graph import Graph
from phalanx.estimator.run_config import RunConfig
from phalanx.estimator.specs import EstimatorSpec, ModeKeys
from phalanx.input.input_options import InputContext
from phalanx.strategies.between_graph import BetweenGraphStrategy
from phalanx.strategies.default import get_strategy
from phalanx.train.hooks import CheckpointSaverListener, SessionRunHook, StopAtStepHook
from phalanx.train.session import MonitoredTrainingSession, Scaffold, tensorboard_available

__all__ = ["Estimator"]

log = logging.getLogger("phalanx")


class Estimator:
    """A model_fn with its checkpoints in ``model_dir`` (tf.estimator.Estimator).

    ``model_fn(features, labels, mode, params, config)`` (it may take any subset of these
    names) returns an `EstimatorSpec` for one batch; it gets its modules and optimizer with
    `phalanx.estimator.get_module` and `get_optimizer`.

    Args:
        model_fn: The model function.
        model_dir: Checkpoints and summaries (default: ``config.model_dir``, else a new
            temporary folder).
        config: A `RunConfig` (default: ``RunConfig()``, which reads ``TF_CONFIG``).
        params: Passed to ``model_fn`` as ``params``.
    """

    def __init__(
        self,
        model_fn: Callable[..., EstimatorSpec],
        model_dir: str | None = None,
        config: RunConfig | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self._model_fn = model_fn
        self.config = config or RunConfig()
        self.model_dir = model_dir or self.config.model_dir or tempfile.mkdtemp(prefix="phalanx_estimator_")
        self.config.model_dir = self.model_dir
        self.params = dict(params or {})

    def __repr__(self) -> str:
        return f"{type(self).__name__}(model_dir={self.model_dir!r})"

    # ------------------------------------------------------------------ building
    def call_model_fn(self, features: Any, labels: Any, mode: str) -> EstimatorSpec:
        """One call of the model_fn with the arguments it names (its modules come from the
        active `Graph`).

        Raises:
            TypeError: The model_fn did not return an `EstimatorSpec`.
        """
        spec = call_with(
            self._model_fn,
            features=features,
            labels=labels,
            mode=mode,
            params=self.params,
            config=self.config,
        )
        if not isinstance(spec, EstimatorSpec):
            raise TypeError(
                f"A model_fn returns a phalanx.estimator.EstimatorSpec. Received: {type(spec).__name__}. "
                "HINT: return EstimatorSpec(mode, loss=..., train_op=..., predictions=...)."
            )
        return spec

    def _build(self, strategy: Any, mode: str, features: Any, labels: Any) -> Graph:
        """Runs the model_fn once (without gradients) so that it creates its modules."""
        if self.config.tf_random_seed is not None:
            torch.manual_seed(self.config.tf_random_seed)
        graph = Graph(strategy)
        with graph.active(building=True), torch.no_grad():
            self.call_model_fn(features, labels, mode)
        return graph

    def _input_context(self) -> InputContext:
        config = self.config
        spec, task = config.cluster_spec, config.task_type
        index = config.task_id + (1 if task == "worker" and spec is not None and "chief" in spec.jobs else 0)
        pipelines = config.num_worker_replicas
        return InputContext(pipelines, index if task in ("chief", "worker") and index < pipelines else 0, 1)

    def _batches(self, input_fn: Callable[..., Any], mode: str) -> Iterator[Any]:
        return input_batches(
            input_fn, mode=mode, params=self.params, config=self.config, input_context=self._input_context()
        )

    def _restore(self, graph: Graph, path: str) -> int:
        """Reads ``path`` into ``graph``'s modules (and optimizers); returns its global step."""
        step = Counter()
        Checkpoint(**graph.objects(), global_step=step).read(path)
        return step.value

    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint of ``model_dir`` (None: none yet)."""
        return latest_checkpoint(self.model_dir)

    def _checkpoint(self, checkpoint_path: str | None) -> str:
        path = checkpoint_path or self.latest_checkpoint()
        if path is None:
            raise ValueError(
                f"Could not find a trained model in model_dir {self.model_dir!r}. Received: no "
                "checkpoint. HINT: call train() first, or pass checkpoint_path."
            )
        return path

    # ------------------------------------------------------------------ train
    def _training_strategy(self) -> BetweenGraphStrategy | None:
        task = self.config.task_type
        if task is None:
            return None
        if task not in ("chief", "worker") or self.config.num_ps_replicas == 0:
            raise ValueError(
                "Estimator.train runs locally or on a 'chief'/'worker' task of a cluster with 'ps' "
                f"tasks (between-graph replication). Received: task {task}:{self.config.task_id} of "
                f"{self.config.cluster_spec!r}. HINT: call phalanx.estimator.train_and_evaluate on every "
                "task; it runs the ps and evaluator roles."
            )
        return BetweenGraphStrategy(self.config.cluster_resolver)

    def train(
        self,
        input_fn: Callable[..., Iterable[Any]],
        hooks: list[SessionRunHook] | None = None,
        steps: int | None = None,
        max_steps: int | None = None,
        saving_listeners: list[CheckpointSaverListener] | None = None,
    ) -> Estimator:
        """Trains until ``max_steps`` (global), ``steps`` more, or the end of the input.

        On a cluster's chief and worker tasks this is between-graph replication (see the
        module docstring). Blocks.

        Raises:
            ValueError: Both ``steps`` and ``max_steps``; a task that does not train.
        """
        if steps is not None and max_steps is not None:
            raise ValueError(f"Give steps or max_steps, not both. Received: {steps} and {max_steps}.")
        strategy = self._training_strategy()
        try:
            batches = self._batches(input_fn, ModeKeys.TRAIN)
            first = next(batches, None)
            if first is not None:
                self._train(
                    strategy, itertools.chain([first], batches), steps, max_steps, hooks, saving_listeners
                )
        finally:
            if strategy is not None:
                strategy.close()
        return self

    def _train(
        self,
        strategy: BetweenGraphStrategy | None,
        batches: Iterator[Any],
        steps: int | None,
        max_steps: int | None,
        hooks: list[SessionRunHook] | None,
        listeners: list[CheckpointSaverListener] | None,
    ) -> None:
        first = next(batches)
        graph = self._build(strategy or get_strategy(), ModeKeys.TRAIN, *split_batch(first))
        all_hooks = list(hooks or [])
        if steps is not None or max_steps is not None:
            all_hooks.append(StopAtStepHook(num_steps=steps, last_step=max_steps))
        with self._session(strategy, graph, all_hooks, listeners) as session:
            for batch in itertools.chain([first], batches):
                if session.should_stop():
                    break
                session.run(self._train_step(graph), *split_batch(batch))

    def _session(
        self,
        strategy: BetweenGraphStrategy | None,
        graph: Graph,
        hooks: list[SessionRunHook],
        listeners: list[CheckpointSaverListener] | None,
    ) -> MonitoredTrainingSession:
        config = self.config
        summaries = config.save_summary_steps if tensorboard_available() else None
        return MonitoredTrainingSession(
            strategy,
            is_chief=config.is_chief,
            checkpoint_dir=self.model_dir,
            scaffold=Scaffold(**graph.objects()),
            hooks=hooks,
            save_checkpoint_secs=config.save_checkpoints_secs,
            save_checkpoint_steps=config.save_checkpoints_steps,
            save_summaries_steps=summaries,
            save_summaries_secs=None,
            log_step_count_steps=config.log_step_count_steps,
            max_to_keep=config.keep_checkpoint_max,
            saving_listeners=listeners,
        )

    def _train_step(self, graph: Graph) -> Callable[[Any, Any], dict[str, torch.Tensor]]:
        def step(features: Any, labels: Any) -> dict[str, torch.Tensor]:
            with graph.active():
                spec = self.call_model_fn(features, labels, ModeKeys.TRAIN)
            assert spec.train_op is not None  # EstimatorSpec checked both
            assert spec.loss is not None
            spec.train_op.zero_grad()
            spec.loss.backward()
            spec.train_op.step()  # between-graph: the gradients go to the ps tasks
            return {"loss": spec.loss.detach()}

        return step

    # ------------------------------------------------------------------ evaluate
    def evaluate(
        self,
        input_fn: Callable[..., Iterable[Any]],
        steps: int | None = None,
        checkpoint_path: str | None = None,
        name: str | None = None,
    ) -> dict[str, float]:
        """Evaluates the newest (or the given) checkpoint on ``steps`` batches of the input
        (None: all of it); writes the metrics to TensorBoard under ``model_dir/eval[_name]``.

        Returns:
            The mean ``loss`` and of each eval_metric_ops entry over the examples, and the
            checkpoint's ``global_step``.

        Raises:
            ValueError: No checkpoint yet, or an empty input.
        """
        path = self._checkpoint(checkpoint_path)
        batches = self._batches(input_fn, ModeKeys.EVAL)
        if steps is not None:
            batches = itertools.islice(batches, steps)
        first = next(batches, None)
        if first is None:
            raise ValueError("Evaluation needs at least one batch. Received: an empty input_fn.")
        graph = self._build(get_strategy(), ModeKeys.EVAL, *split_batch(first))
        global_step = self._restore(graph, path)
        totals = _evaluate(self, graph, itertools.chain([first], batches))
        result = {**totals, "global_step": global_step}
        folder = os.path.join(self.model_dir, "eval" if name is None else f"eval_{name}")
        write_eval_summaries(folder, result, global_step)
        log.info("Evaluation at global step %d: %s", global_step, result)
        return result

    # ------------------------------------------------------------------ predict
    def predict(
        self,
        input_fn: Callable[..., Iterable[Any]],
        predict_keys: list[str] | None = None,
        checkpoint_path: str | None = None,
        yield_single_examples: bool = True,
    ) -> Iterator[Any]:
        """Yields the predictions of the newest (or the given) checkpoint: one dict (or
        tensor) per example, or per batch with ``yield_single_examples=False``.

        Raises:
            ValueError: No checkpoint yet.
        """
        path = self._checkpoint(checkpoint_path)
        batches = self._batches(input_fn, ModeKeys.PREDICT)
        first = next(batches, None)
        if first is None:
            return
        graph = self._build(get_strategy(), ModeKeys.PREDICT, split_batch(first)[0], None)
        self._restore(graph, path)
        _eval_mode(graph)
        for batch in itertools.chain([first], batches):
            with graph.active(), torch.no_grad():
                predictions = self.call_model_fn(split_batch(batch)[0], None, ModeKeys.PREDICT).predictions
            predictions = _select(predictions, predict_keys)
            yield from (_rows(predictions) if yield_single_examples else [predictions])

    # ------------------------------------------------------------------ export
    def export_saved_model(
        self,
        export_dir_base: str,
        serving_input_receiver_fn: Callable[[], Any],
        checkpoint_path: str | None = None,
    ) -> str:
        """Exports the PREDICT computation of the newest (or the given) checkpoint with
        `phalanx.saved_model.save` to ``export_dir_base/<timestamp>`` (as TF).

        ``serving_input_receiver_fn()`` returns example features (a tensor, or a dict of
        tensors: the artifact then takes them positionally, in sorted key order); the batch
        axis stays dynamic. ``phalanx.saved_model.load(path)`` runs it without this code.

        Returns:
            The export directory.

        Raises:
            ValueError: No checkpoint yet.
        """
        path = self._checkpoint(checkpoint_path)
        features = serving_input_receiver_fn()
        graph = self._build(get_strategy(), ModeKeys.PREDICT, features, None)
        self._restore(graph, path)
        keys = sorted(features) if isinstance(features, Mapping) else None
        inputs = tuple(features[k] for k in keys) if keys is not None else (features,)
        directory = os.path.join(export_dir_base, str(int(time.time() * 1000)))
        saved_model.save(serving_module(self, graph, keys, len(inputs)), directory, inputs)
        return directory


def _eval_mode(graph: Graph) -> None:
    for module in graph.modules.values():
        module.eval()  # dropout off, BatchNorm on its running statistics (TF's EVAL/PREDICT)


def _evaluate(estimator: Estimator, graph: Graph, batches: Iterable[Any]) -> dict[str, float]:
    _eval_mode(graph)
    sums: dict[str, float] = {}
    examples = 0
    for batch in batches:
        features, labels = split_batch(batch)
        with graph.active(), torch.no_grad():
            spec = estimator.call_model_fn(features, labels, ModeKeys.EVAL)
        size = batch_size(labels if labels is not None else features)
        assert spec.loss is not None  # EstimatorSpec checked
        for name, value in {"loss": spec.loss, **spec.eval_metric_ops}.items():
            sums[name] = sums.get(name, 0.0) + float(value) * size
        examples += size
    return {name: total / examples for name, total in sums.items()}


def _select(predictions: Any, keys: list[str] | None) -> Any:
    if keys is None or not isinstance(predictions, Mapping):
        return predictions
    return {key: predictions[key] for key in keys}


def _rows(predictions: Any) -> Iterator[Any]:
    if isinstance(predictions, Mapping):
        size = batch_size(predictions)
        for i in range(size):
            yield {key: value[i] for key, value in predictions.items()}
    else:
        yield from predictions
