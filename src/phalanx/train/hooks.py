"""Session hooks: what runs around each step of a `MonitoredTrainingSession` (tf.train.SessionRunHook).

A hook's methods are called in this order: ``begin()`` once, ``after_create_session(session)``
once the variables are initialised or restored, then ``before_run(run_context)`` and
``after_run(run_context, run_values)`` around every ``session.run``, and ``end(session)`` when
the session closes without an error. ``run_context.request_stop()`` ends the loop (the
session's ``should_stop()`` turns True).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch

from phalanx.checkpoint import Checkpoint, CheckpointManager

__all__ = [
    "CheckpointSaverHook",
    "HookedSession",
    "CheckpointSaverListener",
    "SessionRunContext",
    "SessionRunHook",
    "SessionRunValues",
    "StepCounterHook",
    "StopAtStepHook",
    "SummarySaverHook",
    "summary_writer",
]

log = logging.getLogger("phalanx")
CHECKPOINT_NAME = "model.ckpt"  # files model.ckpt-<global step>.pt, as TF1's names


class HookedSession(Protocol):
    """The session a hook runs in, as hooks see it: `MonitoredTrainingSession` is the one
    implementation (named here so this module does not import the session, which imports it)."""

    @property
    def checkpoint(self) -> Checkpoint:
        """What the chief saves and restores."""
        ...

    @property
    def global_step(self) -> int:
        """The global step."""
        ...

    def should_stop(self) -> bool:
        """Whether a hook asked to stop (or the session is closed)."""
        ...

    def request_stop(self) -> None:
        """Ends the loop: `should_stop` turns True."""
        ...

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one training step ``fn(*args, **kwargs)``."""
        ...


class SessionRunContext:
    """What a hook sees of one ``session.run`` (tf.train.SessionRunContext)."""

    def __init__(self, session: HookedSession) -> None:
        self.session = session
        self._stop_requested = False

    def request_stop(self) -> None:
        """Ends the training loop after this step."""
        self._stop_requested = True

    @property
    def stop_requested(self) -> bool:
        return self._stop_requested


class SessionRunValues(NamedTuple):
    """What one ``session.run`` returned, and the global step after it (tf.train.SessionRunValues)."""

    results: Any
    global_step: int


class SessionRunHook:
    """Extends a `MonitoredTrainingSession` (tf.train.SessionRunHook); every method does nothing."""

    def begin(self) -> None:
        """Before the session initialises or restores the variables."""

    def after_create_session(self, session: HookedSession) -> None:
        """Once the variables hold their initial, restored or (non-chief) the chief's values."""

    def before_run(self, run_context: SessionRunContext) -> None:
        """Before each step."""

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        """After each step."""

    def end(self, session: HookedSession) -> None:
        """When the session closes without an error."""


class StopAtStepHook(SessionRunHook):
    """Stops at a global step (tf.train.StopAtStepHook): ``last_step``, or ``num_steps`` after
    the global step the session starts at.

    Raises:
        ValueError: Both or neither of ``num_steps`` and ``last_step``, or a negative one.
    """

    def __init__(self, num_steps: int | None = None, last_step: int | None = None) -> None:
        if (num_steps is None) == (last_step is None):
            raise ValueError(
                "StopAtStepHook takes exactly one of num_steps and last_step. Received: "
                f"num_steps={num_steps!r}, last_step={last_step!r}."
            )
        if (num_steps or 0) < 0 or (last_step or 0) < 0:
            raise ValueError(f"Steps must be >= 0. Received: num_steps={num_steps}, last_step={last_step}.")
        self._num_steps, self._last_step = num_steps, last_step

    @property
    def last_step(self) -> int | None:
        """The global step to stop at (known once the session exists)."""
        return self._last_step

    def after_create_session(self, session: HookedSession) -> None:
        step = session.global_step
        if self._num_steps is not None:
            self._last_step = step + self._num_steps
        if self._last_step is not None and step >= self._last_step:
            session.request_stop()  # nothing left to train (TF: "skipping training")

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if self._last_step is not None and run_values.global_step >= self._last_step:
            run_context.request_stop()


class CheckpointSaverListener:
    """Called around each checkpoint a `CheckpointSaverHook` writes (tf.train.CheckpointSaverListener)."""

    def begin(self) -> None:
        """Before the session is created."""

    def before_save(self, session: HookedSession, global_step: int) -> None:
        """Before the checkpoint of ``global_step`` is written."""

    def after_save(self, session: HookedSession, global_step: int) -> bool | None:
        """After it was written; True stops training."""
        return None

    def end(self, session: HookedSession, global_step: int) -> None:
        """After the last checkpoint."""


class _Every:
    """Triggers every ``steps`` global steps or every ``secs`` seconds."""

    def __init__(self, secs: float | None, steps: int | None) -> None:
        if (secs is None) == (steps is None):
            raise ValueError(f"Give exactly one of secs and steps. Received: secs={secs!r}, steps={steps!r}.")
        self.secs, self.steps = secs, steps
        self.last_step: int | None = None
        self.last_time = time.monotonic()

    def due(self, step: int) -> bool:
        if self.last_step is None:
            return True
        if self.steps is not None:
            return step >= self.last_step + self.steps
        return time.monotonic() - self.last_time >= (self.secs or 0.0)

    def mark(self, step: int) -> None:
        self.last_step, self.last_time = step, time.monotonic()


