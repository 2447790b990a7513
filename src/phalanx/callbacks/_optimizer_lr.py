"""Reading and setting the learning rate of ``model.optimizer`` (a torch.optim optimizer)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["get_lr", "optimizer_of", "set_lr"]


def optimizer_of(model: Any, who: str) -> torch.optim.Optimizer:
    """``model.optimizer``, checked.

    Raises:
        ValueError: The model has no torch optimizer.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"{who} needs model.optimizer to be a torch.optim.Optimizer. Received: {optimizer!r}. "
            "HINT: compile the model (model.compile(optimizer=...)) before fit."
        )
    return optimizer


def get_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group."""
    return float(optimizer.param_groups[0]["lr"])


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Sets every parameter group's learning rate (in place for tensor learning rates)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # capturable/fused optimizers hold it as a tensor
        else:
            group["lr"] = lr
