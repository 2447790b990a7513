"""The Strategy base: scope, run, reduce and the machinery every strategy shares.

Strategies differ by overriding a few documented hooks (how variables are made, how values
cross workers, where input goes) and by the objects they compose: a `VariablePolicy`
(``_make_variable_policy``), a `StepSync` (the ``step_sync`` property) and the cross-device
ops; never through checks of the strategy's type. The hooks and the internal API that phalanx's own
modules use are listed in docs/architecture.md, "Extension points".
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx import _hooks, context, settings
from phalanx.communication.local.cross_device_ops import (
    CrossDeviceOps,
    destination_devices,
    select_cross_device_ops,
)
from phalanx.devices import canonical_name, torch_device
from phalanx.mixed_precision.loss_scale import adopt_torch_grad_scalers
from phalanx.nn import _registration
from phalanx.nn._module_tensors import ReplicaWriteGuard
from phalanx.strategies._batches import BatchLedger
from phalanx.strategies._input_members import StrategyInput, ValueContext
from phalanx.strategies._run_checks import check_gpus_exist, check_run_call, device_scope
from phalanx.strategies._tf_members import TFStrategyMembers
from phalanx.strategies.accumulation import SyncSwitch
from phalanx.strategies.replica_context import ReplicaContext
from phalanx.strategies.replicas.gradients import GradientSync
from phalanx.strategies.replicas.reduction import CrossReplicaReduction
from phalanx.strategies.replicas.rendezvous import ReplicaRendezvous
from phalanx.strategies.replicas.threads import ReplicaThreads, thread_modes
from phalanx.strategies.replicas.variable_policy import VariablePolicy
from phalanx.strategies.run_options import RunOptions, check_run_options
from phalanx.strategies.step_sync import StepSync
from phalanx.values import ReduceOp, local_results, regroup, select_replica
from phalanx.variables import DistributedVariable, set_in_optimizer_step

if TYPE_CHECKING:
    from phalanx.cluster import ClusterResolver
    from phalanx.communication.local.options import CommunicationOptions

__all__ = ["Strategy", "ValueContext"]

DEFAULT_TIMEOUT_SECONDS = 600.0
_OP_NAMES = frozenset(("sum", "SUM", "mean", "MEAN"))  # `reduce`'s usual spellings (its lean path)


class Strategy(StrategyInput, TFStrategyMembers):
    """Distributes one training program over replicas (tf.distribute.Strategy).

    Args:
        devices: The local devices, one replica each.
        cross_device_ops: How local replicas' values are reduced; default chosen from the
            devices as TF does.
        timeout_seconds: How long a replica waits at a meeting point (merge_call, all_reduce,
            optimizer.step()) before failing with an error that names the missing replicas.
        num_workers: Workers that step together (MultiWorkerMirrored: the cluster's workers).
        worker_index: This worker's rank among them.
    """

    is_default = False
    # parameters made on the meta device in the scope: refused (FullyShardedStrategy materialises them)
    materializes_meta_tensors = False
    schedules_steps = False  # Model.fit schedules each step on a remote worker (ParameterServerStrategy)
    # BatchNorm layers registered in the scope become phalanx.nn.SyncBatchNorm (`sync_batch_norm=True`)
    _sync_batch_norm = False

    def __init__(
        self,
        devices: Sequence[str | torch.device],
        cross_device_ops: CrossDeviceOps | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        *,
        num_workers: int = 1,
        worker_index: int = 0,
    ) -> None:
        if not devices:
            raise ValueError("A strategy needs at least one device. Received: [].")
        names = [canonical_name(d) for d in devices]
        if len(set(names)) != len(names):
            raise ValueError(f"Devices must be distinct. Received: {list(devices)}.")
        check_gpus_exist(names)
        self._device_names = tuple(names)
        self._devices = tuple(torch_device(n) for n in names)
        self._num_local_replicas = len(names)
        self._num_workers = num_workers
        self._worker_index = worker_index
        self._cross_device_ops = cross_device_ops or select_cross_device_ops(self._devices)
        self._timeout = timeout_seconds
        self._rendezvous = ReplicaRendezvous(self._num_local_replicas, timeout_seconds)
        self._threads = ReplicaThreads(self._num_local_replicas, type(self).__name__)
        if not self.is_default:
            _hooks.track(self)  # torch's global hooks come off once no strategy is alive
        self._replica_contexts = [ReplicaContext(self, i) for i in range(self._num_local_replicas)]
        self._replica_frame = context.Frame(self, self._replica_contexts[0])
        self._batches = BatchLedger()
        # The lean `run`: one replica in the job, this class's run machinery as Strategy has
        # it. Decided once, by the first `run` to get past its checks (the job's layout and the
        # timeline are fixed by then, `_lean_run_applies`); what may change later (variables
        # made, a remembered batch, the context, torch's hooks) is checked at each run, and
        # any doubt takes the full path, which raises every error.
        self._lean_run = False
        self._lean_run_decided = False
        self._run_count = 0
        self._timeline_asked = False  # `_start_timeline_if_asked` ran (at a scope or run)
        self._variable_policy = self._make_variable_policy()
        self._sync_switch = SyncSwitch(type(self).__name__)
        self._reduction = CrossReplicaReduction(self, self._cross_device_ops)
        # The in-process gradient path: sums at the end of backward passes inside `run`
        # (prepared before each run); also the default `step_sync`.
        self._gradient_sync = self._in_process_gradient_sync()

    # ------------------------------------------------------------------ composition (overridable)
    def _make_variable_policy(self) -> VariablePolicy:
        """The policy that makes and mirrors this strategy's variables (called once, by
        ``Strategy.__init__``: set what it needs before calling ``super().__init__``)."""
        return VariablePolicy(self, self._rendezvous, self._cross_device_ops)

    def _in_process_gradient_sync(self) -> GradientSync:
        """The gradient path of this worker's replicas, built from this strategy's parts."""
        return GradientSync(
            devices=self._devices,
            rendezvous=self._rendezvous,
            cross_device_ops=self._cross_device_ops,
            cross_worker_all_reduce=self.cross_worker_all_reduce,
            policy=self._variable_policy,
            num_workers=lambda: self._num_workers,
            cross_worker_sparse_sum=self.cross_worker_sparse_sum,
            syncing=self._sync_switch.syncing,
        )

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

    # ------------------------------------------------------------------ internal API
    # What phalanx's own modules (input, variables, replica context, hooks, callbacks) read
    # or call; not part of TF's API. See docs/architecture.md, "Extension points".
    @property
    def num_local_replicas(self) -> int:
        """Replicas of this worker (one per local device)."""
        return self._num_local_replicas

    @property
    def num_workers_in_sync(self) -> int:
        """Worker processes whose replicas take part in every step (1 but for multi-worker)."""
        return self._num_workers

    @property
    def worker_rank(self) -> int:
        """This process's rank among the ``num_workers_in_sync`` workers (0 in one process)."""
        return self._worker_index

    @property
    def first_replica_id(self) -> int:
        """The global replica id (``replica_id_in_sync_group``) of this worker's replica 0."""
        return self._worker_index * self._num_local_replicas

    @property
    def local_devices(self) -> tuple[torch.device, ...]:
        """This worker's replica devices, in replica order."""
        return self._devices

    @property
    def rendezvous(self) -> ReplicaRendezvous:
        """Where this worker's replica threads meet (merge_call, collectives, the step)."""
        return self._rendezvous

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """How this worker's replicas' values are summed onto one device."""
        return self._cross_device_ops

    @property
    def step_sync(self) -> StepSync:
        """What ``optimizer.step()`` inside `run` does before and after the update: the
        in-process gradient sync; a strategy whose steps differ overrides this property."""
        return self._gradient_sync

    @property
    def variable_policy(self) -> VariablePolicy:
        """How this strategy makes, mirrors, reads and writes its distributed variables."""
        return self._variable_policy

    @property
    def run_count(self) -> int:
        """Calls of `run` so far: keys replica-invariant dropout masks. BackupAndRestore
        saves it and sets it back, so a resumed job draws the masks it would have drawn."""
        return self._run_count

    @run_count.setter
    def run_count(self, value: int) -> None:
        self._run_count = int(value)

    def replica_context(self, index: int) -> ReplicaContext:
        """The context of local replica ``index`` (the same object at every `run`)."""
        return self._replica_contexts[index]

    @property
    def sync_switch(self) -> SyncSwitch:
        """Whether backward passes sum now (`no_sync`); ``optimizer.step()`` is refused inside
        ``no_sync()`` (`before_optimizer_step`), the gradient paths ask it at every backward."""
        return self._sync_switch

    def remember_batch(self, batch: Any, global_count: int | None, offsets: list[int] | None) -> None:
        """Notes a distributed iterator's batch (its global example count and each replica's
        first example offset) for the `run` it is given to (called by the input pipeline)."""
        self._batches.remember(batch, global_count, offsets)

    # ------------------------------------------------------------------ gradient accumulation
    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Marks the ``run`` calls inside as accumulate-only (all workers, around ``run``).

        Their backward passes add to each replica's local gradients and nothing moves
        between replicas or workers; the next backward pass outside sums everything
        accumulated since the last sum, once (DDP's ``no_sync()``, FSDP2's
        ``set_requires_gradient_sync(False)``). See `phalanx.strategies.accumulation`.

        Raises:
            RuntimeError: Entered inside ``run``; or ``optimizer.step()`` ran inside it.
        """
        return self._sync_switch.no_sync(context.current_replica() is not None)

    # ------------------------------------------------------------------ scope
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """Makes this strategy current: modules and optimizers created inside are distributed.

        Raises:
            RuntimeError: Another strategy's scope is open on this thread.
        """
        top = context.current_frame()
        current = top.strategy if top is not None else self
        if current is not self and not current.is_default:
            raise RuntimeError(
                f"Mixing different strategies is not allowed: {self!r}.scope() was entered "
                f"inside the scope (or run) of {current!r}. HINT: leave the other strategy's "
                "scope first; one program uses one strategy."
            )
        self._use_torch_hooks()
        self._start_timeline_if_asked()
        replica_context = top.replica_context if top is not None and top.strategy is self else None
        with context.push_frame(self, replica_context):
            yield self

    def _use_torch_hooks(self) -> None:
        """Installs phalanx's changes to torch (`phalanx._hooks`) if they are not in place
        (at every scope and `run`: they come off while no strategy is alive)."""
        if self.is_default:
            return
        _hooks.install()
        if self._num_local_replicas > 1 or hasattr(self.step_sync, "before_unscale"):
            adopt_torch_grad_scalers()  # per-replica state; sharded parameters before unscale_

    def _start_timeline_if_asked(self) -> None:
        """Starts the opt-in tracing (``PHALANX_TIMELINE``) at a scope, or at this strategy's
        first `run` (a strategy run without a scope). Not at every `run`: reading the
        environment costs more than the rest of `run`'s bookkeeping."""
        self._timeline_asked = True
        if not self.is_default and settings.current().timeline:
            from phalanx import timeline

            timeline.start()

    # ------------------------------------------------------------------ run
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
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
            TypeError: ``options`` is not a `RunOptions` (TPU-only in TF: accepted, no effect).
        """
        if (
            self._lean_run
            and kwargs is None
            and options is None
            and type(args) is tuple
            and not self._variable_policy.has_variables
            and not self._batches.entries
            and (self.is_default or _hooks.step_hooks_in_place)
            and callable(fn)
        ):
            for value in args:  # noqa: SIM110 - a loop: no generator made at every step
                if type(value) is not torch.Tensor:
                    break
            else:  # what the full path does then (`_lean_run_applies`), if the stack allows
                previous = context.push_replica_frame_at_top(self._replica_frame, 0)
                if previous is not context.NOT_PUSHED:
                    try:
                        self._run_count += 1
                        only = self._replica_contexts[0]
                        if not only.at_rest:
                            only.begin_step(None, 0)
                        return fn(*args)
                    finally:
                        context.pop_replica_frame(previous)
                        if self._variable_policy.has_variables:  # made during the step
                            set_in_optimizer_step(False)  # `GradientSync.reset_thread`
        check_run_call(self, fn, args, kwargs)
        if options is not None:
            check_run_options(options)  # TF's options steer TPU compilation only: nothing to apply
        self._use_torch_hooks()
        if not self._timeline_asked:
            self._start_timeline_if_asked()
        self._before_run()
        self._gradient_sync.prepare_run()
        try:
            return self._run_replicas(fn, args, kwargs)
        finally:
            self._gradient_sync.end_run()
            if not self._lean_run_decided:  # once: the first full run fixed what it depends on
                self._lean_run_decided = True
                self._lean_run = self._lean_run_applies()

    # Strategy's own run machinery: a strategy overriding any of these takes the full path.
    _LEAN_RUN_MEMBERS = (
        "_use_torch_hooks",
        "_before_run",
        "_run_replicas",
        "step_sync",
        "before_optimizer_step",
    )

    def _lean_run_applies(self) -> bool:
        """Whether `run` may take its lean path from now on: one replica in the job (its
        layout is decided at the first run and fixed), the timeline asked for, and the run
        machinery Strategy's own. What the lean path skips then does nothing: no variables
        to ready (checked at each run), no backward rounds to open, no batch facts to take
        (checked at each run), nothing for ``step_sync`` to sum."""
        cls = type(self)
        return (
            all(getattr(cls, name) is getattr(Strategy, name) for name in self._LEAN_RUN_MEMBERS)
            and self._num_local_replicas == 1
            and self._timeline_asked
            and self._gradient_sync.replicas_in_sync() == 1
        )

    def _run_replicas(
        self, fn: Callable[..., Any], args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any] | None
    ) -> Any:
        gbs, offsets = self._batches.take(args, kwargs)
        self._run_count += 1
        if self._num_local_replicas == 1:  # on the calling thread: no threads, no write guard
            only = self._replica_contexts[0]
            only.begin_step(gbs, offsets[0] if offsets else 0)
            previous = context.push_replica_frame(self._replica_frame, 0)
            try:
                return fn(*args, **kwargs) if kwargs else fn(*args)
            finally:
                context.pop_replica_frame(previous)
                self.step_sync.reset_thread()
                only.end_step()
        kwargs = kwargs or {}
        for i, replica_ctx in enumerate(self._replica_contexts):
            replica_ctx.begin_step(gbs, offsets[i] if offsets else 0)
        grad_mode = torch.is_grad_enabled()
        modes = thread_modes()
        # modules hand replicas plain components: their in-place writes outside a step are checked
        guarded = self._variable_policy.has_variables

        def call(i: int) -> Any:
            guard = functools.partial(ReplicaWriteGuard, self, i) if guarded else None
            with (
                context.push_frame(self, self._replica_contexts[i], guard),
                torch.set_grad_enabled(grad_mode),
                modes(),
                device_scope(self._devices[i]),
            ):
                try:
                    return fn(*select_replica(i, args), **select_replica(i, kwargs))
                finally:
                    self.step_sync.reset_thread()

        self._rendezvous.reset()
        return regroup(self._threads.run(call, self._rendezvous.abort, self._rendezvous))

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        """Called (by `before_optimizer_step`) when ``optimizer.step()`` runs in this strategy's
        scope outside ``run``."""
        return

    def _before_run(self) -> None:
        """Readies distributed variables (components made or re-mirrored) before a step."""
        if self._variable_policy.has_variables:
            self._variable_policy.materialize_all()

    # ------------------------------------------------------------------ torch's hooks
    # What `phalanx._hooks` hands the current strategy (each calls the overridable hooks below).
    def parameter_registered(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        """What replaces ``param``, registered by ``module`` in this strategy's scope outside
        ``run`` (None: keep it): `_create_parameter`'s answer, with the module marked
        (`_made_in_scope`). Called by `phalanx._hooks` at every such registration."""
        made = self._create_parameter(module, name, param)
        self._made_in_scope(module, "_parameters", param if made is None else made)
        return made

    def buffer_registered(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        """What replaces ``buffer``, registered by ``module`` in this strategy's scope outside
        ``run`` (None: keep it); as `parameter_registered`, with `_create_buffer`."""
        made = self._create_buffer(module, name, buffer)
        self._made_in_scope(module, "_buffers", buffer if made is None else made)
        return made

    def submodule_registered(
        self, parent: torch.nn.Module, submodule: torch.nn.Module, in_replica: bool
    ) -> Any:
        """What replaces ``submodule``, registered by ``parent`` in this strategy's scope or
        inside its ``run`` (``in_replica``) (None: keep it): `_registered_submodule`'s answer;
        outside ``run`` the strategy then learns the tree (`_note_submodule`). Called by
        `phalanx._hooks`."""
        replacement = self._registered_submodule(submodule, in_replica=in_replica)
        if not in_replica:
            self._note_submodule(parent, submodule if replacement is None else replacement)
        return replacement

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, replica_index: int | None) -> None:
        """Runs before ``optimizer.step()`` in this strategy's scope: inside ``run`` (every
        replica, ``replica_index`` its local index) the step sync's ``before_step``, outside
        it (``replica_index`` None) `_step_outside_run`. Called by `phalanx._hooks`.

        Raises:
            RuntimeError: The step runs inside ``no_sync()``, or as the strategy refuses it.
        """
        if not self._sync_switch.syncing():
            self._sync_switch.check_step()  # raises
        if replica_index is None:
            self._step_outside_run(optimizer)
        elif self._lean_run and not self._variable_policy.has_variables:
            return  # one replica in the job, no variables: `before_step` would do nothing
        else:
            self.step_sync.before_step(optimizer, replica_index)

    def create_variable(self, tensor: torch.Tensor, *, is_parameter: bool) -> Any:
        """What this strategy makes of ``tensor`` as a parameter (or buffer) that no module
        registers (None: keep it as it is): a copy of a variable made in the scope
        (`DistributedVariable.__deepcopy__`). The annotations on ``tensor`` (`set_aggregation`)
        say the kind, as at a registration."""
        module: Any = None  # the policies do not read the module of a parameter or buffer
        if is_parameter:
            return self._create_parameter(module, "", tensor)
        return self._create_buffer(module, "", tensor)

    # ------------------------------------------------------------------ variables (hooks)
    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        """What replaces a parameter registered in this strategy's scope (None: keep it).

        Called by `parameter_registered` when a module registers a parameter inside ``scope()``
        (not inside ``run``), and by `create_variable`. The base asks the variable policy (a
        `MirroredVariable`).
        """
        return self._variable_policy.create_parameter(module, name, param)

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        """What replaces a buffer registered in this strategy's scope (None: keep it).

        Called by `buffer_registered` like `_create_parameter`. The base asks the variable
        policy (a `SyncOnReadVariable`).
        """
        return self._variable_policy.create_buffer(module, name, buffer)

    def _note_submodule(self, parent: torch.nn.Module, child: torch.nn.Module) -> None:
        """Called when ``parent`` registers ``child`` in this strategy's scope (cross-replica
        context); the base ignores it (FullyShardedStrategy learns the model's tree from it)."""
        return

    def _made_in_scope(self, module: torch.nn.Module, attribute: str, tensor: Any) -> None:
        """Called by `parameter_registered` and `buffer_registered` after a module registered
        ``tensor`` (the replacement, if any) in this strategy's scope outside ``run``;
        ``attribute`` is ``"_parameters"`` or ``"_buffers"``."""
        _registration.made_in_scope(module, attribute, self, tensor)

    def _registered_submodule(self, submodule: torch.nn.Module, in_replica: bool) -> Any:
        """What replaces a submodule registered in this strategy's scope or inside its `run`
        (``in_replica``) (None: keep it). Called by `submodule_registered`."""
        return _registration.registered_submodule(submodule, self, in_replica, self._sync_batch_norm)

    @property
    def input_devices(self) -> tuple[torch.device, ...] | None:
        """Where distributed input is placed, per local replica (None: leave it where it is).
        Read by the distributed iterator, with ``experimental_fetch_to_device``."""
        return self._devices

    def any_worker_has_data(self, has_data: bool) -> bool:
        """Whether any worker still has input this step (a collective across workers: every
        worker calls it at the same step). Called by the distributed iterator."""
        return has_data

    # ------------------------------------------------------------------ cross-worker (overridden)
    # Called by the strategy's composed parts (reductions, replica collectives, the variable
    # policy, the gradient paths) once per process, on behalf of its local replicas; a
    # cross-process strategy overrides them. Not TF API: user code reduces with `reduce` or
    # ``get_replica_context().all_reduce``.
    def cross_worker_all_reduce(
        self, tensor: torch.Tensor, op: Any, options: CommunicationOptions | None = None
    ) -> torch.Tensor:
        """Reduces a tensor across workers (identity in one process)."""
        return tensor

    def cross_worker_sparse_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums a sparse COO tensor across workers (identity in one process)."""
        return tensor

    def cross_worker_all_gather(
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
    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The components of ``value`` on this worker's replicas, in replica order.

        A distributed variable gives its per-replica tensors (one for a CentralStorage
        variable, which is stored once); a plain value gives ``(value,)``.
        """
        if isinstance(value, DistributedVariable):
            return value.components
        return local_results(value)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduces a per-replica value across all replicas and workers (cross-replica context).

        Args:
            reduce_op: SUM or MEAN.
            value: A per-replica value (or nest of them), as returned by `run`; a plain value
                counts as identical on every local replica (MEAN gives it back; SUM gives it
                times the local replicas, summed over workers).
            axis: None reduces across replicas only. An axis also reduces along it; MEAN
                then divides by the true number of elements across replicas, so partial
                batches give the right mean.

        Raises:
            RuntimeError: Called inside `run` (use ``get_replica_context().all_reduce``).
        """
        if (
            self._lean_run  # one replica in the job: a tensor is its own SUM and MEAN
            and axis is None
            and type(value) is torch.Tensor
            and (type(reduce_op) is ReduceOp or (type(reduce_op) is str and reduce_op in _OP_NAMES))
            and context.current_replica() is None
        ):
            return value
        op = reduce_op if type(reduce_op) is ReduceOp else ReduceOp.coerce(reduce_op)
        return self._reduction.reduce(op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates every replica's value along ``axis``, in global replica order (cross-replica).

        Shapes may differ along ``axis`` (partial batches). Raises RuntimeError inside `run`.
        """
        return self._reduction.gather(value, axis)

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
        kwargs = kwargs or {}
        if not isinstance(var, DistributedVariable):
            with torch.no_grad():
                return fn(var, *args, **kwargs)
        results = []
        with torch.no_grad(), context.push_frame(self, None):
            for i, component in enumerate(var.components):
                results.append(fn(component, *select_replica(i, args), **select_replica(i, kwargs)))
        if isinstance(var, DistributedVariable):
            var.mark_clean()
        return regroup(results) if group else tuple(results)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any) -> Any:
        """Reduces a per-replica value across all replicas onto ``destinations`` (cross-replica).

        Returns:
            A tensor for one destination device, else a `Mirrored` value.
        """
        from phalanx.values import Mirrored

        op = ReduceOp.coerce(reduce_op)
        total = self._reduction.reduce_one(op, value, None)
        copies = self._cross_device_ops.broadcast(total, destination_devices(destinations))
        return copies[0] if len(copies) == 1 else Mirrored(copies)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Any) -> list[Any]:
        """`reduce_to` for many values (cross-replica context)."""
        return [self.reduce_to(reduce_op, v, d) for v, d in value_destination_pairs]
