"""Saving at a preemption notice and exiting (tf.distribute.experimental.PreemptionCheckpointHandler).

A cluster manager that preempts a machine sends its processes SIGTERM and kills them a grace
period later. `PreemptionCheckpointHandler` turns the notice into a checkpoint at a step
boundary that every worker agrees on, then exits with a code that asks for a restart; the
restarted program restores that checkpoint when it creates its handler again.

    handler = phalanx.experimental.PreemptionCheckpointHandler(resolver, checkpoint, "/ckpt")
    while handler.total_run_calls < steps:
        handler.run(train_step, next(iterator))   # all workers

Each ``run`` first asks every worker (an OR across workers: one small all-reduce under
MultiWorkerMirroredStrategy) whether any received the notice; if one did, all save the
checkpoint numbered by the step and call ``exit_fn``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

from phalanx import context
from phalanx.checkpoint.checkpoint import Checkpoint
from phalanx.checkpoint.manager import CheckpointManager

__all__ = ["PreemptionCheckpointHandler", "PreemptionWatcher", "TerminationConfig"]

RESTART_CODE = 42  # TF's exit code after a preemption checkpoint on platforms it does not know


def _exit_for_restart() -> None:
    sys.exit(RESTART_CODE)


@dataclass(frozen=True)
class TerminationConfig:
    """How a preemption is noticed and handled (tf.distribute.experimental.TerminationConfig).

    Args:
        termination_watcher_fn: Returns True once this worker got a preemption notice;
            asked at every ``run``. Default: a SIGTERM received by this process.
        exit_fn: Called after the checkpoint is saved. Default: ``sys.exit(42)``.
        grace_period: Seconds between the notice and the kill, as the platform gives them;
            the checkpoint is saved at the next step either way, so this only documents the
            budget that one step plus one save must fit in.
        save_fn: Saves instead of the checkpoint manager (called with no arguments).
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], Any] | None = None
    grace_period: int | None = None
    save_fn: Callable[[], Any] | None = None


class _SigtermWatch:
    """Notes a SIGTERM (installed from the main thread only: Python's rule for signals)."""

    def __init__(self) -> None:
        self.received = threading.Event()
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: Any) -> None:
        self.received.set()

    def uninstall(self) -> None:
        """Puts back the SIGTERM handler that was there before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __call__(self) -> bool:
        return self.received.is_set()


class PreemptionCheckpointHandler:
    """Saves a checkpoint when a worker is about to be preempted, then exits for a restart.

    Created, it restores the latest checkpoint of its manager (if any), and `total_run_calls`
    continues from the step that checkpoint was saved at. With several workers create it in
    the strategy's scope: the current strategy's workers are the ones that agree on a notice
    (TF asks its coordination service, which phalanx does not have).

    Args:
        cluster_resolver: The cluster (None: a single process).
        checkpoint_or_checkpoint_manager: A `Checkpoint` (then ``checkpoint_dir`` is needed)
            or a `CheckpointManager`.
        checkpoint_dir: Where a `Checkpoint` is saved (one kept).
        termination_config: A `TerminationConfig`.

    Raises:
        ValueError: A `Checkpoint` without ``checkpoint_dir``, or a manager with a directory
            too, or several workers but no strategy scope open.
    """

    def __init__(
        self,
        cluster_resolver: Any,
        checkpoint_or_checkpoint_manager: Checkpoint | CheckpointManager,
        checkpoint_dir: str | None = None,
        termination_config: TerminationConfig | None = None,
    ) -> None:
        self._resolver = cluster_resolver
        self._manager = _manager(checkpoint_or_checkpoint_manager, checkpoint_dir)
        config = termination_config or TerminationConfig()
        self._notice = config.termination_watcher_fn or _SigtermWatch()
        self._exit_fn = config.exit_fn or _exit_for_restart
        self._save_fn = config.save_fn
        self._strategy = context.get_strategy()
        workers = getattr(cluster_resolver, "num_workers", 1) if cluster_resolver is not None else 1
        if self._strategy._is_default and workers > 1:
            raise ValueError(
                f"PreemptionCheckpointHandler for a cluster of {workers} workers must know the "
                "strategy whose workers agree on a preemption notice. HINT: create it inside "
                "`with strategy.scope():`."
            )
        restored = self._manager.restore_or_initialize()
        self._run_calls = _step_of(restored) if restored else 0

    @property
    def total_run_calls(self) -> int:
        """How many times `run` ran the training function, counting those before a restart."""
        return self._run_calls

    def run(self, distributed_train_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Saves and exits if a worker got a notice; else runs the function (all workers).

        Returns:
            What ``distributed_train_function(*args, **kwargs)`` returns.
        """
        self._save_and_exit_if_preempted(checkpoint_number=self._run_calls)
        result = distributed_train_function(*args, **kwargs)
        self._run_calls += 1
        return result

    def save_checkpoint_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        """For loops that do not go through `run`: saves (``CheckpointManager.save(*args,
        **kwargs)``) and exits if a worker got a notice (all workers)."""
        self._save_and_exit_if_preempted(*args, **kwargs)

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[None]:
        """The scope of a training loop that uses `save_checkpoint_if_preempted`. A worker
        that fails inside raises; its peers learn of it from phalanx's collectives, which
        name the missing worker (TF reports the error to its coordination service)."""
        yield

    def _save_and_exit_if_preempted(self, *args: Any, **kwargs: Any) -> None:
        if not self._strategy._any_worker_has_data(bool(self._notice())):
            return
        if self._save_fn is not None:
            self._save_fn()
        else:
            kwargs.setdefault("check_interval", False)  # the notice, not the interval, decides
            self._manager.save(*args, **kwargs)
        self._exit_fn()


class PreemptionWatcher:
    """Refused: TF's watcher reads preemption notices from its coordination service.

    Raises:
        NotImplementedError: Always, naming what to use instead.
    """

    preemption_message: str | None = None

    def __init__(self) -> None:
        _refuse_watcher()

    def block_until_worker_exit(self) -> NoReturn:
        """Refused (see the class)."""
        _refuse_watcher()


def _refuse_watcher() -> NoReturn:
    raise NotImplementedError(
        "PreemptionWatcher reads the preemption notices TensorFlow's coordination service "
        "gathers from Google Cloud's metadata server; PyTorch has no coordination service. "
        "HINT: use phalanx.experimental.PreemptionCheckpointHandler (it notices SIGTERM, or "
        "your TerminationConfig(termination_watcher_fn=...)), or torchrun's elastic agent."
    )


def _manager(target: Checkpoint | CheckpointManager, directory: str | None) -> CheckpointManager:
    if isinstance(target, CheckpointManager):
        if directory is not None:
            raise ValueError(
                "Give checkpoint_dir with a Checkpoint, not with a CheckpointManager (it has its "
                f"directory, {target.directory!r}). Received checkpoint_dir={directory!r}."
            )
        return target
    if directory is None:
        raise ValueError(
            "PreemptionCheckpointHandler with a Checkpoint needs checkpoint_dir. HINT: "
            "PreemptionCheckpointHandler(resolver, checkpoint, checkpoint_dir='/ckpt')."
        )
    return CheckpointManager(target, directory, max_to_keep=1)


def _step_of(path: str) -> int:
    match = re.search(r"-(\d+)\.pt$", path)
    return int(match.group(1)) if match else 0
