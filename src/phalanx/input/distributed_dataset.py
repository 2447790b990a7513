"""Distributed datasets: global batches in, one slice per replica out (docs/architecture.md, "Input")."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx.input._dataset_members import DistributedDatasetMembers, DistributedIteratorMembers
from phalanx.input.input_options import AutoShardPolicy, InputContext, InputOptions, InputReplicationMode
from phalanx.input.per_replica_input import PerReplicaInput
from phalanx.input.splitting import as_tensors, batch_size_of, slice_batch, split_sizes, usual_batch_size
from phalanx.values import iter_leaves, map_structure, regroup

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator", "Optional"]

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, UserWarning, stacklevel=3)


class Optional:
    """A value that may be absent (tf.experimental.Optional), from `get_next_as_optional`."""

    def __init__(self, value: Any = None, has_value: bool = False) -> None:
        self._value = value
        self._has_value = has_value

    def has_value(self) -> bool:
        """Whether a value is present."""
        return self._has_value

    def get_value(self) -> Any:
        """The value.

        Raises:
            ValueError: There is none (the iterator was exhausted).
        """
        if not self._has_value:
            raise ValueError("This Optional has no value: the iterator is exhausted.")
        return self._value


def _shard_policy(dataset: Any) -> AutoShardPolicy:
    options = getattr(dataset, "options", None)
    if callable(options):
        distribute = getattr(options(), "experimental_distribute", None)
        if distribute is not None:
            return AutoShardPolicy.coerce(distribute.auto_shard_policy)
    return AutoShardPolicy.AUTO


def _source_files(dataset: Any) -> list[str] | None:
    files = getattr(dataset, "source_files", None)
    return files() if callable(files) else None


class DistributedIterator(DistributedIteratorMembers):
    """Yields one value per step: the batch for one local replica, or a `PerReplica` of them.

    Built by iterating a distributed dataset; every worker's iterator stops on the same step.
    Where the strategy can carry it (MultiWorkerMirrored over gloo), the iterator takes the
    next step's input one step early and sends whether it has any with this step's gradients
    (`_carry_data_flag`), so the next step needs no end-of-data all-reduce of its own; DATA
    sharding (every worker has every batch: no agreement) reads the next global batch early
    and sends the same flag, so the transport does not announce a pass after the last step.

    Args:
        strategy: The strategy whose replicas the batches are for.
        next_pieces: Gives the next step's per-replica pieces (with the global count and the
            replicas' offsets), or None at the end of this worker's input.
        options: The `InputOptions` of the distributed dataset.
        agree: Whether the workers agree on the last step (they read different input).
        spec_source: Gives the distributed dataset's ``element_spec`` (None: unknown).
    """

    def __init__(
        self,
        strategy: DistributionStrategy,
        next_pieces: Callable[[], tuple[list[Any], int | None, list[int] | None] | None],
        options: InputOptions,
        agree: bool,
        spec_source: Callable[[], Any] | None = None,
    ) -> None:
        self._strategy = strategy
        self._spec_source = spec_source  # the dataset's element_spec, read on demand
        self._next_pieces = next_pieces
        self._options = options
        self._agree = agree
        # DATA sharding (no agreement): the flag only tells the transport whether a step follows
        self._peek: Callable[[], bool] | None = None if agree else getattr(next_pieces, "has_next", None)
        carries = agree or self._peek is not None
        self._carry = getattr(strategy, "_carry_data_flag", None) if carries else None
        self._ahead: list[Any] = []  # the next step's pieces, taken early to carry its flag
        self._flag: Any = None  # that flag (`DataFlag`): ``agreed`` once the step's gradients ran
        self._template: list[Any] | None = None
        self._steps = 0
        self._devices = strategy.input_devices if options.experimental_fetch_to_device else None
        # every piece goes to the CPU: a tensor is there when `is_cpu` (no device object to make)
        self._to_cpu = self._devices is not None and all(d.type == "cpu" for d in self._devices)
        # With one replica in the job its batch is the global batch: `run` needs no ledger entry
        # to know the global count or the replica's offset (0), and the step saves its cost.
        self._remember = strategy.num_replicas_in_sync > 1
        # The lean path: a DATA split with nothing to agree on or carry hands one replica in
        # the job its global batch as it is, when it is the usual one (on the CPU where the
        # input goes there). Decided here: a strategy whose replica count may change (elastic
        # MultiWorkerMirrored) carries the data flag, so never takes it.
        self._whole: _Splitter | None = None
        anywhere = self._devices is None
        if (
            isinstance(next_pieces, _Splitter)
            and not agree
            and self._carry is None
            and strategy.num_replicas_in_sync == 1
            and (anywhere or self._to_cpu)
        ):
            self._whole = next_pieces

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        whole = self._whole
        if whole is not None and not whole.peeked:
            batch = next(whole.batches)  # StopIteration at the end: this iterator's end too
            if usual_batch_size(batch, self._to_cpu) >= 0:  # nothing to convert, slice or move
                self._steps += 1
                return batch
            whole.peeked.append(batch)  # converted and checked by the full path
        return self._next_step()

    def _next_step(self) -> Any:
        """`__next__`'s full path: the step's pieces, agreed on, carried, moved and noted."""
        step = self._ahead.pop() if self._ahead else self._next_pieces()
        if self._agree and not self._any_worker_has_data(step is not None):
            raise StopIteration
        if self._carry is not None and (step is not None or self._agree):  # not at a DATA iterator's end
            if self._peek is not None:
                flag = self._carry(self._peek())
            else:
                self._ahead.append(self._next_pieces())
                flag = self._flag = self._carry(self._ahead[0] is not None)
            if flag is None:  # nothing carries it (shared memory, the TLS ring): ask each step
                self._carry = None
        if step is None:
            if not self._agree or self._template is None:
                raise StopIteration
            step = ([slice_batch(p, 0, 0) for p in self._template], None, None)
        pieces, global_count, offsets = step
        self._steps += 1
        self._template = pieces
        if self._to_cpu:
            pieces = [p if _all_on_cpu(p) else _to_device(p, torch.device("cpu")) for p in pieces]
        elif self._devices is not None:
            pieces = [_to_device(p, d) for p, d in zip(pieces, self._devices, strict=True)]
        batch = pieces[0] if len(pieces) == 1 else regroup(pieces)
        if self._remember:
            self._strategy.remember_batch(batch, global_count, offsets)
        return batch

    def _any_worker_has_data(self, has_data: bool) -> bool:
        """What the last step's gradients carried, else an all-reduce (all workers)."""
        flag, self._flag = self._flag, None
        agreed = None if flag is None else flag.agreed
        return self._strategy.any_worker_has_data(has_data) if agreed is None else agreed

    def state_dict(self) -> dict[str, int]:
        """The position (steps taken), so a `Checkpoint` can save where the input was."""
        return {"steps": self._steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Moves a fresh iterator to a saved position by skipping that many steps (all workers).

        Raises:
            ValueError: This iterator has already moved past the saved position.
        """
        target = int(state["steps"])
        if target < self._steps:
            raise ValueError(
                f"Cannot rewind a data iterator from step {self._steps} to step {target}. "
                "HINT: restore into a fresh iterator, before taking any batch."
            )
        while self._steps < target:
            next(self)

    def get_next(self) -> Any:
        """The next step's value (raises StopIteration at the end)."""
        return next(self)

    def get_next_as_optional(self) -> Optional:
        """The next step's value as an `Optional`, without raising at the end."""
        try:
            return Optional(next(self), True)
        except StopIteration:
            return Optional()


def _all_on_cpu(structure: Any) -> bool:
    """Whether every tensor of a usual ``(x, y[, None])`` batch is on the CPU (False: look closer)."""
    if type(structure) is not tuple:
        return False
    for t in structure:  # noqa: SIM110 - a loop: no generator made at every step
        if t is not None and (type(t) is not torch.Tensor or not t.is_cpu):
            return False
    return True


def _to_device(structure: Any, device: torch.device) -> Any:
    if all(not isinstance(t, torch.Tensor) or t.device == device for t in iter_leaves(structure)):
        return structure  # nothing to rebuild
    non_blocking = device.type == "cuda"
    return map_structure(
        lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking), structure
    )


