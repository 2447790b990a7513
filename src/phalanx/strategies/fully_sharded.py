"""FullyShardedStrategy: MultiWorkerMirrored's program with parameters, gradients and optimizer
state sharded across workers by torch's FSDP2 (``fully_shard``) over a device mesh."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import weakref
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from phalanx import _hooks
from phalanx.cluster.resolvers import ClusterResolver, resolve_cluster
from phalanx.communication.compression import HALF_PRECISION
from phalanx.communication.local.options import CommunicationOptions
from phalanx.distribution import loads as meta_loads
from phalanx.distribution.slices import local_part
from phalanx.memory.measure import map_large_allocations, release_free_memory
from phalanx.state_views import sharded_state_dicts, sharded_views_open
from phalanx.strategies.multi_worker_mirrored import MultiWorkerMirroredStrategy
from phalanx.strategies.sharding.all_gather import FreeingAllGather
from phalanx.strategies.sharding.meta_init import MetaInit, post_order
from phalanx.strategies.sharding.plan import ShardingPlan
from phalanx.strategies.sharding.reduce_scatter import FreeingReduceScatter
from phalanx.strategies.step_sync import StepSync
from phalanx.variables import AGGREGATION_MARK, DistributedVariable

__all__ = ["SHARD_MODES", "FullyShardedStrategy", "sharded_state_dicts"]

# "full": ZeRO-3, parameters gathered per layer for forward and again for backward;
# "optimizer_and_gradients": parameters gathered once per step and kept from forward to the
# end of backward (ZeRO-2's traffic; FSDP2's reshard_after_forward=False)
SHARD_MODES = ("full", "optimizer_and_gradients")


def _one_device(resolver: ClusterResolver) -> str:
    """This worker's one device: its LOCAL_RANK GPU (else its rank's), else the CPU."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return "cpu:0"
    local_rank = getattr(resolver, "local_rank", None)
    if local_rank is None and os.environ.get("LOCAL_RANK", "").strip().isdigit():
        local_rank = int(os.environ["LOCAL_RANK"])
    return f"cuda:{int(local_rank if local_rank is not None else resolver.worker_index) % count}"


