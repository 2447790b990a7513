"""The modules and optimizers a model_fn uses, created on its first call and reused after.

TF1's model_fn builds a graph once (``tf.layers.dense`` creates its variables the first time
and reuses them by name); a PyTorch model_fn asks for its modules by name the same way:

    def model_fn(features, labels, mode, params):
        net = phalanx.estimator.get_module("net", lambda: torch.nn.Linear(4, 2))
        ...
        optimizer = phalanx.estimator.get_optimizer(lambda: torch.optim.Adam(net.parameters()))

Each Estimator call (train, evaluate, predict, export) builds a fresh `Graph` in the scope of
its strategy and restores the newest checkpoint into it, as TF does.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from phalanx.strategies.strategy import Strategy

__all__ = ["Graph", "get_module", "get_optimizer"]

T = TypeVar("T")
_current: contextvars.ContextVar[Graph | None] = contextvars.ContextVar(
    "phalanx_estimator_graph", default=None
)


class Graph:
    """One Estimator call's modules and optimizers, created in ``strategy``'s scope.

    Args:
        strategy: Where variables are created (between-graph: on the ps tasks).
    """

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.modules: dict[str, torch.nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self._building = False

    @contextlib.contextmanager
    def active(self, building: bool = False) -> Iterator[Graph]:
        """Makes this the graph `get_module` uses; ``building`` allows creating new entries."""
        token = _current.set(self)
        self._building = building
        try:
            yield self
        finally:
            self._building = False
            _current.reset(token)

    def objects(self) -> dict[str, Any]:
        """What a checkpoint holds: ``module.<name>`` and ``optimizer.<name>``."""
        return {
            **{f"module.{name}": m for name, m in self.modules.items()},
            **{f"optimizer.{name}": o for name, o in self.optimizers.items()},
        }

    def get(self, table: dict[str, T], name: str, factory: Callable[[], T]) -> T:
        if name not in table:
            if not self._building:
                raise ValueError(
                    "A model_fn creates its modules and optimizers on its first call; later calls "
                    f"reuse them. Received: a new {name!r} on a later call. HINT: call get_module/"
                    "get_optimizer with the same names on every call (no names that depend on the data)."
                )
            with self.strategy.scope():
                table[name] = factory()
        return table[name]


def _graph(what: str) -> Graph:
    graph = _current.get()
    if graph is None:
        raise RuntimeError(
            f"phalanx.estimator.{what} is called inside a model_fn that an Estimator runs. Received: "
            "a call outside one. HINT: pass the model_fn to phalanx.estimator.Estimator."
        )
    return graph


def get_module(name: str, factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model_fn's module ``name``: made by ``factory()`` on the first call, then reused
    (tf.compat.v1.get_variable's create-or-reuse).

    Raises:
        RuntimeError: Called outside a model_fn an Estimator runs.
        ValueError: A new name on a later call.
    """
    module = _graph("get_module").get(_graph("get_module").modules, name, factory)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"get_module's factory returns a torch.nn.Module. Received: {type(module).__name__}.")
    return module


def get_optimizer(
    factory: Callable[[], torch.optim.Optimizer], name: str = "optimizer"
) -> torch.optim.Optimizer:
    """The model_fn's optimizer ``name``, made by ``factory()`` on the first TRAIN call.

    Raises:
        RuntimeError: Called outside a model_fn an Estimator runs.
        ValueError: A new name on a later call.
    """
    graph = _graph("get_optimizer")
    return graph.get(graph.optimizers, name, factory)
