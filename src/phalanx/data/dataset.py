"""phalanx.data.Dataset: the tf.data subset the distribution guides use, on torch.utils.data.

A Dataset is an immutable chain of ops (`phalanx.data.op.Op`) over a source; every
``iter()`` starts from the beginning. A chain built on files remembers them
(`Dataset.source_files`) and can be rebuilt over a subset (`Dataset.with_source_files`),
which is how the distribution layer shards by FILE.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from phalanx.data import structure
from phalanx.data._checks import require_callable, require_int
from phalanx.data.batching import Batch, Unbatch
from phalanx.data.cardinality import INFINITE, describe, is_known
from phalanx.data.combine import Concatenate, Zip
from phalanx.data.dataset_options import Options
from phalanx.data.generator_types import typed_generator
from phalanx.data.interleave import Interleave
from phalanx.data.op import Op
from phalanx.data.parallel import AUTOTUNE, resolve_parallelism
from phalanx.data.prefetch import Prefetch
from phalanx.data.repeat import Repeat
from phalanx.data.rows import Rows
from phalanx.data.selection import Shard, Skip, Take
from phalanx.data.shuffle import Shuffle
from phalanx.data.sources import FileList, Generator, PathLike, Range, TensorSlices, as_paths, glob_files
from phalanx.data.transforms import Cache, Enumerate, Filter, Map, WithOptions

__all__ = ["Dataset"]

_PREFETCH_AUTOTUNE = 2  # elements buffered for prefetch(AUTOTUNE)
_COUNT_HINT = "use -1 (or None for repeat) to mean all / forever."


class Dataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A re-iterable pipeline of elements: tensors, or tuples and dicts of them.

    Build one with a static constructor (`from_tensor_slices`, `list_files`, ...), then chain
    transformations; each returns a new Dataset and leaves this one unchanged. A Dataset is a
    torch ``IterableDataset``: ``DataLoader(ds, batch_size=None)`` yields its elements, and
    with ``num_workers=n`` each worker process reads its share, taken at the source where
    the order allows, so the loader gives each element once, in order, and each map runs
    once per element in all (the workers need the fork start method: ops hold lambdas).

    Args:
        op: The source or transformation (internal: use the constructors).
        inputs: The datasets ``op`` reads from.
    """

    def __init__(self, op: Op, inputs: Sequence[Dataset] = ()) -> None:
        super().__init__()
        self._op, self._inputs = op, tuple(inputs)
        self._cardinality: int = op.cardinality([d.cardinality() for d in self._inputs])

    def _then(self, op: Op) -> Dataset:
        return Dataset(op, (self,))

    # The pipeline's own calls between its nodes (not in tf.data): the ops read an input's rows
    # (`source_rows`), a DataLoader worker takes its share (`worker_share`), and reprs describe
    # the chain (`describe_chain`). Each node answers for itself and asks its inputs in turn.
    def source_rows(self) -> Rows | None:
        """The source rows this dataset yields, if it only selects rows (see `phalanx.data.rows`).

        Called by the ops above it (`batch` cuts whole batches out of them)."""
        return self._op.rows(self._inputs)

    # ------------------------------------------------------------------ sources
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """One element per row of a tensor, array, list, or tuple/dict of them.

        NumPy arrays become tensors sharing their memory and dtype (float64 stays float64).

        Raises:
            ValueError: A component is a scalar, or components differ in their first dimension.
        """
        data = structure.to_tensors(tensors)
        return Dataset(TensorSlices(data, structure.leading_size(data, "from_tensor_slices")))

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """A dataset of exactly one element: ``tensors`` (converted like from_tensor_slices)."""
        data = structure.to_tensors(tensors)
        rows = structure.map_leaves(lambda v: v.unsqueeze(0) if isinstance(v, torch.Tensor) else [v], data)
        return Dataset(TensorSlices(rows, 1))

    @staticmethod
    def range(*args: int, dtype: torch.dtype = torch.int64) -> Dataset:
        """Integers as ``range(stop)`` / ``range(start, stop[, step])`` gives them, as scalar tensors.

        Raises:
            TypeError: Not one to three int arguments.
            ValueError: ``step`` is 0.
        """
        if not 1 <= len(args) <= 3 or not all(isinstance(a, int) for a in args):
            raise TypeError(
                f"Dataset.range takes 1 to 3 ints (stop | start, stop[, step]). Received: {args}."
            )
        if len(args) == 3 and args[2] == 0:
            raise ValueError("Dataset.range's step must not be 0. Received: step=0.")
        return Dataset(Range(builtins.range(*args), dtype))

    @staticmethod
    def from_generator(
        generator: Callable[..., Iterable[Any]],
        output_types: Any = None,
        output_shapes: Any = None,
        args: tuple[Any, ...] | None = None,
        output_signature: Any = None,
    ) -> Dataset:
        """Elements from ``generator(*args)``, called anew for every pass; cardinality UNKNOWN.

        With TF's ``output_types`` (and ``output_shapes``) or ``output_signature``, each
        element becomes tensors of those dtypes and is checked against those shapes
        (`phalanx.data.generator_types`); without them elements are taken as they come.

        Raises:
            TypeError: ``generator`` is not callable (at iteration: it returned no iterable).
            ValueError: Declarations that break TF's rules, or (at iteration) an element that
                does not match them.
        """
        require_callable("from_generator's generator", generator)
        call_args = tuple(args or ())
        made: Callable[[], Iterable[Any]] = lambda: generator(*call_args)  # noqa: E731
        if output_types is not None or output_shapes is not None or output_signature is not None:
            made = typed_generator(made, output_types, output_shapes, output_signature)
        return Dataset(Generator(made))

    @staticmethod
    def from_files(paths: PathLike | Sequence[PathLike], reader: Callable[[str], Iterable[Any]]) -> Dataset:
        """The elements ``reader(path)`` yields for each file in turn; remembers the files.

        Raises:
            TypeError: ``reader`` is not callable, or a path is not a str/PathLike.
            ValueError: ``paths`` is empty.
        """
        files = as_paths("from_files", paths)
        require_callable("from_files' reader", reader)
        if not files:
            raise ValueError("from_files needs at least one path. Received: []. HINT: check the file list.")
        return Dataset(FileList(files)).flat_map(reader)

    @staticmethod
    def list_files(
        file_pattern: PathLike | Sequence[PathLike], shuffle: bool = False, seed: int | None = None
    ) -> Dataset:
        """The paths (str elements) matching glob pattern(s), sorted, or shuffled each epoch.

        Args:
            file_pattern: A glob pattern or several; files matching any are listed once.
            shuffle: Shuffle the list, anew each epoch (the shuffle runs after the file
                source, so FILE sharding still splits the sorted list).
            seed: Seed of that shuffle.

        Raises:
            ValueError: No file matches.
        """
        files = glob_files(as_paths("list_files", file_pattern))
        ds = Dataset(FileList(files))
        return ds.shuffle(len(files), seed=seed) if shuffle else ds

    @staticmethod
    def zip(*datasets: Dataset | Sequence[Dataset] | Mapping[str, Dataset]) -> Dataset:
        """Elements of several datasets together: ``zip((a, b))`` or ``zip(a, b)`` gives tuples,
        ``zip({"x": a, "y": b})`` dicts. Stops with the shortest.

        Raises:
            TypeError: An input is not a Dataset.
            ValueError: No dataset is given.
        """
        given: Any = datasets[0] if len(datasets) == 1 and not isinstance(datasets[0], Dataset) else datasets
        keys = [str(k) for k in given] if isinstance(given, Mapping) else None
        parts = list(given.values()) if isinstance(given, Mapping) else list(given)
        if not parts:
            raise ValueError("Dataset.zip needs at least one dataset. Received none.")
        for d in parts:
            _require_dataset("Dataset.zip", d)
        return Dataset(Zip(keys), parts)

    # ------------------------------------------------------------------ files and options
    def source_files(self) -> list[str] | None:
        """The files this pipeline reads, walking the chain to its source; None if none.

        Only single-input chains are walked: after zip or concatenate this is None.
        """
        if self._op.files is not None:
            return self._op.files
        return self._inputs[0].source_files() if len(self._inputs) == 1 else None

    def with_source_files(self, files: Sequence[PathLike]) -> Dataset:
        """The same chain of transformations, read from ``files`` instead of the source's.

        Stateful steps start afresh (an empty cache, shuffles at their first epoch).

        Raises:
            ValueError: This dataset is not read from files.
        """
        paths = as_paths("with_source_files", files)
        if self.source_files() is None:
            raise ValueError(
                f"with_source_files needs a dataset read from files; this one is {self!r}. HINT: "
                "build it from Dataset.list_files or Dataset.from_files."
            )
        if self._op.files is not None:
            return Dataset(self._op.with_files(paths))
        return Dataset(self._op.fresh(), (self._inputs[0].with_source_files(paths),))

    def with_options(self, options: Options) -> Dataset:
        """This dataset with ``options`` merged over the chain's (fields set here win).

        Raises:
            TypeError: ``options`` is not a phalanx.data.Options.
        """
        if not isinstance(options, Options):
            raise TypeError(f"with_options needs a phalanx.data.Options. Received: {type(options).__name__}.")
        return self._then(WithOptions(options))

    def options(self) -> Options:
        """The options in effect: the inputs' merged, then the outermost setting of each field."""
        merged = Options()
        for d in self._inputs:
            merged = merged.merge(d.options())
        own = self._op.options
        return merged.merge(own) if own is not None else merged

    # ------------------------------------------------------------------ size and iteration
    def cardinality(self) -> int:
        """The number of elements when the chain tells it, else `INFINITE` or `UNKNOWN`."""
        return self._cardinality

    def __len__(self) -> int:
        """The cardinality, when known.

        Raises:
            TypeError: The cardinality is INFINITE or UNKNOWN (so ``list(ds)`` still works).
        """
        if not is_known(self._cardinality):
            reason = (
                "repeat() without a count"
                if self._cardinality == INFINITE
                else "filter, a generator, files..."
            )
            raise TypeError(
                f"This dataset's length is {describe(self._cardinality)} ({reason}), so len() is "
                "undefined. HINT: check cardinality() first, or use take(n) for a known length."
            )
        return self._cardinality

    def __bool__(self) -> bool:
        return True  # as tf.data: truth does not depend on a length that may be unknown

    def __iter__(self) -> Iterator[Any]:
        """A fresh pass over the elements, from the beginning.

        In a DataLoader worker (``num_workers`` > 1), the dataset the loader holds yields its
        share: the elements ``id, id + n, ...``, so that the loader, which takes one element
        from each worker in turn, gives each element once and in order. The share is taken as
        near the source as the order allows (`worker_share`): every map above it runs once
        per element in all, not once per worker.
        """
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1 and worker.dataset is self:
            # the share is a new chain, which the loader does not hold: it iterates plainly
            return iter(self.worker_share(worker.num_workers, worker.id))
        return self._op.iterate(self._inputs)

    def worker_share(self, num_shards: int, index: int, block: int = 1) -> Dataset:
        """This chain keeping blocks ``index, index + num_shards, ...`` of ``block`` elements, with
        the shard moved below every op that allows it (`Op.shard_block_below`): map, prefetch,
        with_options and batch (whose blocks become whole batches). It stops at the first op
        whose output depends on elements another worker reads (shuffle, filter, repeat, ...):
        the chain below that runs in every worker.

        Called by ``__iter__`` in a DataLoader worker process, for the worker's share; unlike
        `shard`, the result's elements keep their order across the workers' shares.
        """
        below = self._op.shard_block_below(block) if len(self._inputs) == 1 else None
        if below is None:  # a copy of this node: the loader's own dataset would shard itself again
            return Dataset(Shard(num_shards, index, block), (Dataset(self._op, self._inputs),))
        return Dataset(self._op, (self._inputs[0].worker_share(num_shards, index, below),))

    def as_numpy_iterator(self) -> Iterator[Any]:
        """The elements with every tensor converted to a NumPy array."""
        return (
            structure.map_leaves(lambda v: v.numpy() if isinstance(v, torch.Tensor) else v, e) for e in self
        )

    def __repr__(self) -> str:
        return f"<Dataset {self.describe_chain()}, cardinality={describe(self._cardinality)}>"

    def describe_chain(self) -> str:
        """The chain of ops from the source(s) up, as ``repr`` shows it: ``range(10) -> batch(2)``."""
        if not self._inputs:
            return self._op.describe()
        if len(self._inputs) == 1:
            return f"{self._inputs[0].describe_chain()} -> {self._op.describe()}"
        return f"{self._op.describe()}({', '.join(d.describe_chain() for d in self._inputs)})"

    # ------------------------------------------------------------------ element-wise
    def map(
        self, fn: Callable[..., Any], num_parallel_calls: int | None = None, deterministic: bool | None = None
    ) -> Dataset:
        """``fn`` applied to each element (a tuple is unpacked into arguments, as in tf.data).

        ``num_parallel_calls`` > 1 or `AUTOTUNE` calls ``fn`` on a thread pool; the output
        order is always the input order (``deterministic`` is accepted for TF code).

        Raises:
            TypeError: ``fn`` is not callable.
            ValueError: ``num_parallel_calls`` is 0 or below -1.
        """
        require_callable("map's fn", fn)
        return self._then(Map(fn, resolve_parallelism("map's num_parallel_calls", num_parallel_calls)))

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Only the elements for which ``predicate`` returns true (cardinality UNKNOWN).

        Raises:
            TypeError: ``predicate`` is not callable.
        """
        require_callable("filter's predicate", predicate)
        return self._then(Filter(predicate))

    def enumerate(self, start: int = 0) -> Dataset:
        """``(index, element)`` pairs, the index an int64 scalar tensor from ``start``."""
        return self._then(Enumerate(require_int("enumerate's start", start, -(2**63))))

    def cache(self) -> Dataset:
        """The first complete pass kept in memory; later passes replay it."""
        return self._then(Cache())

    def prefetch(self, buffer_size: int) -> Dataset:
        """Elements produced up to ``buffer_size`` ahead on a background thread (`AUTOTUNE`: 2).

        The thread stops when the iterator is exhausted, closed or garbage-collected; an
        exception raised while producing is raised to the consumer.

        Raises:
            ValueError: ``buffer_size`` is below -1.
        """
        size = _PREFETCH_AUTOTUNE if buffer_size == AUTOTUNE else buffer_size
        require_int("prefetch's buffer_size", size, 0, "use phalanx.data.AUTOTUNE (-1) or a count >= 0.")
        return self._then(Prefetch(size))

    # ------------------------------------------------------------------ order and grouping
    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """tf.data's buffered shuffle; a seed makes every epoch's order reproducible.

        Args:
            buffer_size: Elements held for random picks; the dataset size gives a full shuffle.
            seed: Fixes the order of every epoch. Without one, a seed is drawn from torch's
                global generator now (so ``torch.manual_seed`` fixes it too).
            reshuffle_each_iteration: Order each pass (epoch) differently; the sequence of
                orders is still fixed by the seed.

        Raises:
            TypeError: ``buffer_size`` or ``seed`` is not an int.
            ValueError: ``buffer_size`` < 1.
        """
        require_int("shuffle's buffer_size", buffer_size, 1, "use the dataset size for a full shuffle.")
        if seed is not None:
            require_int("shuffle's seed", seed, -(2**63))
        return self._then(Shuffle(buffer_size, seed, bool(reshuffle_each_iteration)))

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Consecutive elements stacked into batched tensors (tuples and dicts kept).

        A partial last batch is kept unless ``drop_remainder``. Over tensor slices (optionally
        shuffled, taken, skipped, sharded or repeated) a batch is cut with one slice or gather.

        Raises:
            ValueError: ``batch_size`` < 1 (at iteration: elements differ in shape or structure).
        """
        require_int("batch_size", batch_size, 1)
        return self._then(Batch(batch_size, bool(drop_remainder)))

    def unbatch(self) -> Dataset:
        """The rows of every element, splitting batches apart (cardinality UNKNOWN)."""
        return self._then(Unbatch())

    def repeat(self, count: int | None = None) -> Dataset:
        """The dataset ``count`` times over; forever when ``count`` is None or -1.

        Raises:
            ValueError: ``count`` is below -1.
        """
        return self._then(
            Repeat(-1 if count is None else require_int("repeat's count", count, -1, _COUNT_HINT))
        )

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all when -1).

        Raises:
            ValueError: ``count`` is below -1.
        """
        return self._then(Take(require_int("take's count", count, -1, _COUNT_HINT)))

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements (none when -1, as in tf.data).

        Raises:
            ValueError: ``count`` is below -1.
        """
        return self._then(Skip(require_int("skip's count", count, -1, _COUNT_HINT)))

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, starting with element ``index``.

        Raises:
            ValueError: ``num_shards`` < 1, or ``index`` outside ``[0, num_shards)``.
        """
        require_int("shard's num_shards", num_shards, 1)
        if not 0 <= require_int("shard's index", index, 0) < num_shards:
            raise ValueError(
                f"shard's index must be in [0, num_shards={num_shards}). Received: index={index}. "
                "HINT: pass the worker's index, e.g. input_context.input_pipeline_id."
            )
        return self._then(Shard(num_shards, index))

    # ------------------------------------------------------------------ combining
    def concatenate(self, other: Dataset) -> Dataset:
        """This dataset's elements, then ``other``'s.

        Raises:
            TypeError: ``other`` is not a Dataset.
        """
        _require_dataset("concatenate", other)
        return Dataset(Concatenate(), (self, other))

    def flat_map(self, fn: Callable[..., Iterable[Any]]) -> Dataset:
        """Each element mapped to a Dataset (or iterable), their elements one after another.

        Raises:
            TypeError: ``fn`` is not callable (at iteration: it returned no iterable).
        """
        require_callable("flat_map's fn", fn)
        return self._then(Interleave(fn, 1, 1, False, "flat_map"))

    def interleave(
        self,
        fn: Callable[..., Iterable[Any]],
        cycle_length: int = 1,
        block_length: int = 1,
        num_parallel_calls: int | None = None,
    ) -> Dataset:
        """Elements of ``fn(element)``'s datasets, ``cycle_length`` of them round-robin, in tf.data's order.

        Args:
            fn: Maps an element (a file path, say) to a Dataset or an iterable of elements.
            cycle_length: Inner datasets open at once (`AUTOTUNE`: one per CPU).
            block_length: Elements taken from one inner dataset before moving to the next.
            num_parallel_calls: > 1 or `AUTOTUNE` reads each open inner dataset ahead on a
                background thread; the order stays the same.

        Raises:
            TypeError: ``fn`` is not callable (at iteration: it returned no iterable).
            ValueError: ``cycle_length`` or ``block_length`` < 1, or a bad ``num_parallel_calls``.
        """
        require_callable("interleave's fn", fn)
        cycle = resolve_parallelism("interleave's cycle_length", cycle_length, "1 reads one file at a time.")
        require_int("interleave's block_length", block_length, 1)
        background = resolve_parallelism("interleave's num_parallel_calls", num_parallel_calls) > 1
        return self._then(Interleave(fn, cycle, block_length, background, "interleave"))


def _require_dataset(what: str, value: Any) -> None:
    if not isinstance(value, Dataset):
        raise TypeError(f"{what} needs phalanx.data.Dataset inputs. Received: {type(value).__name__}.")
