"""CheckpointManager: numbered checkpoints in a directory, keeping the newest few.

The index (``checkpoint.json``) lists the kept checkpoints by file name. It is read as
untrusted input: every entry must be the plain name of a checkpoint file in the same folder
(``<checkpoint_name>-<n>.pt``, or the folder ``<checkpoint_name>-<n>.dcp`` of a sharded
checkpoint, no separator, no ``..``, no link that leads out of the folder),
so a crafted index can make neither `CheckpointManager.save` delete nor a restore read a file
anywhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import torch

from phalanx.checkpoint import _sharded
from phalanx.checkpoint._files import atomic_write_text, chief_path
from phalanx.checkpoint._index import (
    INDEX,
    NAME,
    latest_checkpoint,
    read_index,
    record_checkpoint,
)
from phalanx.checkpoint._interval import SaveInterval
from phalanx.checkpoint.checkpoint import Checkpoint
from phalanx.checkpoint.options import CheckpointOptions

__all__ = ["CheckpointManager", "latest_checkpoint", "record_checkpoint"]


class CheckpointManager:
    """Saves ``checkpoint`` as ``{directory}/{checkpoint_name}-{n}.pt``, keeping ``max_to_keep``.

    A checkpoint of a sharded model (FullyShardedStrategy) is the folder
    ``{checkpoint_name}-{n}.dcp`` (see `Checkpoint.write`): every worker writes its part.

    Args:
        checkpoint: The `Checkpoint` to save.
        directory: Where checkpoints and the index file live; one manager per directory.
        max_to_keep: How many to keep (None keeps all).
        checkpoint_name: The file name prefix.
        step_counter: A step counter (a `Counter`, an int tensor, anything ``int()`` reads),
            required with ``checkpoint_interval``.
        checkpoint_interval: `save` writes only when ``step_counter`` moved at least this
            many steps since the last saved one (TF's rule); None saves every time.
        init_fn: What `restore_or_initialize` calls when there is no checkpoint.

    Raises:
        ValueError: A bad ``max_to_keep``, ``checkpoint_name`` or ``checkpoint_interval``, or
            an index in ``directory`` that lists anything but this manager's checkpoint files
            (see the module doc).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str,
        max_to_keep: int | None = 5,
        checkpoint_name: str = "ckpt",
        step_counter: Any = None,
        checkpoint_interval: int | None = None,
        init_fn: Callable[[], Any] | None = None,
    ) -> None:
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1 or None. Received: {max_to_keep}.")
        if not re.fullmatch(NAME, checkpoint_name, re.ASCII) or checkpoint_name in (".", ".."):
            raise ValueError(f"checkpoint_name must be a plain file name. Received: {checkpoint_name!r}.")
        self._checkpoint = checkpoint
        self._directory = directory
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._paths = read_index(directory, checkpoint_name)
        self._interval = SaveInterval(step_counter, checkpoint_interval)
        self._init_fn = init_fn

    @property
    def checkpoint(self) -> Checkpoint:
        """The `Checkpoint` this manager saves."""
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        """The fewest steps between two saves, or None (every `save` writes)."""
        return self._interval.interval

    def sync(self) -> None:
        """Waits for a background write of the checkpoint (`Checkpoint.sync`)."""
        self._checkpoint.sync()

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

    def save(
        self,
        checkpoint_number: int | None = None,
        check_interval: bool = True,
        options: CheckpointOptions | None = None,
    ) -> str | None:
        """Saves a new checkpoint and returns its path (all workers; only the chief's files are
        kept). Blocks until every worker has saved, so that afterwards each of them finds the
        chief's checkpoint with `latest_checkpoint`. Call it outside `strategy.run`.

        With a ``checkpoint_interval`` and ``check_interval``, returns None without saving
        when the step counter has not moved far enough since the last save.

        Raises:
            ValueError: ``checkpoint_number`` is not a non-negative integer.
        """
        if check_interval and not self._interval.due():
            return None
        if checkpoint_number is None:
            self._checkpoint.save_counter.assign_add(1)
            checkpoint_number = self._checkpoint.save_counter.value
        number = checkpoint_number
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(
                "checkpoint_number must be a non-negative integer: it numbers the file name. "
                f"Received: {checkpoint_number!r}. HINT: leave it None to count saves."
            )
        sharded = self._checkpoint.is_sharded
        suffix = _sharded.SUFFIX if sharded else ".pt"
        path = os.path.join(self._directory, f"{self._name}-{checkpoint_number}{suffix}")
        self._checkpoint.write(path, options, sharded=sharded)
        self._interval.saved()
        self._paths = [p for p in self._paths if p != path] + [path]
        removed = []
        if self._max_to_keep is not None:
            while len(self._paths) > self._max_to_keep:
                removed.append(self._paths.pop(0))
        from phalanx.strategies.default import get_strategy  # here: serving imports no strategy

        strategy = get_strategy()
        if strategy.is_chief:
            for old in removed:  # a join of the folder and a checked plain name: never elsewhere
                with contextlib.suppress(FileNotFoundError):
                    if os.path.isdir(old) and not os.path.islink(old):
                        shutil.rmtree(old)  # a sharded checkpoint's folder
                    else:
                        os.remove(old)
        self._write_index()
        # An all-reduce as a barrier (identity in one process): the chief's files are written
        # before any worker returns, so a worker that looks for the latest checkpoint finds it.
        strategy.reduce("SUM", torch.zeros(()), axis=None)
        return path

    def _write_index(self) -> None:
        index = {"checkpoints": [os.path.basename(p) for p in self._paths]}
        with chief_path(os.path.join(self._directory, INDEX)) as target:
            atomic_write_text(json.dumps(index), target)

    def restore_or_initialize(self) -> str | None:
        """Restores the latest checkpoint if there is one, else calls ``init_fn`` (if given).
        Returns the restored path or None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.read(latest)
        elif self._init_fn is not None:
            self._init_fn()
        return latest