class _Splitter:
    """DATA sharding: each worker keeps its replicas' slices of every global batch."""

    def __init__(self, strategy: DistributionStrategy, batches: Iterator[Any]) -> None:
        # the global batches (the iterator's lean path reads them here too)
        self.batches = batches
        self._strategy = strategy  # read at each batch: an elastic job re-splits after a membership change
        # the next global batch, read by `has_next` or left by the iterator's lean path (not split yet)
        self.peeked: list[Any] = []

    def has_next(self) -> bool:
        """Whether another global batch follows (reads it; it is split when its step comes)."""
        if not self.peeked:
            try:
                self.peeked.append(next(self.batches))
            except StopIteration:
                return False
        return True

    def __call__(self) -> tuple[list[Any], int | None, list[int] | None] | None:
        try:
            batch = self.peeked.pop() if self.peeked else next(self.batches)
        except StopIteration:
            return None
        size = usual_batch_size(batch)  # (x, y) of tensors: nothing to convert, one look
        if size < 0:
            batch = as_tensors(batch)
            size = batch_size_of(batch)
        replicas = self._strategy.num_replicas_in_sync
        if replicas == 1:  # one replica in the job takes the whole batch, unsliced
            return [batch], size, [0]
        first = self._strategy.first_replica_id
        sizes = split_sizes(size, replicas)
        starts = [sum(sizes[:g]) for g in range(replicas)]
        mine = range(first, first + self._strategy.num_local_replicas)
        pieces = [slice_batch(batch, starts[g], sizes[g]) for g in mine]
        return pieces, size, [starts[g] for g in mine]


