"""train_and_evaluate: every task of a ``TF_CONFIG`` cluster runs its role (tf.estimator.train_and_evaluate).

Every task runs the same program and calls ``train_and_evaluate(estimator, train_spec,
eval_spec)``; the task in ``TF_CONFIG`` picks what it does:

* ``chief`` and ``worker``: `Estimator.train` with between-graph replication (variables on the
  ps tasks, asynchronous updates; the chief initialises, restores, saves checkpoints and
  summaries) until ``train_spec.max_steps``.
* ``ps``: serves the variables (`phalanx.Server(...).join()`, until the task is stopped).
* ``evaluator``: evaluates each new checkpoint of ``model_dir`` (at most every
  ``eval_spec.throttle_secs``), until one reaches ``train_spec.max_steps``.
* no ``TF_CONFIG``: trains locally, evaluating after checkpoints at most every
  ``throttle_secs``, and once at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from phalanx.estimator.estimator import Estimator
from phalanx.estimator.specs import EvalSpec, TrainSpec
from phalanx.server import Server
from phalanx.train.hooks import CheckpointSaverListener

__all__ = ["train_and_evaluate"]

_POLL_SECONDS = 0.5
Result = tuple[dict[str, float] | None, list[Any]]


class _EvaluateAfterSave(CheckpointSaverListener):
    """(local) Evaluates after a checkpoint, at most every ``throttle_secs``."""

    def __init__(self, estimator: Estimator, eval_spec: EvalSpec) -> None:
        self._estimator, self._spec = estimator, eval_spec
        self._last_time: float | None = None
        self.result: dict[str, float] | None = None

    def after_save(self, session: Any, global_step: int) -> bool | None:
        now = time.monotonic()
        if self._last_time is not None and now - self._last_time < self._spec.throttle_secs:
            return None
        self._last_time = now
        self.result = self._estimator.evaluate(self._spec.input_fn, self._spec.steps, name=self._spec.name)
        return None


def _local(estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec) -> Result:
    listener = _EvaluateAfterSave(estimator, eval_spec)
    estimator.train(
        train_spec.input_fn, train_spec.hooks, max_steps=train_spec.max_steps, saving_listeners=[listener]
    )
    result = listener.result
    latest = estimator.latest_checkpoint()
    if result is None or (latest is not None and not latest.endswith(f"-{int(result['global_step'])}.pt")):
        result = estimator.evaluate(eval_spec.input_fn, eval_spec.steps, name=eval_spec.name)
    return result, []


def _trainer(estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec) -> Result:
    estimator.train(train_spec.input_fn, train_spec.hooks, max_steps=train_spec.max_steps)
    return None, []


def _ps(estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec) -> Result:
    spec = estimator.config.cluster_spec
    assert spec is not None  # a ps task has a cluster
    Server(spec, job_name="ps", task_index=estimator.config.task_id).join()
    return None, []


def _evaluator(estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec) -> Result:
    """Evaluates every new checkpoint until one reaches ``max_steps`` (blocks).

    Raises:
        TimeoutError: No new checkpoint within ``eval_spec.checkpoint_timeout_secs``.
    """
    time.sleep(eval_spec.start_delay_secs)
    evaluated: str | None = None
    waiting_since = time.monotonic()
    while True:
        latest = estimator.latest_checkpoint()
        if latest is not None and latest != evaluated:
            started = time.monotonic()
            result = estimator.evaluate(eval_spec.input_fn, eval_spec.steps, latest, eval_spec.name)
            if train_spec.max_steps is not None and result["global_step"] >= train_spec.max_steps:
                return result, []
            evaluated, waiting_since = latest, time.monotonic()
            time.sleep(max(0.0, eval_spec.throttle_secs - (waiting_since - started)))
            continue
        if time.monotonic() - waiting_since > eval_spec.checkpoint_timeout_secs:
            raise TimeoutError(
                f"The evaluator waited {eval_spec.checkpoint_timeout_secs:g}s for a new checkpoint in "
                f"{estimator.model_dir!r}; none came. Received: the newest is {latest!r}. HINT: the "
                "chief writes the checkpoints: is it running, with the same model_dir? Raise "
                "EvalSpec(checkpoint_timeout_secs=...) for slow training."
            )
        time.sleep(_POLL_SECONDS)


_ROLES: dict[str | None, Callable[[Estimator, TrainSpec, EvalSpec], Result]] = {
    None: _local,
    "chief": _trainer,
    "worker": _trainer,
    "ps": _ps,
    "evaluator": _evaluator,
}


def train_and_evaluate(estimator: Estimator, train_spec: TrainSpec, eval_spec: EvalSpec) -> Result:
    """Runs this task's role (see the module docstring). Blocks; a ps task never returns.

    Returns:
        ``(eval_result, export_results)`` as TF: the last evaluation's metrics on the
        evaluator and in local mode (None on the training tasks), and no exports.
    """
    # RunConfig's resolver admits only these task types (TF1's 'master' is refused there).
    task = estimator.config.task_type
    return _ROLES[task](estimator, train_spec, eval_spec)
