"""The protocols between phalanx's layers: what the lower layers ask of a strategy.

phalanx is layered (docs/architecture.md, "Layers"): contexts, distributed variables, values,
device names and the torch hooks at the bottom; ``nn``, ``communication`` and the input
pipeline above them; ``strategies`` above those. A lower layer never imports a strategy: it
talks to the one it is given (or the one current on its thread) through these protocols,
which `phalanx.Strategy` implements. A strategy author subclasses `phalanx.Strategy` and
overrides the hooks listed in `DistributionStrategy` (the ones with a leading underscore are
called by phalanx, never by users); the composed parts it may replace implement `StepSync`
and `VariableHome`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

__all__ = ["DistributionStrategy", "StepSync", "VariableHome"]


class StepSync(Protocol):
    """Called around every ``optimizer.step()`` made in a replica context of the strategy.

    `phalanx._hooks` calls these methods from torch's global optimizer-step hooks whenever an
    optimizer steps inside ``strategy.run``. Implementations: in-process replicas meet and sum
    gradients (`phalanx.strategies.replicas.gradients.GradientSync`); MultiWorkerMirrored's bucket
    sync waits for the buckets all-reduced during backward; the parameter-server coordinator
    refuses steps; a parameter-server worker pushes its gradients to the ps tasks.
    """

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Runs before the update (every local replica calls it, each on its own thread):
        makes ``.grad`` hold what the update must apply, or raises."""

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        """Runs after the update (every local replica)."""

    def reset_thread(self) -> None:
        """Clears this thread's step state when a replica's ``run`` ends (also after an error)."""

    # Optional, for strategies whose optimizers get their parameters at the first step
    # (FullyShardedStrategy): ``before_unscale(optimizer)`` runs before a ``torch.amp.GradScaler``
    # unscales the optimizer's gradients. A strategy whose step sync has it gets
    # `phalanx.mixed_precision.loss_scale.adopt_torch_grad_scalers`.


class VariableHome(Protocol):
    """Where a strategy's distributed variables live and how they are read and written
    (`phalanx.strategies.replicas.variable_policy.VariablePolicy`; CentralStorage has its own)."""

    @property
    def has_variables(self) -> bool:
        """Whether the strategy made any distributed variable."""

    @property
    def generation(self) -> int:
        """Changes whenever the set of variables or their components changes."""

    def variables(self) -> Iterable[Any]:
        """The live distributed variables."""

    def materialize(self, var: Any) -> None:
        """Makes missing components from the primary, or re-mirrors after cross-replica writes."""

    def aggregate_sync_on_read(self, var: Any) -> torch.Tensor:
        """The cross-replica value of a sync-on-read variable (a collective with several workers)."""

    def forget_read(self, var: Any) -> None:
        """Drops what `reading_together` aggregated for ``var`` (it was written)."""

    def merged_assign(
        self, var: Any, func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], index: int
    ) -> Any:
        """A replica's aggregated in-place write of a mirrored variable (all local replicas; blocks)."""

    def reassign_buffer(self, module: torch.nn.Module, name: str, value: Any, ctx: Any) -> Any:
        """A module re-assigned its buffer inside ``run`` (None: not a variable, let torch assign)."""