class _Sequencer:
    """FILE/OFF sharding: the worker's batches are cut into per-replica pieces consumed in order."""

    def __init__(self, strategy: DistributionStrategy, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._num_replicas = strategy.num_replicas_in_sync
        self._local = strategy.num_local_replicas
        self._queue: deque[Any] = deque()

    def __call__(self) -> tuple[list[Any], int | None, list[int] | None] | None:
        while len(self._queue) < self._local:
            try:
                batch = as_tensors(next(self._batches))
            except StopIteration:
                break
            sizes = split_sizes(batch_size_of(batch), self._num_replicas)
            start = 0
            for size in sizes:
                self._queue.append(slice_batch(batch, start, size))
                start += size
        if not self._queue:
            return None
        pieces = [self._queue.popleft() for _ in range(min(self._local, len(self._queue)))]
        while len(pieces) < self._local:
            pieces.append(slice_batch(pieces[0], 0, 0))
        return pieces, None, None


class DistributedDataset(DistributedDatasetMembers):
    """A dataset of global batches, distributed over a strategy's replicas and workers.

    Iterating it gives a `DistributedIterator`; each iteration restarts the source.
    Across workers the source is sharded by its `AutoShardPolicy` (AUTO: FILE when it is
    read from files, else DATA).

    Raises:
        ValueError: FILE sharding of a source without files, or with fewer files than workers.
    """

    def __init__(
        self, strategy: DistributionStrategy, dataset: Any, options: InputOptions | None = None
    ) -> None:
        if isinstance(dataset, (str, bytes)) or not hasattr(dataset, "__iter__"):
            raise TypeError(
                "experimental_distribute_dataset needs an iterable of batches (a DataLoader, a "
                f"phalanx.data.Dataset, a list of batches). Received: {type(dataset).__name__}."
            )
        self._strategy = strategy
        self._options = options or InputOptions()
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "InputReplicationMode.PER_REPLICA works with distribute_datasets_from_function "
                "only (as in TensorFlow). HINT: use distribute_datasets_from_function, or PER_WORKER."
            )
        self._source, self._sequential = self._shard(dataset)

    def _shard(self, dataset: Any) -> tuple[Any, bool]:
        s = self._strategy
        if s.num_workers_in_sync == 1:
            return dataset, False
        policy = _shard_policy(dataset)
        if policy in (AutoShardPolicy.OFF, AutoShardPolicy.HINT):  # HINT: no placeholder to shard at
            return dataset, True
        files = _source_files(dataset)
        if policy is AutoShardPolicy.FILE or (policy is AutoShardPolicy.AUTO and files):
            return self._shard_files(dataset, files), True
        if policy is AutoShardPolicy.AUTO:
            _warn_once(
                "Auto-sharding found no files in the dataset, so it shards by DATA: every "
                "worker reads the whole dataset and keeps its replicas' slice of each global "
                "batch. HINT: read from files (phalanx.data.Dataset.list_files) to shard by "
                "FILE, or set AutoShardPolicy.DATA to silence this."
            )
        return dataset, False

    def _shard_files(self, dataset: Any, files: list[str] | None) -> Any:
        s = self._strategy
        if not files:
            raise ValueError(
                "AutoShardPolicy.FILE needs a dataset read from files, and this one has none. "
                "HINT: use AutoShardPolicy.DATA, or build it with phalanx.data.Dataset.list_files."
            )
        if len(files) < s.num_workers_in_sync:
            raise ValueError(
                f"FILE sharding needs at least one file per worker: {len(files)} files for "
                f"{s.num_workers_in_sync} workers. HINT: use AutoShardPolicy.DATA or split the data "
                "into more files."
            )
        return dataset.with_source_files(files[s.worker_rank :: s.num_workers_in_sync])

    def __iter__(self) -> DistributedIterator:
        batches = iter(self._source)
        s = self._strategy
        pieces = _Sequencer(s, batches) if self._sequential else _Splitter(s, batches)
        return DistributedIterator(s, pieces, self._options, self._sequential, self._spec)

    def _first_replica_batch(self) -> Any:
        pieces = (_Sequencer if self._sequential else _Splitter)(self._strategy, iter(self._source))()
        return None if pieces is None else pieces[0][0]

    def __len__(self) -> int:
        if self._sequential:
            raise TypeError("The length of a FILE/OFF-sharded distributed dataset is not known.")
        return len(self._source)


