"""CheckpointManager: numbered checkpoints in a directory, keeping the newest few.

The index (``checkpoint.json``) lists the kept checkpoints by file name. It is read as
untrusted input: every entry must be the plain name of a checkpoint file in the same folder
(``<checkpoint_name>-<n>.pt``, no separator, no ``..``, no link that leads out of the folder),
so a crafted index can make neither `CheckpointManager.save` delete nor a restore read a file
anywhere else.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

import torch

from phalanx.checkpoint._files import atomic_write_text, chief_path
from phalanx.checkpoint.checkpoint import Checkpoint

__all__ = ["CheckpointManager", "latest_checkpoint"]

INDEX = "checkpoint.json"
_NAME = r"[A-Za-z0-9_.-]+"  # a checkpoint_name: one plain file-name component
_ANY_CHECKPOINT = re.compile(rf"{_NAME}-[0-9]+\.pt", re.ASCII)


def _checkpoint_file(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-[0-9]+\.pt", re.ASCII)


def _inside(directory: str, path: str) -> bool:
    """Whether ``path``, links resolved, lies inside ``directory`` (links resolved too)."""
    folder, target = os.path.realpath(directory), os.path.realpath(path)
    return os.path.commonpath([folder, target]) == folder


def _refuse(index: str, received: str, rule: str, hint: str) -> ValueError:
    return ValueError(
        f"The checkpoint index {index} {rule}; a crafted index must not make a save delete, or a "
        f"restore read, files elsewhere. Received: {received}. HINT: {hint}"
    )


def _load_names(directory: str) -> tuple[str, list[str]]:
    index = os.path.join(directory, INDEX)
    if os.path.lexists(index) and not _inside(directory, index):
        raise _refuse(
            index,
            f"a link to {os.path.realpath(index)!r}",
            "must be a file of the checkpoint folder",
            f"remove the link {index!r}; a save writes a new index.",
        )
    try:
        with open(index, encoding="utf-8") as f:
            data: Any = json.load(f)
    except FileNotFoundError:
        return index, []
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _refuse(index, f"unreadable JSON ({exc})", "must be JSON", "remove the index.") from None
    names = data.get("checkpoints") if isinstance(data, dict) else None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise _refuse(
            index,
            repr(data)[:200],
            'must be {"checkpoints": [file names]}',
            "remove the index; a save writes a new one.",
        )
    return index, names


def _read_index(directory: str, prefix: str | None = None) -> list[str]:
    """The checkpoints ``directory``'s index lists whose files exist, oldest first.

    Args:
        directory: The checkpoint folder.
        prefix: The manager's ``checkpoint_name``: its entries must be ``<prefix>-<n>.pt``
            (None accepts any manager's name, for `latest_checkpoint`).

    Raises:
        ValueError: An entry is not a plain name of a checkpoint file of this folder (of this
            manager, with ``prefix``), or a link leads out of the folder.
    """
    index, names = _load_names(directory)
    pattern = _checkpoint_file(prefix) if prefix is not None else _ANY_CHECKPOINT
    expected = f"'{prefix}-<n>.pt'" if prefix is not None else "'<name>-<n>.pt'"
    paths = []
    for name in names:
        if not pattern.fullmatch(name):
            raise _refuse(
                index,
                repr(name),
                f"may list only plain names of this manager's checkpoints ({expected} in the same folder)",
                "give every CheckpointManager its own directory, with the checkpoint_name its index "
                "was written with; never edit checkpoint.json by hand.",
            )
        path = os.path.join(directory, name)
        if not _inside(directory, path):
            raise _refuse(
                index,
                f"{name!r}, a link to {os.path.realpath(path)!r}",
                "may list only files inside the checkpoint folder",
                f"copy the checkpoint into {directory!r} instead of linking to it.",
            )
        if os.path.exists(path):
            paths.append(path)
    return paths


def latest_checkpoint(directory: str) -> str | None:
    """The newest checkpoint recorded in ``directory``, or None (``tf.train.latest_checkpoint``).

    Right after `CheckpointManager.save` returns, every worker sees the chief's newest
    checkpoint here (with a folder all workers share).

    Raises:
        ValueError: The index lists a name that is not a checkpoint file of ``directory``.
    """
    paths = _read_index(directory)
    return paths[-1] if paths else None


class CheckpointManager:
    """Saves ``checkpoint`` as ``{directory}/{checkpoint_name}-{n}.pt``, keeping ``max_to_keep``.

    Args:
        checkpoint: The `Checkpoint` to save.
        directory: Where checkpoints and the index file live; one manager per directory.
        max_to_keep: How many to keep (None keeps all).
        checkpoint_name: The file name prefix.

    Raises:
        ValueError: A bad ``max_to_keep`` or ``checkpoint_name``, or an index in ``directory``
            that lists anything but this manager's checkpoint files (see the module doc).
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
        if not re.fullmatch(_NAME, checkpoint_name, re.ASCII) or checkpoint_name in (".", ".."):
            raise ValueError(f"checkpoint_name must be a plain file name. Received: {checkpoint_name!r}.")
        self._checkpoint = checkpoint
        self._directory = directory
        self._max_to_keep = max_to_keep
        self._name = checkpoint_name
        self._paths = _read_index(directory, checkpoint_name)

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
        """Saves a new checkpoint and returns its path (all workers; only the chief's files are
        kept). Blocks until every worker has saved, so that afterwards each of them finds the
        chief's checkpoint with `latest_checkpoint`. Call it outside `strategy.run`.

        Raises:
            ValueError: ``checkpoint_number`` is not a non-negative integer.
        """
        if checkpoint_number is None:
            self._checkpoint.save_counter.assign_add(1)
            checkpoint_number = self._checkpoint.save_counter.value
        number = checkpoint_number
        if isinstance(number, bool) or not isinstance(number, int) or number < 0:
            raise ValueError(
                "checkpoint_number must be a non-negative integer: it numbers the file name. "
                f"Received: {checkpoint_number!r}. HINT: leave it None to count saves."
            )
        path = os.path.join(self._directory, f"{self._name}-{checkpoint_number}.pt")
        self._checkpoint.write(path)
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
        """Restores the latest checkpoint if there is one. Returns its path or None."""
        latest = self.latest_checkpoint
        if latest is not None:
            self._checkpoint.read(latest)
        return latest