class CheckpointSaverHook(SessionRunHook):
    """Saves the session's checkpoint every ``save_secs`` seconds or ``save_steps`` global
    steps, once at the start and once at the end (tf.train.CheckpointSaverHook). Files are
    ``model.ckpt-<global step>.pt`` under ``checkpoint_dir``, with a `CheckpointManager` index
    (so `phalanx.checkpoint.latest_checkpoint` and `phalanx.SidecarEvaluator` find them).

    Args:
        checkpoint_dir: Where to save.
        save_secs, save_steps: How often; exactly one.
        listeners: `CheckpointSaverListener`s called around each save.
        max_to_keep: How many checkpoints to keep (None: all).
    """

    def __init__(
        self,
        checkpoint_dir: str,
        save_secs: float | None = None,
        save_steps: int | None = None,
        listeners: list[CheckpointSaverListener] | None = None,
        max_to_keep: int | None = 5,
    ) -> None:
        self._dir = checkpoint_dir
        self._timer = _Every(save_secs, save_steps)
        self._listeners = list(listeners or [])
        self._max_to_keep = max_to_keep
        self._manager: CheckpointManager | None = None

    def begin(self) -> None:
        for listener in self._listeners:
            listener.begin()

    def after_create_session(self, session: HookedSession) -> None:
        self._manager = CheckpointManager(
            session.checkpoint, self._dir, self._max_to_keep, checkpoint_name=CHECKPOINT_NAME
        )
        step = session.global_step
        latest = self._manager.latest_checkpoint
        if latest is None or not latest.endswith(f"-{step}.pt"):
            self._save(session, step)
        self._timer.mark(step)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        step = run_values.global_step
        if self._timer.due(step) and self._save(run_context.session, step):
            run_context.request_stop()

    def end(self, session: HookedSession) -> None:
        step = session.global_step
        if self._timer.last_step != step:
            self._save(session, step)
        for listener in self._listeners:
            listener.end(session, step)

    def _save(self, session: HookedSession, step: int) -> bool:
        assert self._manager is not None
        for listener in self._listeners:
            listener.before_save(session, step)
        path = self._manager.save(checkpoint_number=step)
        log.info("Saved checkpoint for global step %d: %s", step, path)
        self._timer.mark(step)
        return any([bool(listener.after_save(session, step)) for listener in self._listeners])


_writers: dict[str, Any] = {}


def summary_writer(logdir: str) -> Any:
    """The `torch.utils.tensorboard.SummaryWriter` of ``logdir``, one per folder per process
    (TF's ``FileWriterCache``).

    Raises:
        ImportError: The optional ``tensorboard`` package is missing (the hint says how to add it).
    """
    path = os.path.abspath(logdir)
    if path not in _writers:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "TensorBoard summaries need the tensorboard package. HINT: pip install "
                "'phalanx[tensorboard]', or pass save_summaries_steps=None."
            ) from exc
        _writers[path] = SummaryWriter(path)
    return _writers[path]


def scalars(results: Any) -> dict[str, float]:
    """The scalars of a step's results: a scalar is ``loss``; a dict gives its scalar entries."""
    items = results.items() if isinstance(results, dict) else [("loss", results)]
    out = {}
    for name, value in items:
        try:
            tensor = torch.as_tensor(value, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError):
            continue
        if tensor.numel() == 1:
            out[str(name)] = float(tensor)
    return out


class SummarySaverHook(SessionRunHook):
    """Writes the scalars a step returns (a scalar as ``loss``, a dict's scalar entries) to
    TensorBoard every ``save_steps`` global steps or ``save_secs`` seconds
    (tf.train.SummarySaverHook).

    Args:
        save_steps, save_secs: How often; exactly one.
        output_dir: The event files' folder.

    Raises:
        ImportError: The optional ``tensorboard`` package is missing.
    """

    def __init__(
        self, save_steps: int | None = None, save_secs: float | None = None, output_dir: str = "."
    ) -> None:
        self._timer = _Every(save_secs, save_steps)
        self._writer = summary_writer(output_dir)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        if not self._timer.due(run_values.global_step):
            return
        for name, value in scalars(run_values.results).items():
            self._writer.add_scalar(name, value, run_values.global_step)
        self._timer.mark(run_values.global_step)

    def end(self, session: HookedSession) -> None:
        self._writer.flush()


class StepCounterHook(SessionRunHook):
    """Logs ``global_step/sec`` every ``every_n_steps`` (tf.train.StepCounterHook), and writes
    it to TensorBoard when ``output_dir`` is given."""

    def __init__(self, every_n_steps: int = 100, output_dir: str | None = None) -> None:
        self._timer = _Every(None, every_n_steps)
        self._writer = summary_writer(output_dir) if output_dir is not None else None
        self._since: tuple[int, float] | None = None

    def after_create_session(self, session: HookedSession) -> None:
        self._since = (session.global_step, time.monotonic())
        self._timer.mark(session.global_step)

    def after_run(self, run_context: SessionRunContext, run_values: SessionRunValues) -> None:
        step = run_values.global_step
        if self._since is None or not self._timer.due(step):
            return
        rate = (step - self._since[0]) / max(time.monotonic() - self._since[1], 1e-9)
        log.info("global_step/sec: %.4g", rate)
        if self._writer is not None:
            self._writer.add_scalar("global_step/sec", rate, step)
        self._since = (step, time.monotonic())
        self._timer.mark(step)
