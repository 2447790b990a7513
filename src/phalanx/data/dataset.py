"""phalanx.data.Dataset: the tf.data subset the distribution guides use, on torch.utils.data.

A Dataset is an immutable chain of transformations over a source; every ``iter()`` starts
from the beginning. A chain built on files remembers them (`source_files`) and can be
rebuilt over a subset (`with_source_files`), which is how FILE auto-sharding works.
"""

from __future__ import annotations

import glob
import itertools
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from phalanx.data import structure
from phalanx.data.options import Options

__all__ = ["AUTOTUNE", "INFINITE", "UNKNOWN", "Dataset"]

AUTOTUNE = -1
INFINITE = -1
UNKNOWN = -2

Transform = Callable[[Any], Iterator[Any]]  # parent dataset (None for sources) -> elements


def _apply(fn: Callable[..., Any], element: Any) -> Any:
    return fn(*element) if isinstance(element, tuple) and not hasattr(element, "_fields") else fn(element)


class Dataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A re-iterable pipeline of elements (tensors, tuples or dicts of tensors).

    Usable directly with ``torch.utils.data.DataLoader(ds, batch_size=None)``.
    """

    def __init__(
        self,
        parent: Dataset | None,
        transform: Transform,
        cardinality: int,
        files: list[str] | None = None,
        rebuild: Callable[[list[str]], Dataset] | None = None,
        options: Options | None = None,
        tensors: Any = None,
    ) -> None:
        super().__init__()
        self._parent, self._transform, self._cardinality = parent, transform, cardinality
        self._files, self._rebuild = files, rebuild
        self._options = options
        self._tensors = tensors  # the source tensors of from_tensor_slices (fast batching)
        self._epoch = 0

    def __iter__(self) -> Iterator[Any]:
        self._epoch += 1
        return self._transform(self._parent)

    def _derive(self, transform: Transform, cardinality: int) -> Dataset:
        return Dataset(self, transform, cardinality)

    # ---------------------------------------------------------------- sources
    @staticmethod
    def from_tensor_slices(tensors: Any) -> Dataset:
        """One element per row of the given tensor, array, tuple or dict of them.

        Raises:
            ValueError: Components differ in their first dimension.
        """
        data = structure.to_tensors(tensors)
        n = structure.leading_size(data)
        return Dataset(None, lambda _: (structure.index(data, i) for i in range(n)), n, tensors=data)

    @staticmethod
    def from_tensors(tensors: Any) -> Dataset:
        """A dataset of one element: ``tensors`` itself."""
        data = structure.to_tensors(tensors)
        return Dataset(None, lambda _: iter([data]), 1)

    @staticmethod
    def range(*args: int) -> Dataset:
        """Integers as in Python's range, as int64 scalars."""
        values = range(*args)
        return Dataset(None, lambda _: (torch.tensor(v) for v in values), len(values))

    @staticmethod
    def from_generator(generator: Callable[[], Iterable[Any]]) -> Dataset:
        """Elements from ``generator()`` (called anew for every iteration)."""
        if not callable(generator):
            raise TypeError(
                f"from_generator needs a callable returning an iterable. Received: {generator!r}."
            )
        return Dataset(None, lambda _: (structure.to_tensors(e) for e in generator()), UNKNOWN)

    @staticmethod
    def from_files(paths: list[str], reader: Callable[[str], Iterable[Any]]) -> Dataset:
        """Elements read from each file in turn by ``reader(path)``; remembers the files."""
        files = [str(p) for p in paths]

        def make(subset: list[str]) -> Dataset:
            return Dataset(
                None,
                lambda _: (structure.to_tensors(e) for f in subset for e in reader(f)),
                UNKNOWN,
                files=subset,
                rebuild=make,
            )

        return make(files)

    @staticmethod
    def list_files(file_pattern: str | list[str], shuffle: bool = False, seed: int | None = None) -> Dataset:
        """The paths matching the glob pattern(s), sorted (or shuffled with ``seed``).

        Raises:
            ValueError: Nothing matches.
        """
        patterns = [file_pattern] if isinstance(file_pattern, str) else list(file_pattern)
        files = sorted({f for p in patterns for f in glob.glob(p)})
        if not files:
            raise ValueError(f"No files match {patterns}.")
        if shuffle:
            order = torch.randperm(len(files), generator=torch.Generator().manual_seed(seed or 0)).tolist()
            files = [files[i] for i in order]

        def make(subset: list[str]) -> Dataset:
            return Dataset(None, lambda _: iter(list(subset)), len(subset), files=subset, rebuild=make)

        return make(files)

    # ---------------------------------------------------------------- files and options
    def source_files(self) -> list[str] | None:
        """The files this pipeline reads, if it is built on files."""
        node: Dataset | None = self
        while node is not None:
            if node._files is not None:
                return list(node._files)
            node = node._parent
        return None

    def with_source_files(self, files: list[str]) -> Dataset:
        """The same chain of transformations over only ``files``.

        Raises:
            ValueError: This dataset is not built on files.
        """
        if self._rebuild is not None:
            return self._rebuild(list(files))
        if self._parent is None:
            raise ValueError(
                "This dataset is not read from files, so it cannot be rebuilt over a subset of files."
            )
        clone = Dataset(
            self._parent.with_source_files(files),
            self._transform,
            UNKNOWN,
            options=self._options,
            tensors=None,
        )
        return clone

    def with_options(self, options: Options) -> Dataset:
        """This dataset with ``options`` merged over the existing ones."""
        if not isinstance(options, Options):
            raise TypeError(f"with_options needs phalanx.data.Options. Received: {type(options).__name__}.")
        return Dataset(self, lambda parent: iter(parent), self._cardinality, options=options)

    def options(self) -> Options:
        """The merged options of the chain."""
        chain = []
        node: Dataset | None = self
        while node is not None:
            if node._options is not None:
                chain.append(node._options)
            node = node._parent
        merged = Options()
        for opts in reversed(chain):
            merged = merged.merge(opts)
        return merged

    # ---------------------------------------------------------------- size
    def cardinality(self) -> int:
        """Number of elements, `INFINITE` or `UNKNOWN`."""
        return self._cardinality

    def __len__(self) -> int:
        if self._cardinality < 0:
            kind = "infinite" if self._cardinality == INFINITE else "unknown"
            raise TypeError(f"The length of this dataset is {kind}. HINT: use cardinality(), or take(n).")
        return self._cardinality

    def as_numpy_iterator(self) -> Iterator[Any]:
        """Elements with tensors converted to NumPy arrays."""
        return (
            structure.map_leaves(lambda v: v.numpy() if isinstance(v, torch.Tensor) else v, e) for e in self
        )

    # ---------------------------------------------------------------- transformations
    def map(
        self, fn: Callable[..., Any], num_parallel_calls: int | None = None, deterministic: bool | None = None
    ) -> Dataset:
        """Applies ``fn`` to every element (tuples unpacked into arguments); in order.

        ``num_parallel_calls`` > 1 (or AUTOTUNE) runs ``fn`` on that many threads.
        """
        workers = (
            4 if num_parallel_calls == AUTOTUNE else (1 if num_parallel_calls is None else num_parallel_calls)
        )
        if workers < 1:
            raise ValueError(f"num_parallel_calls must be >= 1 or AUTOTUNE. Received: {num_parallel_calls}.")
        if workers == 1:
            return self._derive(lambda p: (_apply(fn, e) for e in p), self._cardinality)
        return self._derive(lambda p: _parallel_map(fn, iter(p), workers), self._cardinality)

    def filter(self, predicate: Callable[..., Any]) -> Dataset:
        """Keeps elements for which ``predicate`` is true."""
        return self._derive(lambda p: (e for e in p if bool(_apply(predicate, e))), UNKNOWN)

    def batch(self, batch_size: int, drop_remainder: bool = False) -> Dataset:
        """Stacks consecutive elements; a partial last batch is kept unless ``drop_remainder``.

        Raises:
            ValueError: ``batch_size`` < 1.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1. Received: {batch_size}.")
        n = self._cardinality
        card = n if n < 0 else (n // batch_size if drop_remainder else -(-n // batch_size))
        if self._tensors is not None:  # slicing instead of stacking
            data = self._tensors

            def slices(_: Any) -> Iterator[Any]:
                stop = n - n % batch_size if drop_remainder else n
                return (
                    structure.index(data, slice(i, min(i + batch_size, stop)))
                    for i in range(0, stop, batch_size)
                )

            return self._derive(slices, card)
        return self._derive(lambda p: _batches(iter(p), batch_size, drop_remainder), card)

    def unbatch(self) -> Dataset:
        """Splits batched elements into their rows."""

        def rows(p: Any) -> Iterator[Any]:
            for e in p:
                for i in range(structure.unstack_len(e)):
                    yield structure.index(e, i)

        return self._derive(rows, UNKNOWN)

    def shuffle(
        self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
    ) -> Dataset:
        """tf.data's buffered shuffle; deterministic given ``seed`` (and the epoch when reshuffling).

        Raises:
            ValueError: ``buffer_size`` < 1.
        """
        if buffer_size < 1:
            raise ValueError(f"buffer_size must be >= 1. Received: {buffer_size}.")
        base = seed if seed is not None else int(torch.randint(0, 2**62, ()).item())
        holder: dict[str, int] = {"epoch": 0}

        def shuffled(p: Any) -> Iterator[Any]:
            epoch = holder["epoch"]
            holder["epoch"] += 1 if reshuffle_each_iteration else 0
            gen = torch.Generator().manual_seed(base + 1_000_003 * epoch)
            return _buffer_shuffle(iter(p), buffer_size, gen)

        return self._derive(shuffled, self._cardinality)

    def repeat(self, count: int | None = None) -> Dataset:
        """Repeats the dataset ``count`` times (forever when None)."""

        def repeated(p: Any) -> Iterator[Any]:
            times = itertools.count() if count is None or count < 0 else range(count)
            for _ in times:
                yield from p

        n = self._cardinality
        card = INFINITE if count is None or count < 0 else (n * count if n >= 0 else n)
        return self._derive(repeated, card if n != 0 else 0)

    def take(self, count: int) -> Dataset:
        """The first ``count`` elements (all when -1)."""
        n = self._cardinality
        card = n if count < 0 else (count if n in (INFINITE,) else (min(n, count) if n >= 0 else UNKNOWN))
        return self._derive(lambda p: itertools.islice(p, None if count < 0 else count), card)

    def skip(self, count: int) -> Dataset:
        """All but the first ``count`` elements."""
        n = self._cardinality
        return self._derive(lambda p: itertools.islice(p, count, None), max(n - count, 0) if n >= 0 else n)

    def shard(self, num_shards: int, index: int) -> Dataset:
        """Every ``num_shards``-th element, starting at ``index``.

        Raises:
            ValueError: ``num_shards`` < 1 or ``index`` outside [0, num_shards).
        """
        if num_shards < 1 or not 0 <= index < num_shards:
            raise ValueError(
                f"shard needs num_shards >= 1 and 0 <= index < num_shards. Received: {num_shards}, {index}."
            )
        n = self._cardinality
        card = n if n < 0 else len(range(index, n, num_shards))
        return self._derive(lambda p: itertools.islice(p, index, None, num_shards), card)

    def enumerate(self, start: int = 0) -> Dataset:
        """(index, element) pairs."""
        return self._derive(
            lambda p: ((torch.tensor(i), e) for i, e in enumerate(p, start)), self._cardinality
        )

    def concatenate(self, other: Dataset) -> Dataset:
        """This dataset's elements, then ``other``'s."""
        a, b = self._cardinality, other._cardinality
        card = INFINITE if INFINITE in (a, b) else (a + b if a >= 0 and b >= 0 else UNKNOWN)
        return self._derive(lambda p: itertools.chain(p, other), card)

    @staticmethod
    def zip(datasets: tuple[Dataset, ...] | list[Dataset]) -> Dataset:
        """Tuples of elements taken together from each dataset (stops at the shortest)."""
        sets = tuple(datasets)
        cards = [d.cardinality() for d in sets]
        finite = [c for c in cards if c >= 0]
        card = min(finite) if finite else (INFINITE if all(c == INFINITE for c in cards) else UNKNOWN)
        return Dataset(None, lambda _: zip(*sets, strict=False), card)

    def flat_map(self, fn: Callable[..., Dataset | Iterable[Any]]) -> Dataset:
        """Maps each element to a dataset and flattens them in order."""
        return self._derive(lambda p: (e for x in p for e in _apply(fn, x)), UNKNOWN)

    def interleave(
        self,
        fn: Callable[..., Dataset | Iterable[Any]],
        cycle_length: int = 1,
        block_length: int = 1,
        num_parallel_calls: int | None = None,
    ) -> Dataset:
        """Maps elements to datasets, taking ``block_length`` from each of ``cycle_length`` in turn."""
        if cycle_length < 1 or block_length < 1:
            raise ValueError(
                f"cycle_length and block_length must be >= 1. Received: {cycle_length}, {block_length}."
            )
        return self._derive(lambda p: _interleave(iter(p), fn, cycle_length, block_length), UNKNOWN)

    def cache(self) -> Dataset:
        """Stores the first complete pass in memory; later passes replay it."""
        store: dict[str, list[Any]] = {}

        def cached(p: Any) -> Iterator[Any]:
            if "items" in store:
                yield from store["items"]
                return
            items = []
            for e in p:
                items.append(e)
                yield e
            store["items"] = items

        return self._derive(cached, self._cardinality)

    def prefetch(self, buffer_size: int = AUTOTUNE) -> Dataset:
        """Produces up to ``buffer_size`` elements ahead on a background thread."""
        size = 2 if buffer_size == AUTOTUNE else buffer_size
        if size < 0:
            raise ValueError(f"buffer_size must be >= 0 or AUTOTUNE. Received: {buffer_size}.")
        if size == 0:
            return self._derive(lambda p: iter(p), self._cardinality)
        return self._derive(lambda p: _Prefetcher(iter(p), size), self._cardinality)


def _batches(it: Iterator[Any], n: int, drop: bool) -> Iterator[Any]:
    while True:
        chunk = list(itertools.islice(it, n))
        if not chunk or (drop and len(chunk) < n):
            return
        yield structure.stack(chunk)


def _buffer_shuffle(it: Iterator[Any], size: int, gen: torch.Generator) -> Iterator[Any]:
    buffer = list(itertools.islice(it, size))
    for element in it:
        i = int(torch.randint(len(buffer), (), generator=gen))
        yield buffer[i]
        buffer[i] = element
    for i in torch.randperm(len(buffer), generator=gen).tolist():
        yield buffer[i]


def _parallel_map(fn: Callable[..., Any], it: Iterator[Any], workers: int) -> Iterator[Any]:
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[Future[Any]] = deque()
        for element in it:
            pending.append(pool.submit(_apply, fn, element))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _interleave(it: Iterator[Any], fn: Callable[..., Any], cycle: int, block: int) -> Iterator[Any]:
    active: list[Iterator[Any]] = []
    exhausted_source = False
    while active or not exhausted_source:
        while len(active) < cycle and not exhausted_source:
            try:
                active.append(iter(_apply(fn, next(it))))
            except StopIteration:
                exhausted_source = True
        for inner in list(active):
            taken = list(itertools.islice(inner, block))
            yield from taken
            if len(taken) < block:
                active.remove(inner)


_DONE = object()


class _Prefetcher:
    """Iterator filled by a daemon thread through a bounded queue; errors re-raise here.

    The thread stops when the consumer is garbage-collected or exhausted.
    """

    def __init__(self, source: Iterator[Any], size: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(size)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_produce, args=(source, self._queue, self._stop), name="phalanx-prefetch", daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._stop.set)

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> Any:
        item = self._queue.get()
        if item is _DONE:
            self._stop.set()
            raise StopIteration
        if isinstance(item, _Failure):
            self._stop.set()
            raise item.error
        return item

    def close(self) -> None:
        """Stops the producer thread."""
        self._stop.set()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def _produce(source: Iterator[Any], q: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        for item in source:
            while not stop.is_set():
                try:
                    q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if stop.is_set():
                return
        q.put(_DONE)
    except BaseException as exc:  # handed to the consumer
        q.put(_Failure(exc))
