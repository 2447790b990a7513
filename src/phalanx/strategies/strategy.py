"""The Strategy base: scope, run, reduce and the machinery every strategy shares.

Strategies differ by overriding a few methods (how variables are made, how gradients
meet, how values cross workers), never through checks of the strategy's type.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx import context
from phalanx.communication.cross_device_ops import (
    CrossDeviceOps,
    destination_devices,
    select_cross_device_ops,
)
from phalanx.devices import canonical_name, torch_device
from phalanx.strategies._gradients import GradientSync
from phalanx.strategies._reduction import ReductionMixin
from phalanx.strategies._rendezvous import Rendezvous
from phalanx.strategies._replica_threads import ReplicaThreads
from phalanx.strategies._variable_policy import VariablePolicyMixin
from phalanx.strategies.replica_context import ReplicaContext
from phalanx.strategies.step_sync import StepSync
from phalanx.values import DistributedValues, PerReplica, flatten, regroup, select_replica

if TYPE_CHECKING:
    from phalanx.cluster import ClusterResolver
    from phalanx.communication.communication_options import CommunicationOptions
    from phalanx.input.input_options import InputContext, InputOptions

__all__ = ["Strategy", "ValueContext"]

DEFAULT_TIMEOUT_SECONDS = 600.0


class ValueContext:
    """What `experimental_distribute_values_from_function` passes to the value function."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1) -> None:
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (
            f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )


def _thread_modes() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The caller's thread-local modes (inference mode, autocast), to enter on replica threads."""
    inference = torch.is_inference_mode_enabled()
    autocast = [
        (kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)
    ]
    if not inference and not autocast:
        return contextlib.nullcontext

    def enter() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        if inference:
            stack.enter_context(torch.inference_mode())
        for kind, dtype in autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        return stack

    return enter