class _StateDictHooks:
    """A module's state-dict hooks, installed when it registers a parameter in the scope:
    ``state_dict()`` gathers sharded parameters into full tensors (unless `sharded_state_dicts`
    is open) and ``load_state_dict`` cuts full tensors into this worker's shards, reading only
    its rows (of a ``torch.load(..., mmap=True)`` state dict, only those rows of the file). Both
    first give a model built on the meta device its memory and values (a collective, as the rest
    of them), so a state saved or restored before the first step is the model's, not meta's;
    the layers a load fills whole get memory only (`phalanx.distribution.loads`)."""

    def __init__(self, owner: FullyShardedStrategy) -> None:
        self._owner = weakref.ref(owner)

    def install(self, module: nn.Module) -> None:
        """Registers the three hooks on ``module`` (torch marks each hook: partials, not methods)."""
        module.register_state_dict_pre_hook(functools.partial(self.before_save))
        module.register_state_dict_post_hook(functools.partial(self.on_save))
        module.register_load_state_dict_pre_hook(functools.partial(self.on_load))
        owner = self._owner()
        if owner is not None:
            meta_loads.register(module, owner)

    def _materialize(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner.materialize_meta()

    def before_save(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self._materialize()

    def on_save(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, metadata: Any) -> None:
        if sharded_views_open():
            return
        for name, _ in module.named_parameters(recurse=False, remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if isinstance(value, DTensor):
                state_dict[prefix + name] = value.full_tensor()  # a collective: every worker saves

    def on_load(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        owner = self._owner()
        if owner is not None and owner.meta_pending:  # the first hook of a load: the top module's
            owner.materialize_meta(meta_loads.supplied(module, prefix, state_dict))
        for name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            value = state_dict.get(prefix + name)
            if not isinstance(param, DTensor) or not isinstance(value, torch.Tensor):
                continue
            if isinstance(value, DTensor):
                continue
            if value.shape == param.shape:  # else load_state_dict's own shape error names it
                # every worker has the full value: each cuts its rows out, no communication
                state_dict[prefix + name] = local_part(value, param)


def _check_shardable(root: nn.Module) -> None:
    """Raises what FSDP2 cannot shard, with what to do instead."""
    for name, module in root.named_modules():
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.sparse:
            raise ValueError(
                f"FullyShardedStrategy cannot shard {type(root).__name__}.{name}: it makes sparse "
                "gradients (sparse=True), which FSDP2 does not reduce-scatter. HINT: use sparse=False, "
                "or MultiWorkerMirroredStrategy, which sums sparse gradients."
            )


def _shard_like(value: Any, param: DTensor) -> Any:
    """``value`` (optimizer state of the full parameter) as this worker's shard of it, when it
    has the parameter's shape (moments); anything else (a step count) as it is."""
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
        full = value.detach().to(param.device)
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    return value


class _ShardedStep:
    """The optimizer-step hook: hands the optimizer the sharded parameters (see `adopt`)."""

    def __init__(self, owner: FullyShardedStrategy) -> None:
        self._owner = weakref.ref(owner)

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """FSDP2 reduce-scattered the gradients in backward: only the parameters to check."""
        owner = self._owner()
        if owner is not None:
            owner.adopt(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Each worker updated its own shard; the layers FSDP2 gathered for the step are free
        now: with ``release_memory``, the C heap's free memory goes back to the system."""
        owner = self._owner()
        if owner is not None and owner.release_memory:
            release_free_memory()

    def reset_thread(self) -> None:
        """Nothing is kept per thread."""

    def before_unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """A ``torch.amp.GradScaler`` unscales the sharded gradients: the parameters first (the
        scaler finds them in the optimizer). Its overflow check is every worker's: DTensor's
        dispatch all-reduces the found-inf flag of sharded gradients."""
        self.before_step(optimizer, 0)


class FullyShardedStrategy(MultiWorkerMirroredStrategy):
    """MultiWorkerMirrored's synchronous training with the model sharded across workers (FSDP2).

    The program is MultiWorkerMirroredStrategy's, with only the strategy line changed: the same
    cluster resolution (``TF_CONFIG``, torchrun, SLURM, ``phalanx launch``), ``scope``,
    ``run``, ``reduce``, distributed datasets, ``Model.fit`` and callbacks, and TF's loss
    convention (gradients are **summed** over the workers; divide the loss by the global
    batch size). One replica per worker.

    Modules made in ``scope()`` are sharded with torch's ``fully_shard`` over a one-dimensional
    device mesh of the workers, before the first ``run`` that follows: every module that
    registers parameters of its own becomes an FSDP2 unit (one layer's parameters are gathered
    at a time), the top module the root. Initial values come from the chief, as under
    MultiWorkerMirrored. An optimizer made in the scope (before or after that) is handed the
    sharded parameters at its first step; each worker keeps the optimizer state of its shard.
    Outside ``run``, ``model.state_dict()`` gives full tensors and ``load_state_dict`` takes
    them (both are collectives: every worker calls them, as every worker runs the save code
    under MultiWorkerMirrored); `sharded_state_dicts` gives the shards (DTensors) instead.

    Args:
        cluster_resolver: Where the workers are; default ``phalanx.cluster.resolve_cluster()``.
        communication_options: As for `MultiWorkerMirroredStrategy`; its ``compression`` may be
            ``"fp16"`` or ``"bf16"``: FSDP2's ``reduce_dtype`` (gradients are reduce-scattered
            in that dtype, summed in it on the wire, and the shard is cast back to the
            parameter's dtype). `phalanx.experimental.PowerSGD` needs each worker's whole
            gradient matrix, which a reduce-scatter of shards never has: it is refused.
        shard: ``"full"`` (ZeRO-3: parameters gathered per layer for forward, freed, gathered
            again for backward) or ``"optimizer_and_gradients"`` (parameters gathered once per
            step and kept until the end of backward: less traffic, more memory; ZeRO-2's).
        mixed_precision: FSDP2's `torch.distributed.fsdp.MixedPrecisionPolicy` (gather the
            parameters and compute in ``param_dtype``, reduce in ``reduce_dtype``); default
            none. ``torch.autocast`` and phalanx's mixed-precision policies work as under
            MultiWorkerMirrored.
        devices: This worker's one device (default: its LOCAL_RANK GPU, else the CPU).
        join_timeout: As for `MultiWorkerMirroredStrategy`.
        heartbeat_timeout: As for `MultiWorkerMirroredStrategy`.
        sync_batch_norm: As for `MultiWorkerMirroredStrategy`.
        release_memory: Keep the process's resident memory near what it holds (default):
            glibc maps every allocation of 1 MiB or more on its own and returns it when freed
            (`phalanx.memory.map_large_allocations`, set for the whole process at the
            strategy's creation), the heap's free memory is returned after each optimizer
            step, and on the CPU each unit's reduce-scatter input is freed as soon as its
            collective returns (FSDP2 would keep it through the next unit's backward), each
            unit's all-gather buffer as soon as its parameters are copied out of it (FSDP2
            would keep it through the next unit's forward), and no unit is gathered ahead in
            backward (on the CPU FSDP2's all-gathers wait where they are called: gathering
            ahead overlaps nothing and holds one more unit). Without
            it glibc keeps the layers FSDP2 gathers each step in its heap, and a worker's peak
            resident memory counts them (docs/big_models.md, Memory per worker). False, and
            one worker (nothing is gathered), leave the C allocator and FSDP2 as they are.

    Raises:
        ValueError: ``shard`` is not one of `SHARD_MODES`, more than one device is given,
            PowerSGD compression, a compression that contradicts ``mixed_precision``'s
            ``reduce_dtype``, or any reason `MultiWorkerMirroredStrategy` gives.
    """

    materializes_meta_tensors = True  # a layer at a time on the chief (_meta_init)

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        shard: str = "full",
        mixed_precision: MixedPrecisionPolicy | None = None,
        devices: Sequence[str | torch.device] | None = None,
        join_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        sync_batch_norm: bool = False,
        release_memory: bool = True,
    ) -> None:
        if shard not in SHARD_MODES:
            raise ValueError(f"shard must be one of {SHARD_MODES}. Received: {shard!r}.")
        if devices is not None and len(devices) != 1:
            raise ValueError(
                "FullyShardedStrategy runs one replica per worker (the model is sharded across "
                f"workers). Received: devices={list(devices)}. HINT: start one worker per device "
                "(torchrun --nproc-per-node, phalanx launch)."
            )
        mixed_precision = _reduce_in(communication_options, mixed_precision)
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        super().__init__(
            resolver,
            communication_options,
            devices if devices is not None else [_one_device(resolver)],
            join_timeout,
            heartbeat_timeout,
            sync_batch_norm=sync_batch_norm,
        )
        if self._buckets is not None:  # FSDP2 reduces the gradients, not DDP-style buckets
            self._buckets.close()
            self._buckets = None
        self._sharded_step = _ShardedStep(self)
        self._release_memory = release_memory and self._num_workers > 1  # one worker gathers nothing
        if self._release_memory:  # before the model: its tensors are the first to be mapped
            map_large_allocations()
        self._shard = shard
        self._mp_policy = mixed_precision if mixed_precision is not None else MixedPrecisionPolicy()
        self._plan = ShardingPlan()
        self._meta = MetaInit(self._devices[0])  # what the scope made on the meta device
        self._hooked: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules with state-dict hooks
        self._state_dict_hooks = _StateDictHooks(self)
        self._mesh: DeviceMesh | None = None
        self._own_group = False  # this strategy initialised torch.distributed (one worker)
        self._sharded: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[torch.Tensor]]] = {}
        self._adopted: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        # FSDP2's units and whether they reduce-scatter in backward now (`no_sync()` turns it off)
        self._units: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._units_sync = True

    def _check_compression(self, options: CommunicationOptions) -> None:
        """Checked by `_reduce_in` before joining (FSDP2 does the reducing, not the buckets)."""

    @property
    def step_sync(self) -> StepSync:
        """Hands optimizers the sharded parameters before their step (FSDP2 reduced the
        gradients during backward, so there is nothing to sum here)."""
        return self._sharded_step

    def __repr__(self) -> str:
        return (
            f"FullyShardedStrategy(worker {self._worker_index} of {self._num_workers}, "
            f"devices={list(self._device_names)}, shard={self._shard!r})"
        )

    @property
    def release_memory(self) -> bool:
        """Whether the C heap's free memory goes back to the system after each optimizer step
        (``release_memory=True`` and several workers)."""
        return self._release_memory

    @property
    def meta_pending(self) -> bool:
        """Whether models made on the meta device still wait for memory and values
        (`materialize_meta`, or the next ``run``)."""
        return self._meta.pending

    @property
    def shard(self) -> str:
        """What is sharded: ``"full"`` or ``"optimizer_and_gradients"`` (see the class)."""
        return self._shard

    @property
    def device_mesh(self) -> DeviceMesh:
        """The workers' one-dimensional device mesh (made at first use, on every worker)."""
        if self._mesh is None:
            device_type = self._devices[0].type
            if not dist.is_initialized():  # one worker: a group of one, for FSDP2 and DCP
                dist.init_process_group(
                    "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
                )
                self._own_group = True
            self._mesh = init_device_mesh(device_type, (self._num_workers,))
        return self._mesh

    # ---------------------------------------------------------------- variables
    def _create_parameter(self, module: nn.Module, name: str, param: Any) -> Any:
        """A plain parameter on the device (broadcast from the chief before the first run),
        recorded for sharding with the module that registered it."""
        if isinstance(param, DistributedVariable) or hasattr(param, AGGREGATION_MARK):
            raise ValueError(
                f"FullyShardedStrategy shards plain parameters; {type(module).__name__}.{name} is "
                "a distributed variable or has an aggregation set (phalanx.Variable's "
                "synchronization/aggregation). HINT: use MultiWorkerMirroredStrategy for such "
                "variables, or register a plain nn.Parameter."
            )
        if module not in self._hooked:  # before any load or save can run on it
            self._hooked.add(module)
            self._state_dict_hooks.install(module)
        if param.is_meta:  # materialised a unit at a time before the first run (_meta_init)
            self._meta.note_parameter()
            self._plan.note_parameter(module, param)
            return None
        made = super()._create_parameter(module, name, param)
        self._plan.note_parameter(module, param if made is None else made)
        return made

    def materialize_meta(self, loaded: Collection[int] = ()) -> None:
        """Shards the models made on the meta device now rather than at the next run (their
        state dicts do it: a state saved or loaded before the first step). A collective.

        Args:
            loaded: ``id``s of the meta tensors that a load is about to write (the same on
                every worker). A layer whose every meta tensor is among them gets memory for
                this worker's shards only: no reset on the chief, no scatter.
        """
        if self._meta.pending:
            super()._before_run()
            if self._plan.pending:
                self._shard_pending(loaded)

    def _create_buffer(self, module: nn.Module, name: str, buffer: Any) -> Any:
        """As MultiWorkerMirrored; a buffer made on the meta device gets zeros on the device,
        and its value from its module's ``reset_parameters()`` on the chief at the first run."""
        if not buffer.is_meta or isinstance(buffer, DistributedVariable):
            return super()._create_buffer(module, name, buffer)
        real = torch.zeros_like(buffer, device=self._devices[0])
        made = super()._create_buffer(module, name, real)
        self._meta.note_buffer(module, name, real if made is None else made)
        return real if made is None else made

    def _note_submodule(self, parent: nn.Module, child: nn.Module) -> None:
        self._plan.note_submodule(parent, child)
        if parent not in self._hooked:  # a load of the whole model reaches its top module first
            self._hooked.add(parent)
            self._state_dict_hooks.install(parent)

    def _before_run(self) -> None:
        super()._before_run()  # the chief's initial values first: shards are cut from them
        if self._plan.pending:
            self._shard_pending()
        syncing = self._sync_switch.syncing()
        if syncing != self._units_sync:  # FSDP2's own switch: accumulate unsharded, no reduce-scatter
            for unit in self._units:
                unit.set_requires_gradient_sync(syncing, recurse=False)  # type: ignore[operator]
            self._units_sync = syncing

    def _broadcast_from_chief(self) -> None:
        """The chief's initial values of buffers; parameters about to be sharded get theirs
        in `_shard_pending`, each worker receiving its shard only (a scatter). A broadcast of
        whole parameters would send every worker the whole model, and the broadcast's work
        handle, which phalanx keeps for the stall inspector, would keep it alive."""
        if self._group is None:
            return
        fresh = [t for t in (ref() for ref in self._unbroadcast) if t is not None]
        self._unbroadcast = [  # parameters about to be sharded: see _scatter_from_chief
            weakref.ref(t) for t in fresh if not isinstance(t, DistributedVariable) and self._plan.knows(t)
        ]
        with torch.no_grad():
            for var in fresh:
                if isinstance(var, DistributedVariable):
                    staged = self._stage(var.primary)
                    self._group.broadcast(staged, 0, what="the broadcast of initial values from the chief")
                    var.primary.copy_(staged)
                    var.mark_dirty()

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        self.adopt(optimizer)

    # ---------------------------------------------------------------- sharding
    def _shard_pending(self, loaded: Collection[int] = ()) -> None:
        """``fully_shard``s the modules made since the last run (all workers, same order); a
        unit whose meta tensors are all in ``loaded`` on every worker gets memory, not values."""
        mesh = self.device_mesh
        plan = self._plan.take()
        filled_by_load = [self._meta.loaded_whole(unit, loaded) for units in plan.values() for unit in units]
        from_load = iter(self._agreed(filled_by_load))
        for root, units in plan.items():
            if isinstance(root, FSDPModule):
                raise RuntimeError(
                    f"Parameters were added to {type(root).__name__} after FullyShardedStrategy "
                    "sharded it (at the first run after it was made). HINT: build the whole model "
                    "in the scope before the first step."
                )
            _check_shardable(root)
            before = dict(root.named_parameters(remove_duplicate=False))
            for unit in units:
                filled = next(from_load)  # by the load that asked: memory only
                made = {} if filled else self._meta.materialize(unit, on_chief=self.worker_rank == 0)
                full = {id(p) for p in made.values()}
                slots = [
                    (module, name, p)
                    for module in post_order(unit)
                    for name, p in module.named_parameters(recurse=False, remove_duplicate=False)
                    if id(p) in full
                ]
                fully_shard(
                    unit, mesh=mesh, reshard_after_forward=self._shard == "full", mp_policy=self._mp_policy
                )
                self._configure_unit(unit)
                if filled:
                    self._meta.allocate(unit)
                unit.set_requires_gradient_sync(self._units_sync, recurse=False)  # type: ignore[operator]
                self._units.add(unit)
                self._scatter_materialized(slots)
                del made, slots  # the unit's full parameters: one unit's at a time
            after = dict(root.named_parameters(remove_duplicate=False))
            self._scatter_from_chief(before, after)
            self._remember_sharded(before, after)
            for module in root.modules():  # modules no registration hook saw (deep copies)
                sharded = any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
                if sharded and module not in self._hooked:
                    self._hooked.add(module)
                    self._state_dict_hooks.install(module)
        meta_buffers = self._meta.take_buffers()
        if meta_buffers and self._group is not None:  # their values: the chief's resets
            self._unbroadcast.extend(meta_buffers)
            self._broadcast_from_chief()
        self._meta.pending = False

    def _configure_unit(self, unit: nn.Module) -> None:
        """FSDP2's settings of a unit just sharded (here and in ModelParallelStrategy): TF's
        convention (gradients summed, SUM on the wire), and with ``release_memory`` on the CPU
        a reduce-scatter that frees its input when it returns (`FreeingReduceScatter`), an
        all-gather whose buffer is freed once the unit's forward starts (`FreeingAllGather`)
        and no backward prefetch."""
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # SUM on gloo too
        if self._release_memory and self._devices[0].type == "cpu":
            unit.set_custom_reduce_scatter(FreeingReduceScatter())  # type: ignore[operator]
            gather = FreeingAllGather()  # its buffer freed once the unit's forward starts
            unit.set_custom_all_gather(gather)  # type: ignore[operator]
            unit.register_forward_pre_hook(gather.release)
            # no backward prefetch: on the CPU FSDP2's all-gathers wait where they are called
            # (it calls them without async_op), so gathering the next unit as this one's
            # backward starts overlaps nothing; it only holds one more gathered unit at the
            # backward's peak. A unit prefetching itself, gathered already by then, is
            # FSDP2's public way to prefetch nothing (an empty list means its default).
            unit.set_modules_to_backward_prefetch([unit])  # type: ignore[operator]

    def _agreed(self, flags: list[bool]) -> list[bool]:
        """Each flag, true only where it is true on every worker (one all-reduce; every worker
        has the same number of flags, one per unit): a unit filled by a load on some workers
        only (a state dict given to the chief alone) gets its values as at a run everywhere."""
        if not flags or self._num_workers == 1:
            return flags
        votes = torch.tensor(flags, dtype=torch.int32, device=self._devices[0])
        dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=self.device_mesh.get_group())
        return [bool(v) for v in votes.tolist()]

    def _scatter_materialized(self, slots: Sequence[tuple[nn.Module, str, torch.Tensor]]) -> None:
        """Gives every worker its shard of the values the chief's ``reset_parameters()`` gave
        the unit just sharded (each ``(module, name, full parameter)`` now holds a DTensor)."""
        done: set[int] = set()
        with torch.no_grad():
            for module, name, full in slots:
                new = _hooks.own_parameters(module)[name]
                if id(full) in done or not isinstance(new, DTensor):
                    continue
                done.add(id(full))
                new.copy_(distribute_tensor(full.detach(), new.device_mesh, new.placements, src_data_rank=0))

    def _scatter_from_chief(
        self, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
    ) -> None:
        """Gives every worker its shard of the chief's initial value of each new parameter."""
        if self._group is None:
            return
        waiting = {id(t) for t in (ref() for ref in self._unbroadcast) if t is not None}
        self._unbroadcast = []
        done: set[int] = set()
        with torch.no_grad():
            for name, old in before.items():
                new = after[name]
                if id(old) in waiting and id(old) not in done and isinstance(new, DTensor):
                    done.add(id(old))
                    new.copy_(
                        distribute_tensor(old.detach(), new.device_mesh, new.placements, src_data_rank=0)
                    )

    def _remember_sharded(
        self, before: Mapping[str, torch.Tensor], after: Mapping[str, torch.Tensor]
    ) -> None:
        """Maps each old parameter to its sharded one and frees the old one's memory (an
        optimizer made before holds it until its first step, see `adopt`)."""
        for name, old in before.items():
            new = after[name]
            if new is old:
                continue
            self._sharded[id(old)] = (weakref.ref(old), weakref.ref(new))
            if not old.is_meta:
                with torch.no_grad():
                    old.data = torch.empty(0, dtype=old.dtype, device=old.device)

    def adopt(self, optimizer: torch.optim.Optimizer) -> None:
        """Hands ``optimizer`` the sharded parameters in place of the ones it was made with.

        Called before each step (cheap once done). Every worker's optimizer then updates its
        own shard, and keeps the optimizer state of that shard only: state loaded before the
        model was sharded (a restore before the first step) is cut into this worker's shards.

        Raises:
            RuntimeError: The optimizer holds a parameter that this strategy did not make
                (it names it).
        """
        groups = optimizer.param_groups
        count = sum(len(g["params"]) for g in groups)
        if self._adopted.get(optimizer) == count:
            return
        for group in groups:
            group["params"] = [self._sharded_version(optimizer, p) for p in group["params"]]
        if all(isinstance(p, DTensor) for g in groups for p in g["params"]):
            self._adopted[optimizer] = count

    def _sharded_version(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
        entry = self._sharded.get(id(param))
        new = entry[1]() if entry is not None and entry[0]() is param else None
        if isinstance(new, DTensor):
            if param in optimizer.state:
                state = optimizer.state.pop(param)
                optimizer.state[new] = {key: _shard_like(value, new) for key, value in state.items()}
            return new
        if isinstance(param, DTensor) or self._plan.knows(param):  # sharded, or at the next run
            return param
        from phalanx.nn._scope_copies import describe_foreign  # error path only

        raise RuntimeError(
            f"optimizer.step() under {self!r} got a parameter that FullyShardedStrategy did not "
            "shard, so its gradient is not summed across workers and the workers would drift "
            f"apart. Received: {describe_foreign(param, self)}. HINT: create the model and the "
            "optimizer inside `with strategy.scope():`."
        )

    # ---------------------------------------------------------------- state dicts
    def sharded_state_dicts(self) -> contextlib.AbstractContextManager[None]:
        """`phalanx.strategies.fully_sharded.sharded_state_dicts` (one switch for every strategy)."""
        return sharded_state_dicts()

    def close(self) -> None:
        """As `MultiWorkerMirroredStrategy.close`; also ends a one-worker process group."""
        try:
            super().close()
        finally:
            if self._own_group and dist.is_initialized():
                dist.destroy_process_group()
            self._own_group = False


def _reduce_in(
    options: CommunicationOptions | None, policy: MixedPrecisionPolicy | None
) -> MixedPrecisionPolicy | None:
    """``policy`` with the compression's ``reduce_dtype`` (``"fp16"``/``"bf16"``); FSDP2 has no
    hook for a low-rank compression of its reduce-scatter.

    Raises:
        ValueError: PowerSGD, or a ``reduce_dtype`` in ``policy`` that differs.
    """
    compression = options.compression if options is not None else None
    if compression is None:
        return policy
    if not isinstance(compression, str):
        raise ValueError(
            "FullyShardedStrategy reduce-scatters gradient shards; PowerSGD needs every worker's "
            f"whole gradient matrix. Received: compression={compression!r}. HINT: use "
            "compression='bf16' or 'fp16' (FSDP2's reduce_dtype), or MultiWorkerMirroredStrategy "
            "for PowerSGD."
        )
    wire = HALF_PRECISION[compression]
    policy = policy if policy is not None else MixedPrecisionPolicy()
    if policy.reduce_dtype is not None and policy.reduce_dtype != wire:
        raise ValueError(
            "compression and mixed_precision both say how FSDP2 reduces gradients and disagree. "
            f"Received: compression={compression!r}, mixed_precision.reduce_dtype={policy.reduce_dtype}. "
            "HINT: give one of them."
        )
    return dataclasses.replace(policy, reduce_dtype=wire)
