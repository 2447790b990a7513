"""Every change phalanx makes to torch's global behaviour, and how each is undone.

See docs/architecture.md, "The torch footprint". Nothing here runs at import. The changes:

* five global hooks (`install`): parameter, buffer and submodule registration on every
  ``nn.Module``, and pre/post ``optimizer.step()`` on every optimizer. Each asks the strategy
  current on *this thread* and hands it the event through the strategy protocol
  (`phalanx.strategies.strategy.Strategy`, "hooks called by phalanx._hooks"); outside a
  scope they change nothing. Installed when a strategy's scope opens or it runs.
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
a tensor's version counter, an optimizer's own step hooks, a gloo group's options. A torch
release that renames one breaks one function here.
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
    "gloo_options",
    "install",
    "installed",
    "optimizer_step_hooks",
    "remove",
    "remove_torch_hooks",
    "replace_methods",
    "tensor_version",
    "track",
]

_lock = threading.RLock()  # re-entrant: a strategy's finalizer may run inside `install` (gc)
_alive = 0  # strategies made and not yet garbage (the default strategy is never counted)
_tracked: weakref.WeakSet[Any] = weakref.WeakSet()
_step_and_registration: list[RemovableHandle] = []
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
    with _lock:
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
    made = frame.strategy._create_parameter(module, name, param)
    frame.strategy._made_in_scope(module, "_parameters", param if made is None else made)
    return made


def _on_buffer(module: torch.nn.Module, name: str, buffer: Any) -> Any:
    frame = context.current_frame()
    if buffer is None or frame is None:
        return None
    if frame.replica_context is None:
        _refuse_meta(frame.strategy, module, name, buffer)
        made = frame.strategy._create_buffer(module, name, buffer)
        frame.strategy._made_in_scope(module, "_buffers", buffer if made is None else made)
        return made
    # A module re-assigning its buffer inside `run` (self.buf = new): keep the distributed
    # variable and write the new value into this replica's component.
    return frame.strategy.variable_policy.reassign_buffer(module, name, buffer, frame.replica_context)


def _on_submodule(module: torch.nn.Module, name: str, submodule: Any) -> Any:
    frame = context.current_frame()
    if frame is None or submodule is None:
        return None
    in_replica = frame.replica_context is not None
    replacement = frame.strategy._registered_submodule(submodule, in_replica=in_replica)
    if not in_replica:
        frame.strategy._note_submodule(module, submodule if replacement is None else replacement)
    return replacement


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    replica = context.current_replica()
    if replica is not None:
        replica[0]._sync_switch.check_step()
        replica[0].step_sync.before_step(optimizer, replica[1])
        return
    frame = context.current_frame()
    if frame is not None:
        frame.strategy._sync_switch.check_step()
        frame.strategy._step_outside_run(optimizer)
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


def tensor_version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: autograd's count of in-place writes to it or to a view
    of it (torch registers it, it has no public reader). Called by
    `phalanx.ps.coordinator.local_copies.LocalCopies` to see what the chief wrote."""
    return int(tensor._version)


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