class DistributionStrategy(Protocol):
    """What contexts, variables, the torch hooks, ``nn``, the input pipeline and a strategy's
    composed parts ask of a strategy. `phalanx.Strategy` implements all of it.

    Identity and layout (read by everyone): `is_default`, `num_local_replicas`,
    `num_replicas_in_sync`, `num_workers_in_sync`, `worker_rank`, `first_replica_id`,
    `local_devices`, `rendezvous`, `cross_device_ops`, `variable_policy`, `step_sync`,
    `replica_context`; the input pipeline's `input_devices` and `any_worker_has_data`.

    What the torch hooks hand it (`phalanx._hooks`): `parameter_registered`,
    `buffer_registered`, `submodule_registered`, `before_optimizer_step`; a copy of a variable
    asks `create_variable`. Each calls hooks the strategy overrides (``_create_parameter``,
    ``_create_buffer``, ``_made_in_scope``, ``_registered_submodule``, ``_note_submodule``,
    ``_step_outside_run``: see docs/architecture.md, "Extension points").

    Across workers (overridden by cross-process strategies; identity in one process):
    `cross_worker_all_reduce`, `cross_worker_all_gather`, `cross_worker_sparse_sum`.

    `sync_switch` (`phalanx.strategies.accumulation.SyncSwitch`): whether backward passes sum
    now (``no_sync()``); an ``optimizer.step()`` inside ``no_sync()`` is refused.
    """

    @property
    def is_default(self) -> bool:
        """True for the pass-through default strategy only."""

    @property
    def materializes_meta_tensors(self) -> bool:
        """Whether parameters and buffers made on the meta device in the scope are allowed
        (the strategy gives them memory and values itself: FullyShardedStrategy)."""

    @property
    def num_local_replicas(self) -> int:
        """Replicas in this process."""

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of all workers that step together."""

    @property
    def num_workers_in_sync(self) -> int:
        """Workers that step together."""

    @property
    def worker_rank(self) -> int:
        """This worker's rank among the workers that step together."""

    @property
    def first_replica_id(self) -> int:
        """The global index of this worker's first replica."""

    @property
    def local_devices(self) -> tuple[torch.device, ...]:
        """One device per local replica."""

    @property
    def rendezvous(self) -> Any:
        """Where this worker's replicas meet (`phalanx.strategies.replicas.rendezvous.ReplicaRendezvous`)."""

    @property
    def cross_device_ops(self) -> Any:
        """How local replicas' values are reduced (`phalanx.CrossDeviceOps`)."""

    @property
    def variable_policy(self) -> VariableHome:
        """Where this strategy's distributed variables live."""

    @property
    def step_sync(self) -> StepSync:
        """What ``optimizer.step()`` inside ``run`` does before and after the update."""

    def replica_context(self, index: int) -> Any:
        """The `phalanx.ReplicaContext` of local replica ``index``."""

    def scope(self) -> AbstractContextManager[Any]:
        """Makes the strategy current on this thread."""

    def run(self, fn: Callable[..., Any], args: Any = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Runs ``fn`` once per local replica."""

    def remember_batch(self, batch: Any, global_count: int | None, offsets: list[int] | None) -> None:
        """Notes a distributed batch's global size and per-replica offsets for the next ``run``."""

    @property
    def sync_switch(self) -> Any:
        """Whether backward passes sum now (`phalanx.strategies.accumulation.SyncSwitch`)."""

    @property
    def input_devices(self) -> tuple[torch.device, ...] | None:
        """Where distributed input is placed, per local replica (None: left where it is)."""

    def any_worker_has_data(self, has_data: bool) -> bool:
        """Whether any worker still has input this step (a collective across workers)."""

    def parameter_registered(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        """What replaces a parameter registered in the scope outside ``run`` (None: keep it)."""

    def buffer_registered(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        """What replaces a buffer registered in the scope outside ``run`` (None: keep it)."""

    def submodule_registered(
        self, parent: torch.nn.Module, submodule: torch.nn.Module, in_replica: bool
    ) -> Any:
        """What replaces a submodule registered in the scope or inside ``run`` (None: keep it)."""

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer, replica_index: int | None) -> None:
        """Runs before ``optimizer.step()`` in the scope (``replica_index`` None outside ``run``)."""

    def create_variable(self, tensor: torch.Tensor, *, is_parameter: bool) -> Any:
        """What the strategy makes of a tensor no module registers (None: keep it)."""

    def cross_worker_all_reduce(self, tensor: torch.Tensor, op: Any, options: Any = None) -> torch.Tensor: ...

    def cross_worker_all_gather(
        self, tensor: torch.Tensor, axis: int, local_sizes: list[int], options: Any = None
    ) -> tuple[torch.Tensor, list[int]]: ...

    def cross_worker_sparse_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...
