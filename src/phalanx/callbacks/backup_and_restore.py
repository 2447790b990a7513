"""BackupAndRestore: resume an interrupted `fit` exactly where its last backup left it."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from phalanx.callbacks.callback import Callback, batch_ends
from phalanx.checkpoint import _sharded_backup
from phalanx.checkpoint._files import atomic_save, chief_path, safe_load
from phalanx.checkpoint.failure_handling.coordination import PreemptionCoordinator
from phalanx.checkpoint.failure_handling.policy import Decision
from phalanx.checkpoint.failure_handling.termination import TerminationConfig

__all__ = ["BackupAndRestore"]

_FILE = "backup.pt"
FORMAT = "phalanx.backup/1"


def _joining(model: Any) -> bool:
    """Whether ``model`` trains in a task that joins a running elastic job (its first fit)."""
    membership = getattr(model.strategy, "membership", None)
    if membership is None or not membership.joined:
        return False
    from phalanx.checkpoint.failure_handling.fit_state import elastic_sync_of

    return elastic_sync_of(model)[0].joining


class BackupAndRestore(Callback):
    """Backs up training state and, when `fit` is run again, resumes from it (tf.keras's).

    The backup holds the weights, the optimizer state, the metric totals, the random
    number generator and the position (epoch, and step for an integer ``save_freq``).
    Array inputs are shuffled with a seed per epoch, so a resumed epoch sees the same
    batches; with ``save_freq="epoch"`` an interrupted epoch restarts from its beginning,
    with an integer ``save_freq`` from the step after the last backup. Every worker runs
    it (all workers); only the chief's backup is kept.

    Args:
        backup_dir: Where the backup lives; must not be shared with other runs.
        save_freq: ``"epoch"`` or a number of batches.
        delete_checkpoint: Remove the backup when training finishes.
        save_before_preemption: When any worker receives SIGTERM, every worker backs up after
            the same batch and exits with code 42 (`phalanx.experimental.TerminationConfig`'s
            default), so that the restarted ``fit`` resumes from the next batch. Costs one
            small all-reduce per batch with several workers. Must be set on every worker.

    Raises:
        ValueError: ``save_freq`` is neither "epoch" nor a positive integer; no backup_dir.
        NotImplementedError: ``save_before_preemption`` under ParameterServerStrategy (at
            ``fit``).
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
        save_before_preemption: bool = False,
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore needs a backup_dir. Received an empty path.")
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq <= 0
        ):
            raise ValueError(f"save_freq must be 'epoch' or a positive integer. Received: {save_freq!r}.")
        self.backup_dir = backup_dir
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self._batches_seen = 0
        self._epoch = 0  # the epoch fit is in (`on_epoch_begin`), which batch backups record
        self._preemption: PreemptionCoordinator | None = (
            None  # a coordinator during fit, with save_before_preemption
        )

    @property
    def _path(self) -> str:
        return os.path.join(self.backup_dir, _FILE)

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._batches_seen = 0
        if self.save_before_preemption:
            self._preemption = PreemptionCoordinator(
                self.model.strategy, TerminationConfig(), "BackupAndRestore"
            )
        model = self.model
        if _joining(model):  # a task that joins an elastic job takes the chief's state instead
            return
        state = _sharded_backup.read(self.backup_dir, model.module, model.optimizer, self._progress(0, -1))
        if state is None and not os.path.exists(self._path):
            return
        if state is None:
            state = safe_load(self._path)
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{self._path!r} is not a phalanx backup; remove it or pick another backup_dir.")
        if "module" in state:  # the single-file backup; a sharded one restored them already
            model.module.load_state_dict(state["module"])
            model.optimizer.load_state_dict(state["optimizer"])
        for metric, metric_state in zip(model.metrics, state["metrics"], strict=False):
            metric.load_state_dict(metric_state)
        torch.set_rng_state(state["rng"])
        model.strategy.run_count = int(state["run_count"])  # keys replica-invariant dropout
        epoch, step = int(state["epoch"]), int(state["step"])
        model.resume_at(*((epoch + 1, 0) if step < 0 else (epoch, step + 1)))

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch

    def reads_batch_logs(self, mode: str = "train") -> bool:
        """Backing up by steps reads no logs."""
        batch_ends(mode)  # raises for another mode
        return False

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._backup_if_preempted(batch)
        if self.save_freq == "epoch":
            return
        self._batches_seen += 1
        if self._batches_seen % int(self.save_freq) == 0:
            self._save(self._epoch, batch)

    def elastic_state(self) -> dict[str, int]:
        """What the chief of an elastic job hands a new member: the batches since the backups
        began, so that every member backs up after the same batches."""
        return {"batches_seen": self._batches_seen}

    def load_elastic_state(self, state: dict[str, int]) -> None:
        """Takes the chief's `elastic_state`."""
        self._batches_seen = int(state["batches_seen"])

    def _backup_if_preempted(self, batch: int) -> None:
        """Backs up after this batch and exits when any worker was told to terminate (all workers)."""
        if self._preemption is None or self._preemption.check() is Decision.CONTINUE:
            return
        self._save(self._epoch, batch)
        self._preemption.exit(f"a backup after batch {batch} of epoch {self._epoch}")

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, -1)

    def _progress(self, epoch: int, step: int) -> dict[str, Any]:
        """Everything of the backup but the weights and the optimizer state."""
        model = self.model
        return {
            "format": FORMAT,
            "metrics": [m.state_dict() for m in model.metrics],
            "rng": torch.get_rng_state(),
            "run_count": model.strategy.run_count,
            "epoch": epoch,
            "step": step,
        }

    def _save(self, epoch: int, step: int) -> None:
        model = self.model
        if _sharded_backup.uses_shards(model.module):  # every worker writes its part
            _sharded_backup.write(self.backup_dir, model.module, model.optimizer, self._progress(epoch, step))
            return
        state = {
            "module": model.module.state_dict(),
            "optimizer": model.optimizer.state_dict(),
            **self._progress(epoch, step),
        }
        with chief_path(self._path, model.strategy) as target:
            atomic_save(state, target)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        if self.delete_checkpoint and self.model.strategy.is_chief:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