class DistributedDatasetsFromFunction(DistributedDatasetMembers):
    """Datasets made per input pipeline by a user function; each yields per-replica batches."""

    def __init__(
        self,
        strategy: DistributionStrategy,
        dataset_fn: Callable[[InputContext], Any],
        options: InputOptions | None = None,
    ) -> None:
        if not callable(dataset_fn):
            raise TypeError(
                f"distribute_datasets_from_function needs a callable. Received: {type(dataset_fn).__name__}."
            )
        self._strategy = strategy
        self._options = options or InputOptions()
        self._per_replica: PerReplicaInput | None = None
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self._per_replica = PerReplicaInput(strategy, dataset_fn, self._options)
            return
        context = InputContext(
            num_input_pipelines=strategy.num_workers_in_sync,
            input_pipeline_id=strategy.worker_rank,
            num_replicas_in_sync=strategy.num_replicas_in_sync,
        )
        self._dataset = dataset_fn(context)

    def _first_replica_batch(self) -> Any:
        if self._per_replica is not None:
            return self._per_replica.first_batch()
        return next(iter(self._dataset), None)

    def __iter__(self) -> DistributedIterator:
        s = self._strategy
        agree = s.num_workers_in_sync > 1
        if self._per_replica is not None:
            return DistributedIterator(s, self._per_replica.step_function(), self._options, agree, self._spec)
        batches = iter(self._dataset)
        local = s.num_local_replicas

        def next_pieces() -> tuple[list[Any], int | None, list[int] | None] | None:
            pieces = []
            for _ in range(local):
                try:
                    pieces.append(as_tensors(next(batches)))
                except StopIteration:
                    break
            if not pieces:
                return None
            while len(pieces) < local:
                pieces.append(slice_batch(pieces[0], 0, 0))
            sizes = [batch_size_of(p) for p in pieces]
            if s.num_workers_in_sync > 1:
                return pieces, None, None
            return pieces, sum(sizes), [sum(sizes[:i]) for i in range(local)]

        return DistributedIterator(s, next_pieces, self._options, agree, self._spec)
