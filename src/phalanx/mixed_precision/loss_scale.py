"""Dynamic loss scaling inside ``strategy.run``: a per-replica ``torch.amp.GradScaler``.

``torch.amp.GradScaler`` keeps its scale and its per-optimizer bookkeeping (stage, found
inf) in plain attributes. Replicas of one process share the scaler object, each on its own
thread, so one replica's ``unscale_`` would count for all and ``update`` would move the
scale once per replica. `GradScaler` gives each local replica its own copy of that state
(replica 0's outside ``run``, so ``state_dict()`` and ``get_scale()`` read as usual).

No replica needs to ask the others whether they overflowed: under every synchronous
strategy ``.grad`` holds the gradient summed over all replicas of all workers once
``backward()`` returns (the scaled sum: each replica scaled its loss by the same scale), so
an inf or NaN in any replica's gradient is in every replica's sum, every replica's
``unscale_`` finds it, every replica skips ``optimizer.step()`` and halves its scale.

A plain ``torch.amp.GradScaler`` works too: once a strategy with several local replicas
has entered its scope or run (`adopt_torch_grad_scalers`), the first ``scale``/``unscale_``/
``step``/``update``/``get_scale`` a replica calls on one turns it into a per-replica scaler in
place (its state so far becomes replica 0's). Outside replica contexts, and with one replica
per process, torch's class behaves exactly as before. Under FullyShardedStrategy ``unscale_``
first hands the optimizer its sharded parameters (which it otherwise gets at its first step);
the overflow check of sharded gradients is every worker's (DTensor all-reduces the flag).
"""

from __future__ import annotations

import functools
import threading
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from phalanx import _hooks, context

__all__ = ["GradScaler", "LossScaleOptimizer", "adopt_torch_grad_scalers"]

_PER_REPLICA = ("_scale", "_growth_tracker", "_per_optimizer_states")


