"""The default strategy: what library code sees when no strategy is in use.

A pass-through singleton with the full Strategy API: ``run(fn)`` calls ``fn``, ``reduce``
returns its input, modules and datasets are left as they are.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from phalanx.strategies.strategy import Strategy

__all__ = ["DefaultStrategy", "default_strategy"]


class DefaultStrategy(Strategy):
    """One replica on whatever device the user's tensors are on; changes nothing."""

    _is_default = True

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

    def _fetch_devices(self) -> tuple[torch.device, ...] | None:
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
