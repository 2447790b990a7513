"""Every change phalanx makes to torch's global behaviour, and how each is undone.

See docs/architecture.md, "The torch footprint". Nothing here runs at import. The changes:

* five global hooks (`install`): parameter, buffer and submodule registration on every
  ``nn.Module``, and pre/post ``optimizer.step()`` on every optimizer. Each asks the strategy
  current on *this thread* and hands it the event through the strategy protocol
  (`Strategy.parameter_registered`, `buffer_registered`, `submodule_registered`,
  `before_optimizer_step`, ``step_sync.after_step``); outside a scope they change nothing.
  Installed when a strategy's scope opens or it runs.
* replaced methods of a torch class (`replace_methods`): ``torch.amp.GradScaler``'s ``scale``,
  ``unscale_``, ``step``, ``update``, ``get_scale`` learn per-replica state
  (`phalanx.mixed_precision.loss_scale`) under a strategy with several local replicas.
* global forward hooks (`add_module_forward_hooks`): a parameter-server worker reads sharded
  embedding tables by rows (`phalanx.ps.worker.embedding`).

Every strategy but the default one is tracked by a weak reference from the moment it is made
(`track`); once the last one is garbage, every change is removed (`remove`, also public as
`phalanx.remove_torch_hooks`). The next scope or run installs them again.

This module is the bottom layer's: it imports `phalanx.context` only, never
``phalanx.strategies`` or ``phalanx.nn``.

It is also the one place that reads or sets torch state with no public spelling (at the end):
a module's own tensor dicts as stored, its non-persistent buffer names, a tensor's version
counter, a storage's identity, an optimizer's own step hooks, a ``GradScaler``'s found-inf
flags, a gloo group's options. A torch release that renames one breaks one function here.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_forward_hook,
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim import optimizer as torch_optimizer
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from phalanx import context

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = [
    "add_module_forward_hooks",
    "found_inf_per_device",
    "gloo_options",
    "install",
    "installed",
    "non_persistent_buffer_names",
    "optimizer_step_hooks",
    "own_buffers",
    "own_parameters",
    "remove",
    "remove_torch_hooks",
    "replace_methods",
    "step_hooks_in_place",
    "storage_key",
    "tensor_version",
    "track",
]

_lock = threading.RLock()  # re-entrant: a strategy's finalizer may run inside `install` (gc)
_alive = 0  # strategies made and not yet garbage (the default strategy is never counted)
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_step_and_registration: list[RemovableHandle] = []
# Whether the five hooks of `install` are in place now: read by `Strategy.run`'s lean path
# at every step (a module attribute: no call); set by `install` and `remove` only.
step_hooks_in_place = False
_forward: dict[tuple[Callable[..., Any], Callable[..., Any]], list[RemovableHandle]] = {}
_replaced: dict[tuple[type, str], Any] = {}  # (class, method name) -> what the class had (None: inherited)


def track(strategy: Any) -> None:
    """Counts ``strategy`` as alive until it is garbage; the last one's end removes every change.

    Called by `Strategy.__init__` (every strategy but the default one).
    """
    global _alive
    with _lock:
        if strategy in _tracked:
            return
        _tracked.add(strategy)
        _alive += 1
    weakref.finalize(strategy, _strategy_gone)


def _strategy_gone() -> None:
    global _alive
    with _lock:
        _alive -= 1
        if _alive == 0:
            remove()


def install() -> None:
    """Installs the five registration and optimizer-step hooks (idempotent, thread-safe).

    Called by `Strategy.scope` and `Strategy.run`.
    """
    global step_hooks_in_place
    if _step_and_registration:
        return
    with _lock:
        if _step_and_registration:
            return
        _step_and_registration.extend(
            [
                register_module_parameter_registration_hook(_on_parameter),
                register_module_buffer_registration_hook(_on_buffer),
                register_module_module_registration_hook(_on_submodule),
                register_optimizer_step_pre_hook(_before_step),
                register_optimizer_step_post_hook(_after_step),
            ]
        )
        step_hooks_in_place = True


def installed() -> bool:
    """Whether any change of this module is in place now."""
    return bool(_step_and_registration or _forward or _replaced)


def replace_methods(
    cls: type, wrap: Callable[[Callable[..., Any]], Callable[..., Any]], names: tuple[str, ...]
) -> None:
    """Replaces ``cls``'s methods ``names`` by ``wrap(method)`` until `remove` (idempotent).

    Called by `phalanx.mixed_precision.loss_scale.adopt_torch_grad_scalers`.
    """
    with _lock:
        for name in names:
            if (cls, name) in _replaced:
                continue
            _replaced[cls, name] = cls.__dict__.get(name)
            setattr(cls, name, wrap(getattr(cls, name)))


def add_module_forward_hooks(pre: Callable[..., Any], post: Callable[..., Any]) -> None:
    """Registers a global forward pre-hook and forward hook on every module until `remove`
    (idempotent for the same pair). Called by `phalanx.ps.worker.embedding.install`."""
    with _lock:
        if (pre, post) not in _forward:
            _forward[pre, post] = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]


def remove() -> None:
    """Removes every change phalanx made to torch's global behaviour, now.

    torch's global module and optimizer hook registries and ``torch.amp.GradScaler`` are
    torch's own again: a module built afterwards, even in a strategy's scope that was entered
    before, has plain ``nn.Parameter``s. A strategy that enters its scope or runs again
    installs the hooks again. Called automatically once no strategy is alive.
    """
    global step_hooks_in_place
    with _lock:
        step_hooks_in_place = False
        for handle in _step_and_registration:
            handle.remove()
        _step_and_registration.clear()
        for handles in _forward.values():
            for handle in handles:
                handle.remove()
        _forward.clear()
        for (cls, name), original in _replaced.items():
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        _replaced.clear()


remove_torch_hooks = remove  # the public spelling (`phalanx.remove_torch_hooks`)


# ---------------------------------------------------------------------- the hooks


def _refuse_meta(strategy: DistributionStrategy, module: torch.nn.Module, name: str, tensor: Any) -> None:
    if isinstance(tensor, torch.Tensor) and tensor.is_meta and not strategy.materializes_meta_tensors:
        raise ValueError(
            f"{type(module).__name__}.{name} was made on the meta device inside the scope of "
            f"{type(strategy).__name__}, which keeps a full copy of every parameter on each replica "
            "and so needs their values now. HINT: build the model on a real device, or use "
            "phalanx.experimental.FullyShardedStrategy, which gives meta parameters their memory and "
            "values (reset_parameters()) one layer at a time when it shards them."
        )


def _on_parameter(module: torch.nn.Module, name: str, param: Any) -> Any:
    frame = context.current_frame()
    if param is None or frame is None or frame.replica_context is not None:
        return None
    _refuse_meta(frame.strategy, module, name, param)
    return frame.strategy.parameter_registered(module, name, param)


def _on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> Any:
    frame = context.current_frame()
    if buffer is None or frame is None:
        return None
    if frame.replica_context is None:
        _refuse_meta(frame.strategy, module, name, buffer)
        return frame.strategy.buffer_registered(module, name, buffer)
    # A module re-assigning its buffer inside `run` (self.buf = new): keep the distributed
    # variable and write the new value into this replica's component.
    return frame.strategy.variable_policy.reassign_buffer(module, name, buffer, frame.replica_context)


def _on_submodule(module: torch.nn.Module, name: str, submodule: Any) -> Any:
    frame = context.current_frame()
    if frame is None or submodule is None:
        return None
    return frame.strategy.submodule_registered(module, submodule, frame.replica_context is not None)


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context.current_replica()
    if replica is not None:
        replica[0].before_optimizer_step(optimizer, replica[1])
        return
    frame = context.current_frame()
    if frame is not None:
        frame.strategy.before_optimizer_step(optimizer, None)
    # optimizer state kept per replica (`PerReplicaState`) refuses a step outside `run`
    check = getattr(optimizer.state, "check_step_outside_run", None)
    if check is not None:
        check()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context.current_replica()
    if replica is not None:
        replica[0].step_sync.after_step(optimizer, replica[1])
        guard = context.write_guard()
        if guard is not None:
            guard.snapshot()  # the step wrote the components: its writes are the allowed ones


# ---------------------------------------------------------------------- torch state without a public spelling
# `named_parameters(recurse=False)` and friends skip None entries and cannot store a tensor
# without firing the registration hooks; the dicts of `own_parameters`/`own_buffers` can.


def own_parameters(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own parameter dict as stored (``nn.Module._parameters``), None entries included.

    Storing into it replaces a parameter without torch's registration hooks (so without this
    module's hooks either). Inside a replica, ``d[name]`` may be the replica's plain component
    (`phalanx.nn._module_tensors.ReplicaTensors`); ``items()``/``values()`` give the tensors as
    registered.
    """
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict[str, Any]:
    """``module``'s own buffer dict as stored (``nn.Module._buffers``): see `own_parameters`."""
    return module._buffers