def _fresh() -> dict[str, Any]:
    states: defaultdict[int, dict[str, Any]] = defaultdict(_refresh_per_optimizer_state)
    return {"_scale": None, "_growth_tracker": None, "_per_optimizer_states": states}


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with one state per local replica (see module docstring).

    Use it as ``torch.amp.GradScaler``, inside or outside ``strategy.run``::

        scaler = phalanx.mixed_precision.GradScaler("cpu")
        def step(x, y):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_fn(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)          # acts on the summed gradient
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)              # skipped on every replica after an overflow
            scaler.update()

    Args: as ``torch.amp.GradScaler`` (``device`` default ``"cpu"``).
    """

    def __init__(
        self,
        device: str = "cpu",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        self.__dict__["_replicas"] = {0: _fresh()}
        self.__dict__["_replicas_lock"] = threading.Lock()
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def _replica_state(self) -> dict[str, Any]:
        """The calling replica's state; made from replica 0's at a replica's first use."""
        replica = context.current_replica()
        index = replica[1] if replica is not None else 0
        replicas: dict[int, dict[str, Any]] = self.__dict__["_replicas"]
        state = replicas.get(index)
        if state is None:
            with self.__dict__["_replicas_lock"]:
                state = replicas.get(index)
                if state is None:
                    state = _fresh()
                    first = replicas[0]
                    # torch's lazy init sets _scale, then _growth_tracker, on replica 0's thread:
                    # copy the pair only once both exist, else let this replica init its own
                    # (from the same init_scale) rather than take a half-made pair.
                    scale, tracker = first["_scale"], first["_growth_tracker"]
                    if scale is not None and tracker is not None:
                        state["_scale"], state["_growth_tracker"] = scale.clone(), tracker.clone()
                    replicas[index] = state
        return state

    def __getattr__(self, name: str) -> Any:
        if name in _PER_REPLICA:
            return self._replica_state()[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _PER_REPLICA:
            self._replica_state()[name] = value
        else:
            super().__setattr__(name, value)

    def __getstate__(self) -> dict[str, Any]:
        """Pickles replica 0's state (a parameter-server worker gets its own scaler)."""
        state = super().__getstate__()
        state.pop("_replicas_lock", None)
        state.pop("_replicas", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__["_replicas"] = {0: _fresh()}
        self.__dict__["_replicas_lock"] = threading.Lock()
        for name, value in state.items():
            setattr(self, name, value)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads replica 0's state; every other replica starts again from it."""
        replicas: dict[int, dict[str, Any]] = self.__dict__["_replicas"]
        for index in [i for i in replicas if i != 0]:
            del replicas[index]
        super().load_state_dict(state_dict)


_ADOPTED_METHODS = ("scale", "unscale_", "step", "update", "get_scale")
_adopt_lock = threading.Lock()
_per_replica_classes: dict[type, type] = {}


def _per_replica_class(cls: type) -> type:
    """``cls`` (a ``torch.amp.GradScaler`` subclass) with `GradScaler`'s per-replica state:
    `GradScaler` itself for torch's class, else a subclass made once that pickles as ``cls``."""
    if cls is torch.amp.GradScaler:
        return GradScaler
    made = _per_replica_classes.get(cls)
    if made is None:

        def __reduce__(self: Any) -> tuple[Any, ...]:  # noqa: N807 (the pickle protocol's name)
            return _rebuild, (cls, self.__getstate__())

        namespace = {"__module__": __name__, "__reduce__": __reduce__}
        made = type(f"PerReplica{cls.__name__}", (GradScaler, cls), namespace)
        _per_replica_classes[cls] = made
    return made


def _rebuild(cls: type[torch.amp.GradScaler], state: dict[str, Any]) -> torch.amp.GradScaler:
    """A pickled adopted scaler: the user's class again (adopted anew where several replicas use it)."""
    scaler = cls.__new__(cls)
    scaler.__setstate__(state)
    return scaler


def _adopt(scaler: torch.amp.GradScaler) -> None:
    """Turns a plain scaler into a per-replica one in place; its state becomes replica 0's."""
    with _adopt_lock:
        if isinstance(scaler, GradScaler):  # another replica's thread was first
            return
        state = _fresh()
        for name in _PER_REPLICA:
            if name in scaler.__dict__:
                state[name] = scaler.__dict__.pop(name)
        scaler.__dict__["_replicas"] = {0: state}
        scaler.__dict__["_replicas_lock"] = threading.Lock()
        scaler.__class__ = _per_replica_class(type(scaler))


def _adopting(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: torch.amp.GradScaler, *args: Any, **kwargs: Any) -> Any:
        replica = context.current_replica()
        if replica is None:
            return method(self, *args, **kwargs)
        if replica[0].num_local_replicas > 1 and not isinstance(self, GradScaler):
            _adopt(self)
        sync = replica[0].step_sync
        if method.__name__ == "unscale_" and hasattr(sync, "before_unscale"):
            sync.before_unscale(args[0] if args else kwargs["optimizer"])
        return method(self, *args, **kwargs)

    return call


def adopt_torch_grad_scalers() -> None:
    """Lets plain ``torch.amp.GradScaler`` objects work inside ``strategy.run`` with several
    local replicas (see the module docstring). Idempotent; called by every strategy with
    more than one local replica when its scope opens or it runs. The replacement is one of
    phalanx's changes to torch (`phalanx._hooks`): it is undone once no strategy is alive."""
    _hooks.replace_methods(torch.amp.GradScaler, _adopting, _ADOPTED_METHODS)


class LossScaleOptimizer:
    """TF's ``LossScaleOptimizer``: an optimizer that scales the loss and skips overflowing steps.

    Wraps ``optimizer`` with a dynamic loss scale (`GradScaler`): scale the loss before
    backward (`get_scaled_loss`), then `step` unscales the (summed) gradients, skips the
    update if any is inf or NaN, and adjusts the scale. Works inside ``strategy.run`` under
    every strategy; under ParameterServerStrategy each worker scales on its own, as in TF.

    Args:
        inner_optimizer: The optimizer that applies the updates.
        dynamic: Whether the scale adapts (TF's default); False keeps ``initial_scale``.
        initial_scale: The first loss scale (TF's default 2**15).
        dynamic_growth_steps: Steps without overflow before the scale doubles (TF: 2000).
    """

    def __init__(
        self,
        inner_optimizer: torch.optim.Optimizer,
        dynamic: bool = True,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
    ) -> None:
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "LossScaleOptimizer wraps a torch.optim.Optimizer. Received: "
                f"{type(inner_optimizer).__name__}. HINT: LossScaleOptimizer(torch.optim.SGD(...))."
            )
        self.inner_optimizer = inner_optimizer
        self.dynamic = dynamic
        growth = dynamic_growth_steps if dynamic else 2**62
        backoff = 0.5 if dynamic else 1.0
        self._scaler = GradScaler("cpu", initial_scale, 2.0 if dynamic else 1.0, backoff, growth)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's parameter groups."""
        return self.inner_optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        """The current loss scale (this replica's; the same on every replica)."""
        return float(self._scaler.get_scale())

    def get_scaled_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale: call ``backward()`` on this."""
        return self._scaler.scale(loss)

    def unscale_gradients(self) -> None:
        """Divides the gradients by the loss scale now (before clipping); `step` then does not."""
        self._scaler.unscale_(self.inner_optimizer)

    def step(self) -> bool:
        """Unscales, applies the update unless a gradient overflowed, adjusts the scale.

        Returns:
            Whether the update was applied (False: skipped on every replica after an overflow).
        """
        self._scaler.step(self.inner_optimizer)
        found = _hooks.found_inf_per_device(self._scaler, self.inner_optimizer)
        overflowed = any(v.item() for v in found.values())
        self._scaler.update()
        return not overflowed

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the inner optimizer's gradients."""
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state and the loss scale's."""
        return {"optimizer": self.inner_optimizer.state_dict(), "loss_scale": self._scaler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what `state_dict` gave."""
        self.inner_optimizer.load_state_dict(state_dict["optimizer"])
        self._scaler.load_state_dict(state_dict["loss_scale"])
