"""The Metric base: additive state that distributes as SUM sync-on-read variables."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.variables import set_aggregation

__all__ = ["Metric"]


class Metric(nn.Module):
    """Base of Keras-style metrics, usable in `fit` and in custom loops.

    State is made of additive totals registered with `add_state`. Created in a strategy
    scope, each state becomes a SUM sync-on-read variable: ``update_state`` inside
    ``strategy.run`` updates the replica's own copy, and ``result()`` outside reads the sum
    over every replica and worker, so results are count-weighted global values.

    Args:
        name: Name in logs.
        dtype: dtype of the state (float64 by default, so large counts stay exact).
    """

    def __init__(self, name: str | None = None, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.name = name or _snake(type(self).__name__)
        self.dtype = dtype

    def add_state(self, name: str, shape: tuple[int, ...] = (), initializer: str = "zeros") -> torch.Tensor:
        """Creates and registers an additive state tensor (SUM across replicas and workers)."""
        if initializer != "zeros":
            raise ValueError(f"Metric state must start at zeros (it is summed). Received: {initializer!r}.")
        self.register_buffer(name, set_aggregation(torch.zeros(shape, dtype=self.dtype), "sum"))
        return getattr(self, name)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Accumulates a batch (call inside `strategy.run` or anywhere without a strategy)."""
        raise NotImplementedError

    def result(self) -> torch.Tensor:
        """The metric's value from the accumulated totals (read outside `strategy.run`)."""
        raise NotImplementedError

    def reset_state(self) -> None:
        """Sets every state back to zero."""
        with torch.no_grad():
            for buffer in self.buffers(recurse=False):
                buffer.zero_()

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        self.update_state(*args, **kwargs)
        return self.result()

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        return cls(**config)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def _snake(name: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in name).lstrip("_")


def divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a / b, and 0 where b is 0 (Keras' empty-metric result)."""
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


def weights_like(values: torch.Tensor, sample_weight: Any) -> torch.Tensor:
    """Per-element weights broadcast to ``values`` (ones when None)."""
    if sample_weight is None:
        return torch.ones_like(values, dtype=torch.float64)
    w = torch.as_tensor(sample_weight, device=values.device).to(torch.float64)
    while w.dim() < values.dim():
        w = w.unsqueeze(-1)
    return torch.broadcast_to(w, values.shape)