def non_persistent_buffer_names(module: torch.nn.Module) -> set[str]:
    """The names of ``module``'s buffers left out of its ``state_dict`` (``persistent=False``)."""
    return module._non_persistent_buffers_set


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: autograd's count of in-place writes to it or to a view
    of it (torch registers it, it has no public reader). Called by
    `phalanx.ps.coordinator.local_copies.LocalCopies` to see what the chief wrote."""
    return int(tensor._version)


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, the same for every view of it (and for meta tensors,
    which have no data pointer to compare)."""
    return tensor.untyped_storage()._cdata


def optimizer_step_hooks(
    optimizer: torch.optim.Optimizer,
) -> tuple[list[Callable[..., Any]], list[Callable[..., Any]]]:
    """The hooks ``optimizer.step()`` runs now: before the step (the global ones, then the
    optimizer's own) and after it (its own, then the global ones), in torch's order.

    torch registers an optimizer's own hooks publicly (``register_step_pre_hook``) but has no
    reader. Called by `phalanx.ps.variable_store.sparse_adagrad.step_hooks` and
    `phalanx.ps.variable_store.optimizer.StoreOptimizer`.
    """
    before = [
        *torch_optimizer._global_optimizer_pre_hooks.values(),
        *optimizer._optimizer_step_pre_hooks.values(),
    ]
    after = [
        *optimizer._optimizer_step_post_hooks.values(),
        *torch_optimizer._global_optimizer_post_hooks.values(),
    ]
    return before, after


def found_inf_per_device(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
    """The found-inf flags (one tensor per device) ``scaler`` recorded when it unscaled
    ``optimizer``'s gradients in this step: whether its last ``step`` skipped the update."""
    return scaler._found_inf_per_device(optimizer)


def gloo_options(devices: list[Any], threads: int, timeout: timedelta) -> Any:
    """The options of a ``ProcessGroupGloo`` with these ``devices`` (its connections),
    ``threads`` and ``timeout``: torch's constructor takes them, through a class and
    attributes it only names privately. Called by
    `phalanx.communication.transports.gloo.groups.make_gloo_group`."""
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch has no stubs for it
    options._devices = devices
    options._threads = threads
    options._timeout = timeout
    return options
