"""The PREDICT computation of an Estimator as a module that torch.export can trace."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from phalanx.estimator.graph import Graph
from phalanx.estimator.specs import ModeKeys

__all__ = ["serving_module"]


class _Shared:
    """What a copy of `_Serving` shares with the original (saved_model.save copies the module)."""

    def __init__(self, estimator: Any, names: list[str], keys: list[str] | None) -> None:
        self.estimator, self.names, self.keys = estimator, names, keys

    def __deepcopy__(self, memo: dict[int, Any]) -> _Shared:
        return self


class _Serving(torch.nn.Module):
    """The PREDICT computation as a module, for torch.export: features in, predictions out."""

    def __init__(self, estimator: Any, graph: Graph, keys: list[str] | None) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(graph.modules.values())
        self._shared = _Shared(estimator, list(graph.modules), keys)

    def forward(self, *inputs: torch.Tensor) -> Any:
        shared = self._shared
        features = dict(zip(shared.keys, inputs, strict=True)) if shared.keys is not None else inputs[0]
        from phalanx.strategies.default import get_strategy  # here: serving imports no strategy

        graph = Graph(get_strategy())
        graph.modules = dict(zip(shared.names, self.parts, strict=True))  # this copy's modules
        with graph.active():
            return shared.estimator.call_model_fn(features, None, ModeKeys.PREDICT).predictions


def _serving_class(arity: int) -> type[_Serving]:
    """`_Serving` with a forward of ``arity`` named inputs: torch.export binds arguments by the
    signature, and ``*inputs`` would be one tuple argument to it."""

    def forward(self: _Serving, *inputs: torch.Tensor) -> Any:
        return _Serving.forward(self, *inputs)

    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    names = ["self"] + [f"input_{i}" for i in range(arity)]
    forward.__dict__["__signature__"] = inspect.Signature([inspect.Parameter(n, positional) for n in names])
    return type("ServingModule", (_Serving,), {"forward": forward})


def serving_module(estimator: Any, graph: Graph, keys: list[str] | None, arity: int) -> torch.nn.Module:
    """``graph``'s modules computing ``estimator``'s predictions from ``arity`` tensors (the
    features, in sorted key order when ``keys`` is given)."""
    return _serving_class(arity)(estimator, graph, keys)
