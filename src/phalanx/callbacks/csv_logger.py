"""CSVLogger: one CSV row of logs per epoch (the chief's file; other workers' copies are removed)."""

from __future__ import annotations

import csv
import os
from typing import IO, Any

import torch

from phalanx.callbacks.callback import Callback, Logs
from phalanx.strategies.workers.distributed_files import (
    remove_temp_dir_with_filepath,
    strategy_of,
    write_filepath,
)

__all__ = ["CSVLogger"]


def _cell(value: Any) -> Any:
    """A log value as CSV text: numbers as numbers, several numbers as ``[a, b]``."""
    if isinstance(value, str):
        return value
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(map(str, value))}]"
    return value


class CSVLogger(Callback):
    """Streams epoch logs to a CSV file: ``epoch`` then the log keys, sorted (Keras' layout).

    The columns are fixed by the first epoch; when it has no ``val_`` keys, ``val_`` columns
    are added for every key (filled with ``NA``), as Keras does, so later validation fits.
    Every worker runs it; the chief writes ``filename``, the others a temporary copy that is
    removed when training ends.

    Args:
        filename: Path of the CSV file.
        separator: Field separator.
        append: Append to an existing file (its header is kept) instead of overwriting it.
    """

    def __init__(self, filename: str, separator: str = ",", append: bool = False) -> None:
        super().__init__()
        self.filename, self.sep, self.append = os.fspath(filename), separator, append
        self.keys: list[str] | None = None
        self._file: IO[str] | None = None
        self._writer: Any = None
        self._path = self.filename

    def on_train_begin(self, logs: Logs = None) -> None:
        self._close()
        self._path = write_filepath(self.filename, strategy_of(self.model))
        header = True
        if self.append and os.path.exists(self._path):
            with open(self._path, encoding="utf-8") as existing:
                header = not existing.readline()
        self._file = open(self._path, "a" if self.append else "w", newline="", encoding="utf-8")  # noqa: SIM115
        self._header, self.keys, self._writer = header, None, None

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        logs = logs or {}
        if self._file is None:
            self.on_train_begin()
        assert self._file is not None
        if self.keys is None:
            self.keys = sorted(logs)
            if self.keys and not any(key.startswith("val_") for key in self.keys):
                self.keys += [f"val_{key}" for key in self.keys]
        if self._writer is None:
            self._writer = csv.DictWriter(self._file, fieldnames=["epoch", *self.keys], delimiter=self.sep)
            if self._header:
                self._writer.writeheader()
        self._writer.writerow({"epoch": epoch, **{key: _cell(logs.get(key, "NA")) for key in self.keys}})
        self._file.flush()

    def on_train_end(self, logs: Logs = None) -> None:
        self._close()
        remove_temp_dir_with_filepath(self._path, strategy_of(self.model))

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer = None, None