def _check_gpus_exist(names: Sequence[str]) -> None:
    """Raises ValueError naming the CUDA devices this machine does not have."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = [n for n in names if n.startswith("cuda:") and int(n.split(":")[1]) >= available]
    if missing:
        raise ValueError(
            f"This machine has no {missing[0]}: it has {available} CUDA device(s). Received: "
            f"devices {list(names)}. HINT: use cuda:0..cuda:{available - 1}, or logical CPU replicas "
            "such as ['cpu:0', 'cpu:1']."
            if available
            else f"This machine has no {missing[0]}: it has no CUDA device. Received: devices "
            f"{list(names)}. HINT: use logical CPU replicas such as ['cpu:0', 'cpu:1']."
        )


class Strategy(VariablePolicyMixin, ReductionMixin):
    """Distributes one training program over replicas (tf.distribute.Strategy).

    Args:
        devices: The local devices, one replica each.
        cross_device_ops: How local replicas' values are reduced; default chosen from the
            devices as TF does.
        timeout_seconds: How long a replica waits at a meeting point (merge_call, all_reduce,
            optimizer.step()) before failing with an error that names the missing replicas.
    """

    _is_default = False
    _schedules_steps = False  # Model.fit schedules each step on a remote worker (ParameterServerStrategy)

    def __init__(
        self,
        devices: Sequence[str | torch.device],
        cross_device_ops: CrossDeviceOps | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    ) -> None:
        if not devices:
            raise ValueError("A strategy needs at least one device. Received: [].")
        names = [canonical_name(d) for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"Devices must be distinct. Received: {list(devices)}.")
        _check_gpus_exist(names)
        self._device_names = tuple(names)
        self._devices = tuple(torch_device(n) for n in names)
        self._num_local_replicas = len(names)
        self._num_workers = 1
        self._worker_index = 0
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(self._devices)
        self._timeout = timeout_seconds
        self._rendezvous = Rendezvous(self._num_local_replicas, timeout_seconds)
        self._threads = ReplicaThreads(self._num_local_replicas, type(self).__name__)
        self._replica_contexts = [ReplicaContext(self, i) for i in range(self._num_local_replicas)]
        self._replica_frame = context._Frame(self, self._replica_contexts[0])
        self._variables: list[weakref.ref[Any]] = []
        # Per batch handed out by a distributed iterator (keyed by its first leaf): the global
        # batch size and the replicas' example offsets, for the `run` that receives it.
        self._batches: dict[int, tuple[Any, int | None, list[int] | None]] = {}
        self._run_count = 0
        self._step_sync: StepSync = GradientSync(self)

    # ------------------------------------------------------------------ identity
    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas across all workers that take part in each step."""
        return self._num_local_replicas * self._num_workers

    @property
    def extended(self) -> Strategy:
        """The strategy itself: TF's ``strategy.extended`` methods live on this class."""
        return self

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """This worker's replica devices, by name."""
        return self._device_names

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        """The cluster this strategy runs in, or None for single-process strategies."""
        return None

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints, summaries and logs."""
        return True

    @property
    def should_checkpoint(self) -> bool:
        """Whether checkpoints written by this process are kept."""
        return self.is_chief

    @property
    def should_save_summary(self) -> bool:
        """Whether summaries written by this process are kept."""
        return self.is_chief

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={list(self._device_names)})"

    # ------------------------------------------------------------------ scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this strategy current: modules and optimizers created inside are distributed.

        Raises:
            RuntimeError: Another strategy's scope is open on this thread.
        """
        from phalanx import _hooks

        current = context.get_strategy()
        if current is not self and not current._is_default:
            raise RuntimeError(
                f"Mixing different strategies is not allowed: {self!r}.scope() was entered "
                f"inside the scope (or run) of {current!r}. HINT: leave the other strategy's "
                "scope first; one program uses one strategy."
            )
        _hooks.install()
        top = context._top()
        replica_context = top.replica_context if top is not None and top.strategy is self else None
        with context.push_frame(self, replica_context):
            yield self

    # ------------------------------------------------------------------ run
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Runs ``fn`` once per local replica, each with its slice of distributed arguments.

        Distributed values in ``args``/``kwargs`` (as produced by a distributed dataset) are
        replaced by each replica's component. With several local replicas, replicas run
        concurrently on persistent threads (replica 0 on the calling thread).

        Returns:
            The replicas' results: plain values for one local replica, else `PerReplica`
            values (leaves identical on every replica stay plain).

        Raises:
            TypeError: ``args`` is not a tuple/list or ``kwargs`` not a dict.
            ValueError: A distributed argument does not have one component per local replica.
            RuntimeError: Called inside another ``run`` or inside another strategy's scope.
        """
        self._check_run_call(fn, args, kwargs)
        self._before_run()
        kwargs = kwargs or {}
        gbs, offsets = self._batch_info(args, kwargs)
        self._run_count += 1
        for i, replica_ctx in enumerate(self._replica_contexts):
            replica_ctx._global_batch_size = gbs
            replica_ctx._example_offset = offsets[i] if offsets else 0
            replica_ctx._dropout_calls = 0
        if self._num_local_replicas == 1:
            state = context._state
            previous = state.replica
            state.stack.append(self._replica_frame)
            state.replica = (self, 0)
            try:
                return fn(*args, **kwargs)
            finally:
                state.stack.pop()
                state.replica = previous
                self._step_sync.reset_thread()
        grad_mode = torch.is_grad_enabled()
        modes = _thread_modes()

        def call(i: int) -> Any:
            with (
                context.push_frame(self, self._replica_contexts[i]),
                torch.set_grad_enabled(grad_mode),
                modes(),
                self._device_scope(i),
            ):
                try:
                    return fn(*select_replica(i, args), **select_replica(i, kwargs))
                finally:
                    self._step_sync.reset_thread()

        self._rendezvous.reset()
        # Replicas share the cores: each replica thread gets its share of the intra-op threads
        # (torch's setting is per OS thread), so 2 replicas x 2 threads do not fight over 2 cores.
        caller_threads = torch.get_num_threads()
        share = max(1, caller_threads // self._num_local_replicas)

        def call_with_share(i: int) -> Any:
            if torch.get_num_threads() != share:
                torch.set_num_threads(share)
            return call(i)

        try:
            results = self._threads.run(call_with_share, self._rendezvous.abort)
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)
        return regroup(results)

    def _check_run_call(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
        if not callable(fn):
            raise TypeError(f"strategy.run needs a callable. Received: {type(fn).__name__}.")
        if not isinstance(args, (tuple, list)):
            raise TypeError(
                "strategy.run(fn, args=...) takes args as a tuple or list. Received: "
                f"{type(args).__name__}. HINT: write args=(x,) for a single argument."
            )
        if kwargs is not None and not isinstance(kwargs, dict):
            raise TypeError(f"strategy.run kwargs must be a dict. Received: {type(kwargs).__name__}.")
        for value in (*args, *(kwargs or {}).values()):
            self._check_components(value)
        replica = context._state.replica
        if replica is not None and not replica[0]._is_default:
            raise RuntimeError(
                "strategy.run was called inside a replica context (inside another run). "
                "HINT: call strategy.run from the training loop, outside strategy.run."
            )
        top = context._top()
        current = top.strategy if top is not None else self
        if current is not self and not current._is_default:
            raise RuntimeError(
                f"{self!r}.run was called inside the scope of {current!r}. HINT: use the "
                "strategy whose scope is open."
            )

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        """Called when ``optimizer.step()`` runs in this strategy's scope outside ``run``."""
        return

    def _remember_batch(self, batch: Any, global_count: int | None, offsets: list[int] | None) -> None:
        """Notes a distributed iterator's batch, for the `run` it is given to."""
        leaves = flatten(batch)
        if leaves:
            self._batches[id(leaves[0])] = (leaves[0], global_count, offsets)
            while len(self._batches) > 16:  # batches never given to run
                del self._batches[next(iter(self._batches))]

    def _batch_info(self, args: Any, kwargs: dict[str, Any]) -> tuple[int | None, list[int] | None]:
        """The global batch size and offsets of the iterator batch among ``args``: found by
        identity (two iterators may alternate), else the latest batch handed out."""
        if not self._batches:
            return None, None
        for leaf in flatten([args, kwargs]):
            entry = self._batches.get(id(leaf))
            if entry is not None and entry[0] is leaf:
                del self._batches[id(leaf)]
                return entry[1], entry[2]
        latest = self._batches.pop(next(reversed(self._batches)))
        return latest[1], latest[2]

    def _check_components(self, value: Any) -> None:
        """Raises ValueError for a distributed value without one component per local replica."""
        if isinstance(value, DistributedValues):
            if len(value.values) != self._num_local_replicas:
                raise ValueError(
                    f"strategy.run got a {type(value).__name__} with {len(value.values)} components, "
                    f"but {self!r} has {self._num_local_replicas} local replica(s). HINT: make it "
                    "with this strategy (experimental_distribute_dataset or "
                    "experimental_distribute_values_from_function)."
                )
        elif isinstance(value, (list, tuple)):
            for v in value:
                self._check_components(v)
        elif isinstance(value, dict):
            for v in value.values():
                self._check_components(v)

    def _device_scope(self, i: int) -> contextlib.AbstractContextManager[Any]:
        device = self._devices[i]
        if device.type == "cuda":
            return torch.cuda.device(device)
        return contextlib.nullcontext()

    def _before_run(self) -> None:
        """Readies distributed variables (components made or re-mirrored) before a step."""
        if not self._variables:
            return
        alive = []
        for ref in self._variables:
            var = ref()
            if var is not None:
                self._materialize(var)
                alive.append(ref)
        self._variables = alive

    # ------------------------------------------------------------------ input
    def experimental_distribute_dataset(self, dataset: Any, options: InputOptions | None = None) -> Any:
        """Splits each *global* batch of ``dataset`` across replicas (and workers).

        ``dataset`` yields global batches: a `DataLoader`, a `phalanx.data.Dataset`, or any
        iterable of batches (tensors, arrays, tuples or dicts of them).
        """
        from phalanx.input.distributed_dataset import DistributedDataset

        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> Any:
        """Calls ``dataset_fn(InputContext)`` once per input pipeline (worker).

        The function's dataset yields *per-replica* batches; each step takes one batch per
        local replica.
        """
        from phalanx.input.distributed_dataset import DistributedDatasetsFromFunction

        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a per-replica value by calling ``value_fn(ValueContext)`` for each local replica."""
        base = self._worker_index * self._num_local_replicas
        values = [
            value_fn(ValueContext(base + i, self.num_replicas_in_sync))
            for i in range(self._num_local_replicas)
        ]
        return values[0] if len(values) == 1 else PerReplica(values)

    def _sums_in_shared_memory(self) -> bool:
        """Whether gradient sums can run in parallel by every replica over shared memory:
        one worker, all replicas on the host CPU, and the default reduction."""
        from phalanx.communication.cross_device_ops import ReductionToOneDevice, _add_n

        ops = self._cross_device_ops
        return (
            self._num_workers == 1
            and all(d.type == "cpu" for d in self._devices)
            and type(ops) is ReductionToOneDevice
            and ops._accumulate is _add_n
            and ops._device in (None, torch.device("cpu"))
        )

    def _fetch_devices(self) -> tuple[torch.device, ...] | None:
        """Where distributed input is placed, per local replica (None: leave it where it is)."""
        return self._devices

    def _any_worker_has_data(self, has_data: bool) -> bool:
        """Whether any worker still has input this step (a collective across workers)."""
        return has_data

    # ------------------------------------------------------------------ cross-worker (overridden)
    def _cross_worker_all_reduce(
        self, tensor: torch.Tensor, op: Any, options: CommunicationOptions | None = None
    ) -> torch.Tensor:
        """Reduces a tensor across workers (identity in one process)."""
        return tensor

    def _cross_worker_all_gather(
        self,
        tensor: torch.Tensor,
        axis: int,
        local_sizes: list[int],
        options: CommunicationOptions | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Concatenates each worker's tensor along ``axis`` (identity in one process).

        Returns:
            The concatenation and the size along ``axis`` of every replica, in global order.
        """
        return tensor, local_sizes

    # ------------------------------------------------------------------ TF extended API
    def update(
        self,
        var: torch.Tensor,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Applies ``fn(component, *args)`` to every component of ``var`` (cross-replica context).

        Args are distributed values (each component gets its own) or plain values.
        """
        from phalanx.variables import DistributedVariable

        kwargs = kwargs or {}
        if not isinstance(var, DistributedVariable):
            with torch.no_grad():
                return fn(var, *args, **kwargs)
        results = []
        with torch.no_grad(), context.push_frame(self, None):
            for i, component in enumerate(var.components):
                results.append(fn(component, *select_replica(i, args), **select_replica(i, kwargs)))
        if isinstance(var, DistributedVariable):
            var._dirty = False
        return regroup(results) if group else tuple(results)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any) -> Any:
        """Reduces a per-replica value across all replicas onto ``destinations`` (cross-replica).

        Returns:
            A tensor for one destination device, else a `Mirrored` value.
        """
        from phalanx.values import Mirrored, ReduceOp

        op = ReduceOp.coerce(reduce_op)
        total = self._reduce_one(op, value, None)
        copies = self._cross_device_ops.broadcast(total, destination_devices(destinations))
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any) -> list[Any]:
        """`reduce_to` for many values (cross-replica context)."""
        return [self.reduce_to(reduce_op, v, d) for v, d in value_destination_pairs]
