"""CheckpointManager: numbered checkpoints in a directory, keeping the newest few."""

from __future__ import annotations

import json
import os
import re

from phalanx import context
from phalanx.checkpoint._files import chief_path
from phalanx.checkpoint.checkpoint import Checkpoint

__all__ = ["CheckpointManager", "latest_checkpoint"]

INDEX = "checkpoint.json"


def _read_index(directory: str) -> list[str]:
    path = os.path.join(directory, INDEX)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        names = json.load(f).get("checkpoints", [])
    return [os.path.join(directory, n) for n in names if os.path.exists(os.path.join(directory, n))]


def latest_checkpoint(directory: str) -> str | None:
    """The newest checkpoint recorded in ``directory``, or None."""
    paths = _read_index(directory)
    return paths[-1] if paths else None


class CheckpointManager:
    """Saves ``checkpoint`` as ``{directory}/{checkpoint_name}-{n}.pt``, keeping ``max_to_keep``.

    Args:
        checkpoint: The `Checkpoint` to save.
        directory: Where checkpoints and the index file live.
        max_to_keep: How many to keep (None keeps all).
        checkpoint_name: The file name prefix.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str,
        max_to_keep: int | None = 5,
        checkpoint_name: str = "ckpt",
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None. Received: {max_to_keep}.")
        if not re.fullmatch(r"[\w.-]+", checkpoint_name):
            raise ValueError(f"checkpoint_name must be a plain file name. Received: {checkpoint_name!r}.")
        self._checkpoint = checkpoint
        self._directory = directory
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._paths = _read_index(directory)

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints, oldest first."""
        return list(self._paths)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint, or None."""
        return self._paths[-1] if self._paths else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Saves a new checkpoint (all workers; only the chief's files are kept). Returns its path."""
        if checkpoint_number is None:
            self._checkpoint.save_counter.assign_add(1)
            checkpoint_number = self._checkpoint.save_counter.value
        path = os.path.join(self._directory, f"{self._name}-{checkpoint_number}.pt")
        self._checkpoint.write(path)
        self._paths = [p for p in self._paths if p != path] + [path]
        removed = []
        if self._max_to_keep is not None:
            while len(self._paths) > self._max_to_keep:
                removed.append(self._paths.pop(0))
        if context.get_strategy().is_chief:
            for old in removed:
                if os.path.exists(old):
                    os.remove(old)
        self._write_index()
        return path

    def _write_index(self) -> None:
        index = {"checkpoints": [os.path.basename(p) for p in self._paths]}
        with chief_path(os.path.join(self._directory, INDEX)) as target:
            os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
            tmp = target + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(index, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one. Returns its path or None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.read(latest)
        return latest
