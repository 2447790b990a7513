"""Op: one step of a pipeline, either a source (no inputs) or a transformation of inputs.

A `Dataset` is an op plus the datasets it reads from. Ops are immutable descriptions: each
``iterate`` call starts a fresh pass, so a dataset can be iterated any number of times. Ops
see their inputs through `Input`, the little of a `Dataset` they use, so no op imports
dataset.py (which imports every op).
What differs between transformations lives in their op class, never in checks on a kind.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from phalanx.data.dataset_options import Options
    from phalanx.data.rows import Rows

__all__ = ["Input", "Op"]


class Input(Protocol):
    """What an op reads from an input dataset: `Dataset` is the one implementation."""

    def __iter__(self) -> Iterator[Any]:
        """A fresh pass over the input's elements."""
        ...

    def source_rows(self) -> Rows | None:
        """The input's source tensors and row order, when its elements are plain rows."""
        ...


class Op(abc.ABC):
    """A source or transformation; subclasses say how to iterate and how many elements come out.

    Attributes:
        name: The tf.data name of the operation (``"batch"``), shown in reprs.
    """

    name: str = "op"

    @abc.abstractmethod
    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        """A fresh pass over the elements, reading from ``inputs``."""

    @abc.abstractmethod
    def cardinality(self, inputs: Sequence[int]) -> int:
        """The element count given the inputs' cardinalities (or INFINITE/UNKNOWN)."""

    def rows(self, inputs: Sequence[Input]) -> Rows | None:
        """The source tensors and row order this op yields, when it yields plain rows of them.

        `batch` uses it to slice or gather whole batches instead of stacking element by
        element. None (the default) means the elements are not plain rows.
        """
        return None

    @property
    def files(self) -> list[str] | None:
        """The files a source reads (None: not a file source, or not a source)."""
        return None

    def with_files(self, files: list[str]) -> Op:
        """This file source over ``files`` instead. Only file sources override it."""
        raise NotImplementedError(f"{self.name} does not read files.")

    @property
    def options(self) -> Options | None:
        """The options this op sets (only `with_options` sets any)."""
        return None

    def shard_block_below(self, block: int) -> int | None:
        """Where a shard of ``block``-element blocks taken after this op can be taken before it.

        Keeping blocks ``index, index + n, ...`` of this op's output equals keeping blocks of
        the returned size of its input and applying the op to them: the size, or None when
        no such shard exists (the op's output depends on elements it would not see). This is
        how a DataLoader worker shards at the source (`Dataset.__iter__`). Default: None.
        """
        return None

    def fresh(self) -> Op:
        """This op with empty state, for a rebuilt chain; stateless ops return themselves."""
        return self

    def describe(self) -> str:
        """A short label for reprs, such as ``batch(32)``."""
        return self.name
