"""Sources: the ops a pipeline starts from (tensor slices, ranges, generators, file lists)."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from phalanx.data import structure
from phalanx.data.cardinality import UNKNOWN
from phalanx.data.op import Input, Op
from phalanx.data.rows import Rows

__all__ = ["FileList", "Generator", "Range", "TensorSlices", "glob_files"]

PathLike = str | os.PathLike[str]


class TensorSlices(Op):
    """One element per row of a structure of tensors (``from_tensor_slices``, ``from_tensors``)."""

    name = "from_tensor_slices"

    def __init__(self, data: Any, size: int) -> None:
        self._data, self._size = data, size

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return (structure.index(self._data, i) for i in range(self._size))

    def cardinality(self, inputs: Sequence[int]) -> int:
        return self._size

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        return Rows(self._data, range(self._size))

    def describe(self) -> str:
        return f"{self.name}({self._size})"


class Range(Op):
    """Integers as Python's ``range`` gives them, as scalar tensors of one dtype, made lazily."""

    name = "range"

    def __init__(self, values: range, dtype: torch.dtype) -> None:
        self._values, self._dtype = values, dtype

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return (torch.tensor(v, dtype=self._dtype) for v in self._values)

    def cardinality(self, inputs: Sequence[int]) -> int:
        return len(self._values)

    def describe(self) -> str:
        v = self._values
        return f"range({v.start}, {v.stop}, {v.step})"


class Generator(Op):
    """Elements from a callable returning an iterable, called anew for every pass."""

    name = "from_generator"

    def __init__(self, generator: Callable[[], Iterable[Any]]) -> None:
        self._generator = generator

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        produced = self._generator()
        if not isinstance(produced, Iterable):
            raise TypeError(
                "from_generator's callable must return an iterable (a generator, a list...). "
                f"Received: {type(produced).__name__}. HINT: pass the generator function itself, "
                "not the result of calling it with a wrong signature."
            )
        return (structure.to_tensors(e) for e in produced)

    def cardinality(self, inputs: Sequence[int]) -> int:
        return UNKNOWN  # a generator's length is only known by running it


class FileList(Op):
    """File paths as string elements; the op a FILE-sharded pipeline is rebuilt from."""

    name = "list_files"

    def __init__(self, files: list[str]) -> None:
        self._files = list(files)

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        return iter(list(self._files))

    def cardinality(self, inputs: Sequence[int]) -> int:
        return len(self._files)

    @property
    def files(self) -> list[str] | None:
        return list(self._files)

    def with_files(self, files: list[str]) -> Op:
        return FileList(files)

    def describe(self) -> str:
        return f"{self.name}({len(self._files)} files)"


def as_paths(what: str, paths: PathLike | Sequence[PathLike]) -> list[str]:
    """One path or a sequence of paths as a list of str.

    Raises:
        TypeError: An entry is not a str or os.PathLike.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    for p in items:
        if not isinstance(p, (str, os.PathLike)):
            raise TypeError(
                f"{what} needs paths as str or os.PathLike. Received: {p!r} ({type(p).__name__})."
            )
    return [os.fspath(p) for p in items]


def glob_files(patterns: list[str]) -> list[str]:
    """The sorted, de-duplicated files matching any of ``patterns``.

    Raises:
        ValueError: Nothing matches.
    """
    files = sorted({f for p in patterns for f in glob.glob(p) if os.path.isfile(f)})
    if not files:
        raise ValueError(
            f"list_files found no file matching {patterns}. HINT: check the path and the glob "
            f"syntax (*, ?, [...]); relative patterns are read from {os.getcwd()}."
        )
    return files
