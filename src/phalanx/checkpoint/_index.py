"""The index of a checkpoint folder (``checkpoint.json``): which checkpoints it holds, newest
last (TF's ``checkpoint`` state file), and ``latest_checkpoint``. Its names are untrusted
input: each must be a plain checkpoint file name inside the folder (docs/security.md)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from phalanx.checkpoint._files import atomic_write_text, chief_path

__all__ = ["INDEX", "NAME", "latest_checkpoint", "read_index", "record_checkpoint"]

INDEX = "checkpoint.json"
NAME = r"[A-Za-z0-9_.-]+"  # a checkpoint_name: one plain file-name component
_ANY_CHECKPOINT = re.compile(rf"{NAME}-[0-9]+\.(pt|dcp)", re.ASCII)


def _checkpoint_file(prefix: str) -> re.Pattern[str]:
    return re.compile(rf"{re.escape(prefix)}-[0-9]+\.(pt|dcp)", re.ASCII)


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


def read_index(directory: str, prefix: str | None = None) -> list[str]:
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
    expected = f"'{prefix}-<n>.pt' or '.dcp'" if prefix is not None else "'<name>-<n>.pt' or '.dcp'"
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


def record_checkpoint(path: str) -> None:
    """Lists ``path`` last in its folder's index (chief only writes), so `latest_checkpoint`
    finds it: `Checkpoint.save` calls it, as TF's ``save`` updates the checkpoint state."""
    directory, name = os.path.split(path)
    directory = directory or "."
    if not _ANY_CHECKPOINT.fullmatch(name):
        return
    names = [os.path.basename(p) for p in read_index(directory) if os.path.basename(p) != name]
    with chief_path(os.path.join(directory, INDEX)) as target:
        atomic_write_text(json.dumps({"checkpoints": [*names, name]}), target)


def latest_checkpoint(directory: str) -> str | None:
    """The newest checkpoint recorded in ``directory``, or None (``tf.train.latest_checkpoint``).

    Right after `CheckpointManager.save` returns, every worker sees the chief's newest
    checkpoint here (with a folder all workers share).

    Raises:
        ValueError: The index lists a name that is not a checkpoint file of ``directory``.
    """
    paths = read_index(directory)
    return paths[-1] if paths else None
