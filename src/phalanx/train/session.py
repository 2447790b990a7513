"""MonitoredTrainingSession: a training loop with TF1's promises (tf.train.MonitoredTrainingSession).

    strategy = phalanx.train.replica_device_setter(cluster, f"/job:worker/task:{task_index}")
    with strategy.scope():
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = [phalanx.train.StopAtStepHook(last_step=1000)]
    with phalanx.train.MonitoredTrainingSession(strategy, is_chief=task_index == 0,
                                                checkpoint_dir="/tmp/train_logs", hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run(train_step, batch)

What it promises, as TF1's does:

* **Initialisation by the chief only.** The chief restores the newest checkpoint of
  ``checkpoint_dir`` if there is one, else keeps its own initial values, and writes them to
  the ps tasks; the other workers wait (up to ``max_wait_secs``) and start from the chief's
  values. Without a cluster (the default strategy) the session restores and trains locally.
* **A global step** that counts every worker's steps (it lives on a ps task), for
  `StopAtStepHook` and the checkpoints' numbers.
* **Checkpoints and summaries on the chief**: a `CheckpointSaverHook` (every
  ``save_checkpoint_secs``, 600 by default, or ``save_checkpoint_steps``), a
  `SummarySaverHook` of the scalars each step returns (every ``save_summaries_steps``, 100 by
  default; needs the optional ``tensorboard`` package) and a `StepCounterHook`.
* **Recovery**: a restarted worker rejoins, with the current values and global step; a
  restarted chief restores the newest checkpoint.

``session.run(fn, *args)`` runs one step: it reads the variables' current values from the ps
tasks, calls ``fn`` through ``strategy.run`` (its ``optimizer.step()`` sends the gradients to
the ps tasks), adds the step's buffer changes, advances the global step and calls the hooks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from phalanx.checkpoint import Checkpoint
from phalanx.checkpoint.manager import latest_checkpoint
from phalanx.strategies.between_graph import BetweenGraphStrategy
from phalanx.strategies.default import get_strategy
from phalanx.strategies.strategy import Strategy
from phalanx.train.hooks import (
    CheckpointSaverHook,
    CheckpointSaverListener,
    SessionRunContext,
    SessionRunHook,
    SessionRunValues,
    StepCounterHook,
    SummarySaverHook,
)

__all__ = ["USE_DEFAULT", "MonitoredTrainingSession", "Scaffold"]

log = logging.getLogger("phalanx")


class _UseDefault:
    def __repr__(self) -> str:
        return "USE_DEFAULT"


USE_DEFAULT: Any = _UseDefault()  # TF's marker: "the default", as distinct from None ("never")


class Scaffold:
    """What the session's checkpoints hold (TF1's ``Scaffold(saver=...)``): named objects with
    ``state_dict``/``load_state_dict``, as for `phalanx.checkpoint.Checkpoint`.

    Without a scaffold, a between-graph session saves every variable of its strategy (TF1's
    default ``Saver``); a local session needs one to know what to save.

    Args:
        **objects: name -> module, optimizer, or any stateful object.
    """

    def __init__(self, **objects: Any) -> None:
        self.objects = objects


class _Backend(Protocol):
    """Where a session's variables and global step live (a `BetweenGraphStrategy` is one)."""

    def variables(self) -> dict[str, Any]: ...
    def initialize(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None: ...
    def wait_until_ready(self, timeout: float) -> None: ...
    def pull(self) -> None: ...
    def push_buffer_changes(self) -> None: ...
    def global_step(self) -> int: ...
    def set_global_step(self, value: int) -> None: ...
    def increment_global_step(self) -> int: ...


class _LocalTraining:
    """A session without a cluster: the variables are the process's own, the global step a counter."""

    def __init__(self) -> None:
        self._step = 0

    def variables(self) -> dict[str, Any]:
        return {}

    def initialize(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        return None

    def wait_until_ready(self, timeout: float) -> None:
        return None

    def pull(self) -> None:
        return None

    def push_buffer_changes(self) -> None:
        return None

    def global_step(self) -> int:
        return self._step

    def set_global_step(self, value: int) -> None:
        self._step = int(value)

    def increment_global_step(self) -> int:
        self._step += 1
        return self._step


class _GlobalStep:
    """The global step as a checkpoint object."""

    def __init__(self, backend: _Backend) -> None:
        self._backend = backend

    def state_dict(self) -> dict[str, int]:
        return {"value": self._backend.global_step()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._backend.set_global_step(int(state["value"]))


def _pick(value: Any, default: Any) -> Any:
    return default if value is USE_DEFAULT else value


def tensorboard_available() -> bool:
    """Whether the optional ``tensorboard`` package is installed (summaries need it)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


class MonitoredTrainingSession:
    """A training session with chief-only initialisation, a shared global step, checkpoints,
    summaries and recovery (see the module docstring).

    Args:
        strategy: A `BetweenGraphStrategy` (between-graph replication), or None for a local
            session under the current strategy.
        is_chief: Whether this task initialises, restores and saves (default: the strategy's).
        checkpoint_dir: Where checkpoints are restored from and saved to (None: neither).
        scaffold: What checkpoints hold (see `Scaffold`).
        hooks: `SessionRunHook`s of every task.
        chief_only_hooks: Hooks of the chief only.
        save_checkpoint_secs, save_checkpoint_steps: How often the chief saves (default every
            600 s; None for both: never during training).
        save_summaries_steps, save_summaries_secs: How often the chief writes the steps'
            scalars to ``summary_dir`` (default every 100 steps, when ``tensorboard`` is
            installed; None: never).
        log_step_count_steps: How often the chief logs ``global_step/sec`` (None: never).
        max_wait_secs: How long a non-chief waits for the chief's initialisation.
        summary_dir: Event files' folder (default: ``checkpoint_dir``).
        max_to_keep: Checkpoints kept.
        saving_listeners: `CheckpointSaverListener`s of the chief's checkpoint saver.

    Raises:
        ValueError: A local session with a ``checkpoint_dir`` but no ``scaffold``.
        TimeoutError: (non-chief) The chief did not initialise within ``max_wait_secs``.
    """

    def __init__(
        self,
        strategy: BetweenGraphStrategy | None = None,
        is_chief: bool | None = None,
        checkpoint_dir: str | None = None,
        scaffold: Scaffold | None = None,
        hooks: Iterable[SessionRunHook] | None = None,
        chief_only_hooks: Iterable[SessionRunHook] | None = None,
        save_checkpoint_secs: Any = USE_DEFAULT,
        save_summaries_steps: Any = USE_DEFAULT,
        save_summaries_secs: Any = USE_DEFAULT,
        log_step_count_steps: int | None = 100,
        max_wait_secs: float = 7200.0,
        save_checkpoint_steps: Any = USE_DEFAULT,
        summary_dir: str | None = None,
        max_to_keep: int | None = 5,
        saving_listeners: list[CheckpointSaverListener] | None = None,
    ) -> None:
        self._strategy: Strategy = strategy if strategy is not None else get_strategy()
        self._backend: _Backend = strategy if strategy is not None else _LocalTraining()
        self._is_chief = self._strategy.is_chief if is_chief is None else bool(is_chief)
        self._checkpoint_dir = checkpoint_dir
        self._checkpoint = self._make_checkpoint(scaffold, checkpoint_dir)
        self._hooks = list(hooks or [])
        if self._is_chief:
            self._hooks += list(chief_only_hooks or [])
            self._hooks += self._default_chief_hooks(
                (save_checkpoint_secs, save_checkpoint_steps),
                (save_summaries_steps, save_summaries_secs),
                log_step_count_steps,
                summary_dir or checkpoint_dir,
                (max_to_keep, saving_listeners),
            )
        self._stop = False
        self._closed = False
        for hook in self._hooks:
            hook.begin()
        self._create(max_wait_secs)
        for hook in self._hooks:
            hook.after_create_session(self)

    def _make_checkpoint(self, scaffold: Scaffold | None, checkpoint_dir: str | None) -> Checkpoint:
        objects = dict(scaffold.objects) if scaffold is not None else self._backend.variables()
        self._checkpoint_objects = objects
        if checkpoint_dir is not None and not objects:
            raise ValueError(
                "A MonitoredTrainingSession with a checkpoint_dir must know what to save: a local "
                "session has no variables of its own. Received: no scaffold and no between-graph "
                "strategy. HINT: scaffold=phalanx.train.Scaffold(model=model, optimizer=optimizer)."
            )
        return Checkpoint(**objects, global_step=_GlobalStep(self._backend))

    def _default_chief_hooks(
        self,
        checkpoints: tuple[Any, Any],
        summaries: tuple[Any, Any],
        log_steps: int | None,
        summary_dir: str | None,
        keep: tuple[int | None, list[CheckpointSaverListener] | None],
    ) -> list[SessionRunHook]:
        hooks: list[SessionRunHook] = []
        secs, steps = checkpoints
        if self._checkpoint_dir is not None:
            if secs is USE_DEFAULT and steps is USE_DEFAULT:
                secs = 600.0
            secs, steps = _pick(secs, None), _pick(steps, None)
            if secs is not None or steps is not None:
                hooks.append(CheckpointSaverHook(self._checkpoint_dir, secs, steps, keep[1], keep[0]))
            else:  # never during training, but at the start and the end, as TF does
                hooks.append(CheckpointSaverHook(self._checkpoint_dir, None, 2**62, keep[1], keep[0]))
        hooks += self._summary_hooks(summaries, log_steps, summary_dir)
        return hooks

    def _summary_hooks(
        self, summaries: tuple[Any, Any], log_steps: int | None, summary_dir: str | None
    ) -> list[SessionRunHook]:
        steps, secs = summaries
        defaulted = steps is USE_DEFAULT and secs is USE_DEFAULT
        if defaulted:
            steps = 100
        steps, secs = _pick(steps, None), _pick(secs, None)
        writing = summary_dir is not None and (steps is not None or secs is not None)
        if writing and defaulted and not tensorboard_available():
            log.warning("No TensorBoard summaries: pip install 'phalanx[tensorboard]' to write them.")
            writing = False
        hooks: list[SessionRunHook] = []
        if writing:
            assert summary_dir is not None
            hooks.append(SummarySaverHook(steps, secs if steps is None else None, summary_dir))
        if log_steps is not None:
            hooks.append(StepCounterHook(log_steps, summary_dir if writing else None))
        return hooks

    def _create(self, max_wait_secs: float) -> None:
        """Initialises (chief: restoring the newest checkpoint first) or waits for the chief."""
        if not self._is_chief:
            self._backend.wait_until_ready(max_wait_secs)
            return
        latest = latest_checkpoint(self._checkpoint_dir) if self._checkpoint_dir is not None else None
        if latest is not None:
            self._checkpoint.read(latest)
            log.info("Restored %s (global step %d).", latest, self._backend.global_step())
        optimizers = [o for o in self._checkpoint_objects.values() if isinstance(o, torch.optim.Optimizer)]
        self._backend.initialize(optimizers)

    # ------------------------------------------------------------------ the session
    @property
    def strategy(self) -> Strategy:
        """The strategy the steps run under."""
        return self._strategy

    @property
    def is_chief(self) -> bool:
        return self._is_chief

    @property
    def checkpoint(self) -> Checkpoint:
        """What the chief saves and restores (the scaffold's objects and the global step)."""
        return self._checkpoint

    @property
    def global_step(self) -> int:
        """The global step (every worker's steps together; blocks on a read)."""
        return self._backend.global_step()

    def should_stop(self) -> bool:
        """Whether a hook asked to stop (or the session is closed)."""
        return self._stop or self._closed

    def request_stop(self) -> None:
        """Ends the loop: `should_stop` turns True."""
        self._stop = True

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one training step ``fn(*args, **kwargs)`` (see the module docstring).

        Returns:
            What ``fn`` returned (the hooks see it as ``run_values.results``).

        Raises:
            RuntimeError: The session is closed.
        """
        if self._closed:
            raise RuntimeError(
                "This MonitoredTrainingSession is closed. HINT: check sess.should_stop() before "
                "each step, inside the `with` block."
            )
        run_context = SessionRunContext(self)
        for hook in self._hooks:
            hook.before_run(run_context)
        self._backend.pull()
        result = self._strategy.run(fn, args, kwargs)
        self._backend.push_buffer_changes()
        values = SessionRunValues(result, self._backend.increment_global_step())
        for hook in self._hooks:
            hook.after_run(run_context, values)
        if run_context.stop_requested:
            self._stop = True
        return result

    def close(self) -> None:
        """Ends the session: the hooks' ``end`` (the chief's last checkpoint) runs (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.end(self)

    def __enter__(self) -> MonitoredTrainingSession:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:  # as TF: after an error, no end() (no checkpoint of a state that may be broken)
            self._closed = True
