"""PreemptionCheckpointHandler: every worker saves at the same step when one is about to be
terminated, then exits; a restarted job resumes from that checkpoint (TF's, for custom loops)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from phalanx.checkpoint._files import atomic_write_text, chief_path
from phalanx.checkpoint.checkpoint import Checkpoint
from phalanx.checkpoint.failure_handling.coordination import PreemptionCoordinator, check_supported
from phalanx.checkpoint.failure_handling.elastic import ElasticSync, is_recoverable
from phalanx.checkpoint.failure_handling.policy import Decision
from phalanx.checkpoint.failure_handling.termination import TerminationConfig
from phalanx.checkpoint.manager import CheckpointManager, latest_checkpoint
from phalanx.cluster.resolvers import owners
from phalanx.strategies.default import get_strategy

__all__ = ["STATE_FILE", "PreemptionCheckpointHandler"]

log = logging.getLogger("phalanx")

STATE_FILE = "preemption_state.json"  # the run counts of the checkpoint the handler saved last
_FORMAT = "phalanx.preemption/1"


def _manager_of(checkpoint_or_manager: Any, checkpoint_dir: str | None) -> CheckpointManager:
    if isinstance(checkpoint_or_manager, CheckpointManager):
        return checkpoint_or_manager
    if isinstance(checkpoint_or_manager, Checkpoint):
        if not checkpoint_dir:
            raise ValueError(
                "PreemptionCheckpointHandler needs a checkpoint_dir when given a Checkpoint (it keeps "
                "its checkpoints there). Received: checkpoint_dir=None. HINT: pass checkpoint_dir=..., "
                "or a CheckpointManager."
            )
        return CheckpointManager(checkpoint_or_manager, checkpoint_dir, max_to_keep=1)
    raise TypeError(
        "checkpoint_or_checkpoint_manager must be a phalanx.checkpoint.Checkpoint or CheckpointManager. "
        f"Received: {type(checkpoint_or_manager).__name__}."
    )


def _strategy_of(cluster_resolver: Any) -> Any:
    """The strategy whose workers the handler coordinates: the one whose scope is open, else (as
    TensorFlow, whose handler reads the resolver) the strategy made with ``cluster_resolver``."""
    strategy = get_strategy()
    owner = owners.owner_of(cluster_resolver) if cluster_resolver is not None else None
    if strategy.is_default and owner is not None:
        strategy = owner
    check_supported(strategy, "PreemptionCheckpointHandler")  # workers that step together, first
    workers = getattr(cluster_resolver, "num_workers", 1) if cluster_resolver is not None else 1
    if workers > 1 and strategy.num_workers_in_sync < workers:
        raise ValueError(
            f"A PreemptionCheckpointHandler of a cluster of {workers} workers needs the strategy that "
            f"joins them. Received: the current strategy is {strategy!r}, and no live strategy was made "
            "with this cluster_resolver. HINT: pass `strategy.cluster_resolver` of your "
            "MultiWorkerMirroredStrategy, or create the handler under `with strategy.scope():`."
        )
    return strategy


class PreemptionCheckpointHandler:
    """Saves a checkpoint on every worker at the same step when any of them is about to be
    terminated, then exits; restores the latest checkpoint when created
    (tf.distribute.experimental.PreemptionCheckpointHandler).

    Create it on every worker (all workers), after the model and optimizer, inside the
    strategy's scope or after it (as in TensorFlow: the strategy is the one made with
    ``cluster_resolver``), and drive each training step through `run`::

        with strategy.scope():
            model, optimizer = ...
            checkpoint = phalanx.checkpoint.Checkpoint(model=model, optimizer=optimizer)
            handler = phalanx.experimental.PreemptionCheckpointHandler(
                strategy.cluster_resolver, checkpoint, checkpoint_dir)
        for step in range(handler.total_run_calls, total_steps):  # resumes where it stopped
            loss = handler.run(distributed_train_step, next(iterator))

    When a worker receives SIGTERM (or its ``termination_watcher_fn`` returns True), the next
    `run` on every worker saves the checkpoint with ``total_run_calls`` steps done and calls
    ``exit_fn`` (default ``sys.exit(42)``), so a restarted job continues at the same step and
    ends with the weights of an uninterrupted run. With a ``grace_period`` the workers save at
    once, train on, and save again before the time is up. An error raised by the training
    function on one worker is told to the others, which raise `PeerFailedError` naming it.
    See docs/multi_worker.md (Preemption).

    The handler's own checkpoints also record ``total_run_calls`` and the strategy's run
    count (``preemption_state.json`` next to them). A checkpoint saved by other means into the
    same directory restores the weights, but ``total_run_calls`` only for the handler's own.

    Args:
        cluster_resolver: The cluster (``strategy.cluster_resolver``; None for one process).
        checkpoint_or_checkpoint_manager: A `Checkpoint` (the handler keeps one checkpoint of it
            in ``checkpoint_dir``) or a `CheckpointManager` (used as it is).
        checkpoint_dir: Where the checkpoints live (needed with a `Checkpoint`).
        termination_config: A `TerminationConfig` (default: SIGTERM, exit 42, no grace period).

    Raises:
        ValueError: A `Checkpoint` without ``checkpoint_dir``; a cluster of several workers but
            neither a MultiWorkerMirroredStrategy scope open nor one made with
            ``cluster_resolver``; SIGTERM watched from another thread than the main one.
        TypeError: Neither a `Checkpoint` nor a `CheckpointManager`.
        NotImplementedError: ParameterServerStrategy (its workers do not step together).
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        strategy = _strategy_of(cluster_resolver)
        config = termination_config if termination_config is not None else TerminationConfig()
        if not isinstance(config, TerminationConfig):
            raise TypeError(
                f"termination_config must be a TerminationConfig. Received: {type(config).__name__}."
            )
        self._strategy = strategy
        self._cluster_resolver = cluster_resolver
        self._manager = _manager_of(checkpoint_or_checkpoint_manager, checkpoint_dir)
        self._save_fn = config.save_fn
        self._run_calls = 0
        self._elastic: ElasticSync | None = None
        if getattr(strategy, "membership", None) is not None:  # an elastic job
            self._elastic = ElasticSync(strategy, self._elastic_state, self._load_elastic_state)
        if self._elastic is None or not self._elastic.joining:  # a joiner takes the chief's state
            self._restore()  # before SIGTERM is taken over: a restore that fails leaves it alone
        self._run_count_done = strategy.run_count  # after the last step done (elastic jobs)
        self._coordinator = PreemptionCoordinator(strategy, config, "PreemptionCheckpointHandler")

    # ------------------------------------------------------------------ state
    @property
    def total_run_calls(self) -> int:
        """How many times `run` was called, counting those before the restart that the restored
        checkpoint holds. (TF deprecates it in favour of counters saved in the checkpoint: keep a
        `phalanx.checkpoint.Counter` there for epochs and steps of your own.)"""
        return self._run_calls

    @property
    def _state_file(self) -> str:
        return os.path.join(self._manager.directory, STATE_FILE)

    def _restore(self) -> None:
        with self._strategy.scope():
            restored = self._manager.restore_or_initialize()
        if restored is None:
            return
        state = self._read_state()
        if state is None or state.get("checkpoint") != os.path.basename(restored):
            log.warning(
                "PreemptionCheckpointHandler restored %s, which it did not save itself: total_run_calls "
                "starts at 0. Keep your own step counters in the checkpoint to resume from it.",
                restored,
            )
            return
        self._run_calls = int(state["total_run_calls"])
        self._strategy.run_count = int(state["run_count"])  # keys replica-invariant dropout
        log.info("PreemptionCheckpointHandler restored %s after %d run calls.", restored, self._run_calls)

    def _read_state(self) -> dict[str, Any] | None:
        try:
            with open(self._state_file, encoding="utf-8") as f:
                state = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ValueError(
                f"{self._state_file!r} is not a PreemptionCheckpointHandler state file ({exc}). HINT: "
                "give the handler a checkpoint directory of its own, or remove that file."
            ) from None
        if not isinstance(state, dict) or state.get("format") != _FORMAT:
            raise ValueError(
                f"{self._state_file!r} is not a PreemptionCheckpointHandler state file (format {_FORMAT}). "
                f"Received: {str(state)[:200]}. HINT: give the handler a checkpoint directory of its own."
            )
        return state

    def _elastic_state(self) -> dict[str, Any]:
        """What the chief of an elastic job hands a new member (every checkpointed object)."""
        return {
            "objects": self._manager.checkpoint.state_dict(),
            "run_calls": self._run_calls,
            "run_count": self._run_count_done,
        }

    def _load_elastic_state(self, state: dict[str, Any]) -> None:
        self._manager.checkpoint.load_state_dict(state["objects"])
        self._run_calls = int(state["run_calls"])
        self._strategy.run_count = self._run_count_done = int(state["run_count"])

    # ------------------------------------------------------------------ saving (all workers)
    def _save(self) -> None:
        start = time.monotonic()
        with self._strategy.scope():
            if self._save_fn is not None:
                self._save_fn()
            else:
                self._manager.save()
            latest = latest_checkpoint(self._manager.directory)
            state = {
                "format": _FORMAT,
                "checkpoint": os.path.basename(latest) if latest else None,
                "total_run_calls": self._run_calls,
                "run_count": self._strategy.run_count,
            }
            with chief_path(self._state_file, self._strategy) as target:
                atomic_write_text(json.dumps(state), target)
            if self._strategy.num_workers_in_sync > 1:  # the chief's file is written before anyone goes on
                self._strategy.reduce("SUM", torch.zeros(()), axis=None)
        self._coordinator.save_seconds = time.monotonic() - start
        log.warning(
            "%s saved a checkpoint after %d run calls.", self._coordinator.board.own_name, self._run_calls
        )

    def _handle_preemption(self) -> None:
        decision = self._coordinator.check()
        if decision is Decision.CONTINUE:
            return
        self._save()
        if decision is Decision.SAVE_AND_EXIT:
            self._coordinator.exit(f"a checkpoint after {self._run_calls} run calls")

    # ------------------------------------------------------------------ API (all workers)
    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs one training step, first saving and exiting if any worker was told to terminate
        (all workers, once per step; a step is one call of ``strategy.run``, usually).

        Returns what ``distributed_train_function(*args, **kwargs)`` returns.

        In an elastic job (``phalanx launch --min-workers``) a lost worker does not end the
        step: the survivors re-form, take the chief's state and run the function again with the
        same arguments, unless the chief had completed this step (then None is returned, and
        `total_run_calls` counts it). Tasks waiting to join are admitted before the step.

        Raises:
            PeerFailedError: Another worker's training function raised (named, with its error).
            Exception: What the function raised here (the other workers are told).
        """
        while True:
            done = self._run_calls
            try:
                return self._run_once(distributed_train_function, *args, **kwargs)
            except Exception as exc:
                if self._elastic is None or not is_recoverable(self._strategy, exc):
                    raise
                self._elastic.recover(exc)
                if self._run_calls > done:  # the chief's state has this step done
                    return None

    def _run_once(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._elastic is not None:
            self._elastic.boundary()
        self._handle_preemption()
        start = time.monotonic()
        with self._coordinator.share_errors():
            result = distributed_train_function(*args, **kwargs)
        if self._elastic is not None:
            self._elastic.step_done()
            self._run_count_done = self._strategy.run_count
        self._coordinator.step_took(time.monotonic() - start)
        self._run_calls += 1
        return result

    def save_checkpoint_if_preempted(self) -> None:
        """Counts one step done and, if any worker was told to terminate, saves and exits (all
        workers; call it after each step instead of wrapping the step in `run`)."""
        self._run_calls += 1
        self._handle_preemption()

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """Tells the other workers about an error raised inside, by this worker's name, and raises
        `PeerFailedError` for an error another worker told (all workers). TF's scope for steps
        not driven by `run`; `run` does the same by itself."""
        with self._coordinator.share_errors():
            yield
