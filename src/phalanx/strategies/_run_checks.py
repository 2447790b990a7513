"""Checks `Strategy.run` and `Strategy.__init__` make before anything runs, and the device
scope a replica thread enters."""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from phalanx import context
from phalanx.values import DistributedValues

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["check_components", "check_gpus_exist", "check_run_call", "device_scope", "warn_undistributed"]

_warned: weakref.WeakSet[Any] = weakref.WeakSet()  # strategies already warned (once each)


def check_gpus_exist(names: Sequence[str]) -> None:
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


def check_run_call(strategy: DistributionStrategy, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    """Raises TypeError, ValueError or RuntimeError for a `Strategy.run` call that cannot run
    (see its Raises section)."""
    if not callable(fn):
        raise TypeError(f"strategy.run needs a callable. Received: {type(fn).__name__}.")
    if not isinstance(args, (tuple, list)):
        raise TypeError(
            "strategy.run(fn, args=...) takes args as a tuple or list. Received: "
            f"{type(args).__name__}. HINT: write args=(x,) for a single argument."
        )
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"strategy.run kwargs must be a dict. Received: {type(kwargs).__name__}.")
    values = (*args, *kwargs.values()) if kwargs else args
    for value in values:
        if type(value) is not torch.Tensor:  # a plain tensor has no components to count
            check_components(strategy, value)
    if strategy.num_local_replicas > 1:
        warn_undistributed(strategy, values)
    top = context.current_frame()  # the replica context, if any, is the top frame's
    if top is not None and top.replica_context is not None and not top.strategy.is_default:
        raise RuntimeError(
            "strategy.run was called inside a replica context (inside another run). "
            "HINT: call strategy.run from the training loop, outside strategy.run."
        )
    current = top.strategy if top is not None else strategy
    if current is not strategy and not current.is_default:
        raise RuntimeError(
            f"{strategy!r}.run was called inside the scope of {current!r}. HINT: use the "
            "strategy whose scope is open."
        )


def check_components(strategy: DistributionStrategy, value: Any) -> None:
    """Raises ValueError for a distributed value without one component per local replica."""
    if isinstance(value, DistributedValues):
        if len(value.values) != strategy.num_local_replicas:
            raise ValueError(
                f"strategy.run got a {type(value).__name__} with {len(value.values)} components, "
                f"but {strategy!r} has {strategy.num_local_replicas} local replica(s). HINT: make it "
                "with this strategy (experimental_distribute_dataset or "
                "experimental_distribute_values_from_function)."
            )
    elif isinstance(value, (list, tuple)):
        for v in value:
            check_components(strategy, v)
    elif isinstance(value, dict):
        for v in value.values():
            check_components(strategy, v)


def warn_undistributed(strategy: DistributionStrategy, values: Sequence[Any]) -> None:
    """Warns (once per strategy) when several local replicas get the same plain batch tensor.

    Each replica then computes on the whole global batch, and a loss divided by the global
    batch size is summed over the replicas: the reported loss is multiplied by the number of
    replicas. A scalar or a tensor whose first axis is smaller than the replica count is
    taken as a constant meant for every replica, and not warned about.
    """
    replicas = strategy.num_local_replicas
    if replicas < 2 or strategy in _warned:
        return
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] >= replicas:
            _warned.add(strategy)
            warnings.warn(
                f"{strategy!r}.run got a plain tensor of shape {tuple(value.shape)}: each of its "
                f"{replicas} replicas computes on all of it, so a loss averaged over the global batch "
                f"is counted {replicas} times. HINT: split the batch across the replicas with "
                "strategy.experimental_distribute_dataset(...) or "
                "strategy.experimental_distribute_values_from_function(...).",
                UserWarning,
                stacklevel=4,
            )
            return


def device_scope(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Makes ``device`` current for CUDA calls on a replica thread (nothing for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()
