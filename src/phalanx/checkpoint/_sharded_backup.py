"""BackupAndRestore's backup of a sharded model: a sharded checkpoint (``backup.dcp``) in the
backup folder, each worker writing its part, beside the single-file ``backup.pt`` of other
models (see `phalanx.checkpoint._sharded`)."""

from __future__ import annotations

import os
from typing import Any

import torch

from phalanx.checkpoint._sharded import is_sharded
from phalanx.checkpoint._sharded_state import is_sharded as holds_shards
from phalanx.checkpoint.checkpoint import Checkpoint

__all__ = ["FOLDER", "read", "uses_shards", "write"]

FOLDER = "backup.dcp"


class _Progress:
    """The backup's plain part (metrics, random state, position) as a checkpointable object."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return self.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = dict(state)


def uses_shards(module: torch.nn.Module) -> bool:
    """Whether ``module`` is sharded (FullyShardedStrategy): its backup is a sharded checkpoint."""
    return holds_shards({"module": module})


def write(backup_dir: str, module: torch.nn.Module, optimizer: Any, progress: dict[str, Any]) -> None:
    """Writes the backup (every worker; each its part; the folder renamed into place)."""
    checkpoint = Checkpoint(module=module, optimizer=optimizer, progress=_Progress(progress))
    checkpoint.write(os.path.join(backup_dir, FOLDER), sharded=True)


def read(
    backup_dir: str, module: torch.nn.Module, optimizer: Any, template: dict[str, Any]
) -> dict[str, Any] | None:
    """Restores the module and the optimizer from the sharded backup, if there is one, and
    returns its plain part (shaped like ``template``); None when there is no sharded backup."""
    path = os.path.join(backup_dir, FOLDER)
    if not is_sharded(path):
        return None
    progress = _Progress(template)
    Checkpoint(module=module, optimizer=optimizer, progress=progress).read(path)
    return progress.state
