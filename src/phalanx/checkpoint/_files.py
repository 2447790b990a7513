"""Safe file writing: atomic replacement, and chief-only output under several workers.

Every worker runs the same save code (a collective may hide in a state read); the chief
writes to the real path, the others to a temporary folder that is removed afterwards, as
TF's ``write_dirpath`` does.

An atomic save writes ``.tmp-phalanx-XXXXXXXX`` next to its target and renames it over the
target. The writer holds an exclusive ``flock`` on that file until the rename, so a file of
that name that nobody holds a lock on, and that is older than the current save, is what a
killed writer left behind: the next save in the folder removes it (`remove_stale_temp_files`).
A sharded save's temporary folder is treated alike: its chief holds the lock of a file inside
it until the rename (`locked_temp_folder`, `remove_stale_temp_folders`).
A live writer's file is never removed, whichever process (or machine, on a file system with
working locks) it runs on.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

import torch

try:  # POSIX; elsewhere nothing is locked, so no temporary file is ever taken for stale
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FOLDER_LOCK",
    "TEMP_FOLDER_PREFIX",
    "TEMP_PREFIX",
    "atomic_save",
    "atomic_write_text",
    "chief_path",
    "locked_temp_folder",
    "release_temp_folder",
    "remove_stale_temp_files",
    "remove_stale_temp_folders",
    "safe_load",
]

TEMP_PREFIX = ".tmp-phalanx-"
# Exactly the names `tempfile.mkstemp(prefix=TEMP_PREFIX)` makes: 8 characters of its alphabet.
_TEMP_NAME = re.compile(re.escape(TEMP_PREFIX) + r"[a-z0-9_]{8}", re.ASCII)
# A sharded save's temporary folder (`phalanx.checkpoint._sharded`) and the file its chief locks.
TEMP_FOLDER_PREFIX = TEMP_PREFIX + "dcp-"
_TEMP_FOLDER = re.compile(re.escape(TEMP_FOLDER_PREFIX) + r"[0-9a-f]{12}", re.ASCII)
FOLDER_LOCK = ".phalanx-writing"


def atomic_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temp file in the same folder, fsync, then rename over ``path``.

    A crash at any moment leaves either the old file or the new one, never a torn file; the
    temp file of a killed save is removed by the next save in that folder.
    """
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_write_text(text: str, path: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically, as `atomic_save` does."""
    _atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def _atomic_write(path: str, write: Callable[[IO[bytes]], Any]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    started = time.time()
    fd, tmp = _locked_temp_file(folder)
    try:
        remove_stale_temp_files(folder, before=started)
        with os.fdopen(fd, "wb") as f:  # closing it releases the lock: only after the rename
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _locked_temp_file(folder: str) -> tuple[int, str]:
    """A new temp file in ``folder``, opened and exclusively locked by this process."""
    while True:
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=folder)
        if not _lock(fd, blocking=True) or _same_file(fd, tmp):
            return fd, tmp
        # A cleaner took this name for stale in the instant before we locked it and removed it.
        os.close(fd)


def remove_stale_temp_files(folder: str, before: float) -> list[str]:
    """Removes the temp files of killed atomic saves in ``folder``; returns their paths.

    A file is removed only when all of these hold: its name is exactly an atomic save's
    (``.tmp-phalanx-`` and 8 characters), it is a regular file (never a link) owned by this
    user, it was last modified before ``before`` (the start of the current save), and no
    process holds its lock (a live writer holds it until its rename). Errors are ignored:
    cleaning up must never fail a save.
    """
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if _TEMP_NAME.fullmatch(name) and _remove_if_stale(path, before):
                removed.append(path)
    return removed


def locked_temp_folder(folder: str, name: str) -> int:
    """Makes the temporary folder ``folder/name`` (a sharded save's) with its lock file, locked
    by this process until `release_temp_folder`; returns the lock's descriptor."""
    temp = os.path.join(folder, name)
    os.makedirs(temp)
    fd = os.open(os.path.join(temp, FOLDER_LOCK), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    _lock(fd, blocking=True)
    return fd


def release_temp_folder(fd: int, temp: str) -> None:
    """Removes the lock file of a finished temporary folder and lets its lock go."""
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(temp, FOLDER_LOCK))
    os.close(fd)


def remove_stale_temp_folders(folder: str, before: float) -> list[str]:
    """Removes what killed sharded saves left in ``folder``; returns the paths removed.

    As `remove_stale_temp_files`, for folders: the name is exactly a sharded save's
    (``.tmp-phalanx-dcp-`` and 12 hex digits), it is a folder (never a link) owned by this user,
    modified before ``before``, and nobody holds the lock of its lock file (the saving chief
    holds it until the folder is renamed into place). Errors are ignored.
    """
    removed = []
    with contextlib.suppress(OSError):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if _TEMP_FOLDER.fullmatch(name) and _folder_is_stale(path, before):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _folder_is_stale(path: str, before: float) -> bool:
    try:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mtime >= before:
            return False
        fd = os.open(os.path.join(path, FOLDER_LOCK), os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:  # killed before it made its lock file, or after removing it
        return True
    except OSError:
        return False
    try:
        return _lock(fd, blocking=False)  # nobody writes it (False too where locks do not work)
    finally:
        os.close(fd)


def _remove_if_stale(path: str, before: float) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # a link is never followed
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mtime >= before:
            return False
        if not _lock(fd, blocking=False) or not _same_file(fd, path):
            return False  # a live writer holds it, or locks do not work here, or it is gone
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # releases our lock


def _lock(fd: int, blocking: bool) -> bool:
    """An exclusive flock on ``fd``; False when it is held elsewhere or locks are unsupported."""
    if fcntl is None:  # pragma: no cover - Windows
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        return False
    return True


def _same_file(fd: int, path: str) -> bool:
    try:
        named, opened = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


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
    from phalanx.strategies.default import get_strategy  # here: serving imports no strategy

    strategy = strategy or get_strategy()
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
