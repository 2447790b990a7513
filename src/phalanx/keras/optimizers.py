"""Optimizers by Keras name, built as `torch.optim` optimizers with Keras' defaults."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["get"]

# Keras 3 defaults, translated to torch.optim arguments.
_FACTORIES: dict[str, Callable[[Iterable[Any]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=0.001, betas=(0.9, 0.999), eps=1e-7),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.001, betas=(0.9, 0.999), eps=1e-7, weight_decay=0.004),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.001, alpha=0.9, eps=1e-7),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.001, initial_accumulator_value=0.1, eps=1e-7),
}


def get(identifier: str | torch.optim.Optimizer, params: Iterable[Any]) -> torch.optim.Optimizer:
    """An optimizer from a Keras name ("sgd", "adam", "adamw", "rmsprop", "adagrad") or as given.

    Raises:
        ValueError: An unknown name, or something that is neither a name nor an optimizer.
    """
    if isinstance(identifier, torch.optim.Optimizer):
        return identifier
    if isinstance(identifier, str) and identifier.lower() in _FACTORIES:
        return _FACTORIES[identifier.lower()](params)
    raise ValueError(
        f"Unknown optimizer {identifier!r}. Use one of {sorted(_FACTORIES)} or a torch.optim "
        "optimizer created over model.parameters() inside the strategy scope."
    )


def config_of(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A JSON-able description of an optimizer: its class and hyper-parameters."""
    group = optimizer.param_groups[0]
    hyper = {
        k: v
        for k, v in group.items()
        if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))
    }
    return {"class": type(optimizer).__name__, "hyper": hyper}


def from_config(config: dict[str, Any], params: Iterable[Any]) -> torch.optim.Optimizer:
    """Rebuilds an optimizer of a `torch.optim` class from `config_of`'s description.

    Raises:
        ValueError: The class is not a torch.optim optimizer.
    """
    cls = getattr(torch.optim, config["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"Cannot rebuild optimizer {config['class']!r}: not a torch.optim class.")
    hyper: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in config["hyper"].items()}
    accepted = cls.__init__.__code__.co_varnames
    factory: Any = cls
    return factory(params, **{k: v for k, v in hyper.items() if k in accepted})
