"""What a model_fn returns and what train_and_evaluate is told (tf.estimator's specs)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from phalanx.train.hooks import SessionRunHook

__all__ = ["EstimatorSpec", "EvalSpec", "ModeKeys", "TrainSpec"]


class ModeKeys:
    """The mode a model_fn is called in (tf.estimator.ModeKeys)."""

    TRAIN = "train"
    EVAL = "eval"
    PREDICT = "infer"


@dataclass
class EstimatorSpec:
    """What a model_fn returns for one batch (tf.estimator.EstimatorSpec).

    Args:
        mode: The `ModeKeys` the model_fn was called with.
        predictions: A tensor or a dict of tensors, one row per example (PREDICT, export).
        loss: The batch's scalar loss (TRAIN and EVAL).
        train_op: (TRAIN) The optimizer that trains the model: the Estimator calls
            ``zero_grad()``, ``loss.backward()`` and ``step()`` (TF's ``minimize``).
        eval_metric_ops: (EVAL) name -> this batch's scalar value; the Estimator reports each
            one's mean over the evaluation's examples (weighted by batch size).
    """

    mode: str
    predictions: torch.Tensor | Mapping[str, torch.Tensor] | None = None
    loss: torch.Tensor | None = None
    train_op: torch.optim.Optimizer | None = None
    eval_metric_ops: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        needs = {
            ModeKeys.TRAIN: ("loss", "train_op"),
            ModeKeys.EVAL: ("loss",),
            ModeKeys.PREDICT: ("predictions",),
        }
        if self.mode not in needs:
            raise ValueError(
                f"EstimatorSpec's mode is one of ModeKeys.TRAIN, EVAL, PREDICT. Received: {self.mode!r}."
            )
        missing = [name for name in needs[self.mode] if getattr(self, name) is None]
        if missing:
            raise ValueError(
                f"An EstimatorSpec in mode {self.mode!r} needs {', '.join(missing)}. Received: None. "
                "HINT: return EstimatorSpec(mode, loss=loss, train_op=optimizer) in TRAIN, "
                "EstimatorSpec(mode, loss=loss) in EVAL, EstimatorSpec(mode, predictions=...) in PREDICT."
            )


@dataclass
class TrainSpec:
    """How train_and_evaluate trains (tf.estimator.TrainSpec).

    Args:
        input_fn: Returns an iterable of ``(features, labels)`` batches; each worker calls it.
        max_steps: The global step to stop at (None: until every worker's input ends).
        hooks: `phalanx.train.SessionRunHook`s of every training task.
    """

    input_fn: Callable[[], Iterable[Any]]
    max_steps: int | None = None
    hooks: list[SessionRunHook] = field(default_factory=list)


@dataclass
class EvalSpec:
    """How train_and_evaluate evaluates (tf.estimator.EvalSpec).

    Args:
        input_fn: Returns an iterable of ``(features, labels)`` batches.
        steps: Batches per evaluation (None: the whole input).
        name: The evaluation's name (its summaries go to ``model_dir/eval_<name>``).
        start_delay_secs: (evaluator task) Seconds to wait before the first evaluation.
        throttle_secs: Seconds at least between two evaluations.
        checkpoint_timeout_secs: (evaluator task; a phalanx addition) How long to wait for a
            new checkpoint before failing with an error naming the chief.
    """

    input_fn: Callable[[], Iterable[Any]]
    steps: int | None = 100
    name: str | None = None
    start_delay_secs: float = 120.0
    throttle_secs: float = 600.0
    checkpoint_timeout_secs: float = 3600.0
