"""Safe file writing: atomic replacement, and chief-only output under several workers.

Every worker runs the same save code (a collective may hide in a state read); the chief
writes to the real path, the others to a temporary folder that is removed afterwards, as
TF's ``write_dirpath`` does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from phalanx import context

__all__ = ["atomic_save", "chief_path", "safe_load"]


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temp file in the same folder, fsync, then rename over ``path``.

    A crash at any moment leaves either the old file or the new one, never a torn file.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def safe_load(path: str) -> Any:
    """Loads a file written by `atomic_save` without unpickling arbitrary objects.

    Raises:
        FileNotFoundError: No such file.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"No checkpoint file at {path!r}.")
    return torch.load(path, map_location="cpu", weights_only=True)


@contextlib.contextmanager
def chief_path(path: str, strategy: Any = None) -> Iterator[str]:
    """The path this worker should write ``path`` to; non-chief output is removed on exit."""
    strategy = strategy or context.get_strategy()
    if strategy.is_chief:
        yield path
        return
    resolver = strategy.cluster_resolver
    task = f"{resolver.task_type}_{resolver.task_id}" if resolver is not None else "worker"
    # Outside the chief's folder: the chief may delete it (BackupAndRestore at train end)
    # while this worker is still writing its discarded copy.
    folder = tempfile.mkdtemp(prefix=f"phalanx-workertemp_{task}-")
    try:
        yield os.path.join(folder, os.path.basename(path))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
