"""The default strategy: what library code sees when no strategy is in use, and the public
queries that fall back to it (`get_strategy`, `get_replica_context`).

A pass-through singleton with the full Strategy API: ``run(fn)`` calls ``fn``, ``reduce``
returns its input, modules and datasets are left as they are. The context stack itself
(`phalanx.context`) is the bottom layer and knows no strategy class; these two queries live
here because outside any frame they make the default strategy.
"""

from __future__ import annotations

import threading
from typing import Any, cast

import torch

from phalanx import context
from phalanx.strategies.replica_context import ReplicaContext
from phalanx.strategies.strategy import Strategy

__all__ = ["DefaultStrategy", "default_strategy", "get_replica_context", "get_strategy"]


class DefaultStrategy(Strategy):
    """One replica on whatever device the user's tensors are on; changes nothing."""

    is_default = True
    materializes_meta_tensors = True  # no strategy: torch's own meta tensors

    def __init__(self) -> None:
        super().__init__(["cpu:0"])

    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        return None

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        return None

    def _made_in_scope(self, module: torch.nn.Module, attribute: str, tensor: Any) -> None:
        return

    def _registered_submodule(self, submodule: torch.nn.Module, in_replica: bool) -> Any:
        return None

    @property
    def input_devices(self) -> tuple[torch.device, ...] | None:
        return None

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_lock = threading.Lock()
_default: DefaultStrategy | None = None


def default_strategy() -> DefaultStrategy:
    """The process-wide default strategy (made on first use)."""
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = DefaultStrategy()
    return _default


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope (or replica context) is active, else the default."""
    frame = context.current_frame()
    if frame is not None:
        return cast(Strategy, frame.strategy)
    return default_strategy()


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or None in cross-replica context.

    Outside any scope this is the default strategy's replica context, so library code can
    call ``get_replica_context().all_reduce(...)`` unconditionally.
    """
    frame = context.current_frame()
    if frame is None:
        return default_strategy().replica_context(0)
    if frame.strategy.is_default and frame.replica_context is None:
        return cast(ReplicaContext, frame.strategy.replica_context(0))
    return cast("ReplicaContext | None", frame.replica_context)
