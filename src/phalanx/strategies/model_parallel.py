"""ModelParallelStrategy: Keras 3's ``ModelParallel`` on torch's DTensor, tensor parallelism and FSDP2.

The program is MultiWorkerMirroredStrategy's with the strategy line changed (as for
FullyShardedStrategy, whose machinery this strategy reuses: the scope's registration hooks,
meta-device models, state-dict hooks, optimizers handed the new parameters at their first
step). What differs is where each weight lives: a `LayoutMap` over a `DeviceMesh` of the
workers says which weights are split along the model axis; torch's ``parallelize_module``
splits those layers (`phalanx.strategies.sharding.tensor_plan`), and along a batch axis of more than
one worker ``fully_shard`` then shards every layer over the batch axis (torchtitan's 2-D
recipe: tensor parallelism first, FSDP2 on the data mesh).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh as TorchMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from phalanx.cluster.resolvers import ClusterResolver, resolve_cluster
from phalanx.communication.local.options import CommunicationOptions
from phalanx.distribution.layouts import LayoutMap
from phalanx.input.input_options import AutoShardPolicy, InputContext, InputOptions
from phalanx.strategies.fully_sharded import FullyShardedStrategy, _check_shardable
from phalanx.strategies.run_options import RunOptions
from phalanx.strategies.sharding.borders import (
    gather_padded,
    keep_parameters,
    local_outputs,
    replicated_inputs,
    whole,
)
from phalanx.strategies.sharding.meta_init import post_order
from phalanx.strategies.sharding.tensor_plan import (
    check_loss_parallel,
    layouts_of,
    parallel_styles,
    plan_layers,
    replicated_blocks,
)
from phalanx.strategies.strategy import Strategy
from phalanx.values import ReduceOp

__all__ = ["ModelParallelStrategy"]


def _check_mesh(layout_map: Any, batch_dim_name: str, workers: int) -> None:
    """Raises for a layout map that is not one, or a mesh this job cannot hold."""
    if not isinstance(layout_map, LayoutMap):
        raise TypeError(
            "ModelParallelStrategy needs layout_map=phalanx.experimental.LayoutMap(mesh). Received: "
            f"{type(layout_map).__name__}."
        )
    mesh = layout_map.device_mesh
    if mesh.size != workers:
        raise ValueError(
            f"The device mesh has {mesh.size} workers ({mesh!r}); the cluster has {workers}. HINT: "
            f"give the mesh a shape whose product is {workers}, or start {mesh.size} workers."
        )
    others = [a for a in mesh.axis_names if a != batch_dim_name]
    if len(others) > 1:
        raise ValueError(
            "ModelParallelStrategy splits weights along one model axis besides the batch axis "
            f"{batch_dim_name!r}. Received: {mesh!r}. HINT: DeviceMesh((data, model), "
            f"('{batch_dim_name}', 'model')), or set batch_dim_name to one of {list(mesh.axis_names)}."
        )


class ModelParallelStrategy(FullyShardedStrategy):
    """Synchronous training with weights split across workers as a `LayoutMap` says (Keras 3's
    ``keras.distribution.ModelParallel``).

    The workers form ``layout_map.device_mesh``: along ``batch_dim_name`` (if the mesh has
    that axis) each worker group takes its slice of every global batch, as replicas do under
    MultiWorkerMirrored; along the other axis (the model axis) every worker takes the same
    batch and holds its part of each split weight. ``num_replicas_in_sync`` is the size of the
    batch axis (1 without one): TF's loss convention counts replicas along it (divide the
    loss by the global batch size; gradients are summed over the batch axis).

    Modules made in ``scope()`` are laid out before the first ``run`` that follows: each
    ``nn.Linear`` or ``nn.Embedding`` whose weight has a split layout becomes torch's
    ``ColwiseParallel`` or ``RowwiseParallel`` over the model axis
    (`phalanx.strategies.sharding.tensor_plan` says which and how layers pair); with more
    than one worker along the batch axis every layer is then also sharded with ``fully_shard``
    over it (the parameters are DTensors on the 2-D mesh). Initial values come from the
    chief, a unit at a time; a model built on the meta device is materialised a unit at a
    time (as under FullyShardedStrategy).
    Checkpoints, ``state_dict()`` (full tensors outside `sharded_state_dicts`), optimizers,
    ``Model.fit`` and callbacks work as under FullyShardedStrategy.

    Layouts are checked when the scope that made the model closes: an axis the mesh lacks
    (already when the layout is set), a dimension its axis does not divide, a key that matches
    no parameter, a split of anything but a Linear or Embedding weight all raise there.

    Args:
        layout_map: The layouts, on the mesh of the job's workers (its size must be the
            cluster's).
        batch_dim_name: The mesh axis input batches are split along (default ``"batch"``);
            a mesh without it splits no batch (every worker sees the whole batch).
        cluster_resolver: Where the workers are; default ``phalanx.cluster.resolve_cluster()``.
        communication_options: As for `MultiWorkerMirroredStrategy`.
        mixed_precision: FSDP2's `MixedPrecisionPolicy` along the batch axis; default none.
        devices: This worker's one device (default: its LOCAL_RANK GPU, else the CPU).
        join_timeout: As for `MultiWorkerMirroredStrategy`.
        heartbeat_timeout: As for `MultiWorkerMirroredStrategy`.
        loss_parallel: The name (in ``model.named_modules()``) of the output ``nn.Linear``,
            split by columns, whose logits stay split over the classes: ``run`` then runs under
            torch's ``loss_parallel()``, so ``F.cross_entropy`` on them never gathers the whole
            logits (the step computes its loss with ``F.cross_entropy`` / ``nn.CrossEntropyLoss``;
            DTensors it returns come back whole). Default: the logits are gathered.

    Raises:
        TypeError: ``layout_map`` is not a `LayoutMap`.
        ValueError: The mesh's size is not the cluster's, it has more than one axis besides
            the batch axis, or any reason `FullyShardedStrategy` gives.
    """

    def __init__(
        self,
        layout_map: LayoutMap,
        batch_dim_name: str = "batch",
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        devices: Sequence[str | torch.device] | None = None,
        join_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        loss_parallel: str | None = None,
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        _check_mesh(layout_map, batch_dim_name, resolver.num_workers)
        self._layout_map = layout_map
        self._loss_parallel = loss_parallel
        self._batch_axis = batch_dim_name
        others = [a for a in layout_map.device_mesh.axis_names if a != batch_dim_name]
        self._model_axis = others[0] if others else None
        super().__init__(
            resolver,
            communication_options,
            "full",
            mixed_precision,
            devices,
            join_timeout,
            heartbeat_timeout,
        )
        self._kept: dict[int, weakref.ref[torch.Tensor]] = {}  # parameters left whole (not split)
        self._checked: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose layouts passed
        self._done: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules laid out already

    def __repr__(self) -> str:
        mesh = self._layout_map.device_mesh
        return (
            f"ModelParallelStrategy(worker {self._worker_index} of {self._num_workers}, "
            f"mesh={mesh.shape} {mesh.axis_names}, batch_dim_name={self._batch_axis!r})"
        )

    # ---------------------------------------------------------------- identity
    @property
    def layout_map(self) -> LayoutMap:
        """The layouts this strategy applies."""
        return self._layout_map

    @property
    def batch_dim_name(self) -> str:
        """The mesh axis input batches are split along."""
        return self._batch_axis

    @property
    def num_replicas_in_sync(self) -> int:
        """Workers along the batch axis: the data-parallel replicas (1 without a batch axis)."""
        return self._layout_map.device_mesh.axis_size(self._batch_axis)

    @property
    def first_replica_id(self) -> int:
        """This worker's position along the batch axis (its replica's id)."""
        return self._layout_map.device_mesh.coordinate(self._worker_index, self._batch_axis)

    @property
    def device_mesh(self) -> TorchMesh:
        """torch's ``DeviceMesh`` of the layout map's mesh (made at first use, on every worker)."""
        if self._mesh is None:
            device_type = self._devices[0].type
            if not dist.is_initialized():  # one worker: a group of one, for DTensor and DCP
                dist.init_process_group(
                    "nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1
                )
                self._own_group = True
            self._mesh = self._layout_map.device_mesh.to_torch(device_type)
        return self._mesh

    def _axis_mesh(self, axis: str | None) -> TorchMesh | None:
        """The 1-D mesh of ``axis``, or None when the axis splits nothing (absent or of size 1)."""
        if axis is None or self._layout_map.device_mesh.axis_size(axis) == 1:
            return None
        return self.device_mesh[axis]

    # ---------------------------------------------------------------- scope: layouts are checked
    @contextlib.contextmanager
    def scope(self) -> Iterator[Strategy]:
        """`Strategy.scope`; when it closes, the layouts of the models made inside are checked.

        Raises:
            ValueError: A layout does not fit its parameter, or a key matches no parameter.
        """
        with super().scope() as strategy:
            yield strategy
        self.check_layouts()

    def check_layouts(self) -> None:
        """Checks the layout map against every model made in the scope and not laid out yet
        (the scope calls it as it closes; any worker can, no communication).

        Raises:
            ValueError: A layout has the wrong length, names the batch axis, splits a
                dimension its axis does not divide or a parameter that is not a Linear's or
                Embedding's weight; or a key of the map matches no parameter of those models.
        """
        roots = self._plan.roots()
        if not roots:
            return
        names: list[str] = []
        for root in map(_named, roots):
            layers = plan_layers(root, layouts_of(root, self._layout_map, self._batch_axis))
            if self._splits_model:
                replicated_blocks(root, layers)
            if self._loss_parallel is not None:
                check_loss_parallel(root, layers, self._loss_parallel)
            names.extend(n for n, _ in root.named_parameters(remove_duplicate=False))
        unused = set(self._layout_map) - self._layout_map.matching_keys(names)
        if unused:
            raise ValueError(
                f"LayoutMap keys {sorted(unused)} match no parameter of the model. Keys are regular "
                "expressions matched in full against model.named_parameters() names, e.g. "
                f"{names[:3]}. HINT: fix the keys (escape dots: 'mlp\\.0\\.weight'), or delete the "
                "unused ones."
            )
        self._checked.update(roots)

    # ---------------------------------------------------------------- laying the model out
    def _shard_pending(self, loaded: Collection[int] = ()) -> None:
        """Splits and shards the models made since the last run (all workers, same order).
        Every unit gets its values here (``loaded``, FullySharded's list of what a load fills,
        is not used: the load then overwrites them)."""
        for root, units in self._plan.take().items():
            if isinstance(root, FSDPModule) or root in self._done:
                raise RuntimeError(
                    f"Parameters were added to {type(root).__name__} after ModelParallelStrategy laid "
                    "it out (at the first run after it was made). HINT: build the whole model in the "
                    "scope before the first step."
                )
            before = dict(root.named_parameters(remove_duplicate=False))
            self._lay_out_model(root, units)
            after = dict(root.named_parameters(remove_duplicate=False))
            self._remember_sharded(before, after)
            self._kept.update((id(p), weakref.ref(p)) for p in after.values() if not isinstance(p, DTensor))
            for module in root.modules():  # modules no registration hook saw (deep copies)
                split = any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
                if split and module not in self._hooked:
                    self._hooked.add(module)
                    self._state_dict_hooks.install(module)
        self._unbroadcast = []  # the parameters FullySharded left for later: broadcast per unit
        meta_buffers = self._meta.take_buffers()
        if meta_buffers and self._group is not None:  # their values: the chief's resets
            self._unbroadcast.extend(meta_buffers)
            self._broadcast_from_chief()
        self._meta.pending = False

    def _lay_out_model(self, root: nn.Module, units: Sequence[nn.Module]) -> None:
        """Lays ``root`` out unit by unit (children first, `ShardingPlan`), then gives its
        replicated blocks their DTensor borders."""
        data, model = self._axis_mesh(self._batch_axis), self._axis_mesh(self._model_axis)
        if data is not None:
            _check_shardable(root)
        named = _named(root)
        layers = plan_layers(named, layouts_of(named, self._layout_map, self._batch_axis))
        styles = parallel_styles(named, layers, self._loss_parallel if model is not None else None)
        for unit in units:
            self._lay_out(unit, styles, model, data)
        if model is not None:
            for block in replicated_blocks(named, layers):  # plain tensors in and out
                distribute_module(block, model, keep_parameters, replicated_inputs, local_outputs)
        self._done.add(root)

    def _lay_out(
        self,
        unit: nn.Module,
        styles: dict[int, Any],
        model: TorchMesh | None,
        data: TorchMesh | None,
    ) -> None:
        """One unit: its parameters get memory (meta) and the chief's values, its split layers
        are parallelised over the model axis, then it is sharded over the batch axis."""
        self._meta.materialize(unit, on_chief=self.worker_rank == 0)
        own = list(
            dict.fromkeys(
                p
                for m in post_order(unit)
                for _, p in m.named_parameters(recurse=False, remove_duplicate=False)
                if not isinstance(p, DTensor)
            )
        )
        self._broadcast_whole(own)  # every worker takes its part of the chief's values locally
        for module in post_order(unit):
            if model is None or module in self._done:
                continue
            self._done.add(module)
            style = styles.get(id(module))
            if style is not None:
                parallelize_module(module, model, style, src_data_rank=None)
                continue
            # replicated over the model axis
            for name, p in list(module.named_parameters(recurse=False, remove_duplicate=False)):
                if not isinstance(p, DTensor):
                    local = DTensor.from_local(p.detach(), model, [Replicate()], run_check=False)
                    module.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))
        if data is not None:
            fully_shard(unit, mesh=data, reshard_after_forward=True, mp_policy=self._mp_policy)
            self._configure_unit(unit)

    def _broadcast_whole(self, params: Sequence[torch.Tensor]) -> None:
        """The chief's values of ``params`` on every worker (all workers; one broadcast per dtype)."""
        if self._group is None or not params:
            return
        with torch.no_grad():
            for dtype in dict.fromkeys(p.dtype for p in params):
                group = [p for p in params if p.dtype == dtype]
                flat = torch.cat([p.detach().reshape(-1).to(self._comm_device) for p in group])  # (total,)
                self._group.broadcast(flat, 0, what="the broadcast of initial values from the chief")
                start = 0
                for p in group:
                    p.copy_(flat[start : start + p.numel()].view_as(p))
                    start += p.numel()

    def _sharded_version(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> torch.Tensor:
        """As FullyShardedStrategy's; a parameter left whole (no split, no batch axis) is its own."""
        kept = self._kept.get(id(param))
        if kept is not None and kept() is param:
            return param
        return super()._sharded_version(optimizer, param)

    # ---------------------------------------------------------------- run: loss parallel
    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """`FullyShardedStrategy.run`; with ``loss_parallel`` set, under torch's
        ``loss_parallel()`` (forward and backward), and the DTensors ``fn`` returns (its loss)
        come back as whole plain tensors (all workers)."""
        if self._loss_parallel is None or not self._splits_model:
            return super().run(fn, args, kwargs, options)
        with loss_parallel():
            return whole(super().run(fn, args, kwargs, options))

    # ---------------------------------------------------------------- input: split along the batch axis
    @property
    def _splits_model(self) -> bool:
        return self._model_axis is not None and self._layout_map.device_mesh.axis_size(self._model_axis) > 1

    def experimental_distribute_dataset(self, dataset: Any, options: InputOptions | None = None) -> Any:
        """`Strategy.experimental_distribute_dataset`: each global batch is split along the batch
        axis; the workers along the model axis take the same slice (all read every batch).

        Raises:
            ValueError: The dataset is read from files and would be split by file (FILE, or
                AUTO with files): workers along the model axis would read different files.
        """
        from phalanx.input.distributed_dataset import _shard_policy, _source_files

        policy = _shard_policy(dataset)
        if (
            self._splits_model
            and _source_files(dataset)
            and policy in (AutoShardPolicy.AUTO, AutoShardPolicy.FILE)
        ):
            raise ValueError(
                "Under ModelParallelStrategy the workers along the model axis must take the same "
                f"batches, and sharding by FILE gives each worker its own files. Received: {policy} "
                "for a dataset read from files. HINT: set options.experimental_distribute."
                "auto_shard_policy = AutoShardPolicy.DATA on the dataset (every worker reads it and "
                "keeps its replica's slice)."
            )
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> Any:
        """`Strategy.distribute_datasets_from_function` with a batch axis only.

        Raises:
            ValueError: The mesh has a model axis (the function's pipelines are per worker,
                and the workers along that axis must take the same batches).
        """
        if self._splits_model:
            size = self._layout_map.device_mesh.axis_size(self._model_axis or "")
            raise ValueError(
                "distribute_datasets_from_function makes one input pipeline per worker; under a "
                f"model axis ({self._model_axis!r}: {size} workers) the workers along it must take "
                "the same batches. HINT: use experimental_distribute_dataset with global batches: "
                "they are split along the batch axis."
            )
        return super().distribute_datasets_from_function(dataset_fn, options)

    # ---------------------------------------------------------------- replicas: the batch axis
    def _batch_group(self) -> Any:
        """The process group of this worker's batch axis, or None when that is every worker."""
        mesh = self._layout_map.device_mesh
        if mesh.axis_size(self._batch_axis) in (1, mesh.size):
            return None
        return self.device_mesh.get_group(self._batch_axis)

    def cross_worker_all_reduce(
        self, tensor: torch.Tensor, op: Any, options: CommunicationOptions | None = None
    ) -> torch.Tensor:
        """Sums (or averages) ``tensor`` over the replicas, the workers along the batch axis
        (all workers call it; along the model axis the values are the same)."""
        if self.num_replicas_in_sync == 1:
            return tensor
        group = self._batch_group()
        if group is None:
            return super().cross_worker_all_reduce(tensor, op, options)
        staged = self._stage(tensor).clone()
        dist.all_reduce(staged, group=group)
        result = staged.to(tensor.device)
        return result / self.num_replicas_in_sync if ReduceOp.coerce(op) is ReduceOp.MEAN else result

    def cross_worker_all_gather(
        self,
        tensor: torch.Tensor,
        axis: int,
        local_sizes: list[int],
        options: CommunicationOptions | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Concatenates the replicas' ``tensor`` along ``axis`` (workers along the batch axis)."""
        if self.num_replicas_in_sync == 1:
            return tensor, local_sizes
        group = self._batch_group()
        if group is None:
            return super().cross_worker_all_gather(tensor, axis, local_sizes, options)
        return gather_padded(tensor, axis, local_sizes, group, self._stage)


def _named(root: nn.Module) -> nn.Module:
    """The module whose ``named_parameters()`` names the layout map's keys match: a
    ``phalanx.Model``'s wrapped module (its names, not ``module.``-prefixed ones), else ``root``."""
    inner = getattr(root, "module", None)  # a Model wraps one and fits it (a DDP wrapper fits nothing)
    return inner if isinstance(inner, nn.Module) and callable(getattr(root, "fit", None)) else root
