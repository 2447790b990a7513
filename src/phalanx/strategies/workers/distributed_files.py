"""Where each worker writes a callback's file: the chief to the real path, others to a temp dir.

Every worker runs the same saving code — a state read or ``model.save`` may be a
collective, and nothing collective may sit behind a chief check. A worker that is not the
chief writes to ``workertemp_<task_id>``, a folder next to the target, and removes it
afterwards: TensorFlow's ``write_filepath``/``remove_temp_dirpath`` rule.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

__all__ = [
    "chief_print",
    "is_chief",
    "remove_temp_dir_with_filepath",
    "remove_temp_dirpath",
    "strategy_of",
    "write_dirpath",
    "write_filepath",
]


def strategy_of(model: Any) -> Any:
    """``model.strategy``, or None for a model without one."""
    return getattr(model, "strategy", None)


def is_chief(strategy: Any) -> bool:
    """Whether this worker owns the real files (True without a strategy)."""
    return strategy is None or bool(strategy.is_chief)


def chief_print(model: Any, message: str) -> None:
    """Prints ``message`` on the chief only (Keras prints on every worker)."""
    if is_chief(strategy_of(model)):
        print(message, flush=True)


def _temp_dirname(strategy: Any) -> str:
    resolver = getattr(strategy, "cluster_resolver", None)
    task_id = getattr(resolver, "task_id", None) if resolver is not None else None
    # Without a cluster there is no task id; the process id keeps workers apart.
    return f"workertemp_{task_id}" if task_id is not None else f"workertemp_pid{os.getpid()}"


def _temp_dir(dirpath: str, strategy: Any) -> str:
    base = _temp_dirname(strategy)
    return dirpath if os.path.basename(os.path.normpath(dirpath)) == base else os.path.join(dirpath, base)


def _is_file_path(path: str) -> bool:
    """Whether ``path`` names a file (an existing one, or a name with a suffix: ``model.pt``)."""
    return os.path.isfile(path) or bool(os.path.splitext(os.path.basename(os.path.normpath(path)))[1])


def write_dirpath(dirpath: str, strategy: Any) -> str:
    """The folder this worker writes into: ``dirpath`` on the chief, else its temp folder (created).

    Given a file path (``model.pt``), it answers as `write_filepath`: a folder made inside it
    on a worker would turn the chief's file into a directory (IsADirectoryError at its save).
    """
    if _is_file_path(dirpath):
        return write_filepath(dirpath, strategy)
    if is_chief(strategy):
        return dirpath
    temp = _temp_dir(dirpath, strategy)
    os.makedirs(temp, exist_ok=True)
    return temp


def write_filepath(filepath: str, strategy: Any) -> str:
    """The path this worker writes ``filepath`` to (all workers call it).

    The chief gets ``filepath``; another worker gets
    ``<dirname>/workertemp_<task_id>/<basename>``, its folder created.
    """
    dirpath, base = os.path.split(filepath)
    return os.path.join(write_dirpath(dirpath, strategy), base)


def remove_temp_dirpath(dirpath: str, strategy: Any) -> None:
    """Removes this worker's temp folder under ``dirpath`` (nothing on the chief).

    ``dirpath`` is the folder given to `write_dirpath` (or the temp folder itself).
    """
    if _is_file_path(dirpath):
        dirpath = os.path.dirname(dirpath)
    if not is_chief(strategy):
        shutil.rmtree(_temp_dir(dirpath, strategy), ignore_errors=True)


def remove_temp_dir_with_filepath(filepath: str, strategy: Any) -> None:
    """`remove_temp_dirpath` for the folder of a path from `write_filepath` or its target."""
    remove_temp_dirpath(os.path.dirname(filepath), strategy)
