"""Mean, Sum and MeanMetricWrapper: metrics that average or add values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.metrics.metric import Metric, divide_no_nan, weights_like

__all__ = ["Mean", "MeanMetricWrapper", "Sum"]


class Sum(Metric):
    """The (weighted) sum of all values seen."""

    total: torch.Tensor

    def __init__(self, name: str = "sum", dtype: torch.dtype = torch.float64) -> None:
        super().__init__(name, dtype)
        self.add_state("total")

    @torch.no_grad()
    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        v = torch.as_tensor(values).detach().to(torch.float64)
        self.total.add_((v * weights_like(v, sample_weight)).sum().to(self.dtype))

    def result(self) -> torch.Tensor:
        return self.total.clone()


class Mean(Metric):
    """The (weighted) mean of all values seen, counted element by element."""

    total: torch.Tensor
    count: torch.Tensor

    def __init__(self, name: str = "mean", dtype: torch.dtype = torch.float64) -> None:
        super().__init__(name, dtype)
        self.add_state("total")
        self.add_state("count")

    @torch.no_grad()
    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        v = torch.as_tensor(values).detach().to(torch.float64)
        w = weights_like(v, sample_weight)
        self.total.add_((v * w).sum().to(self.dtype))
        self.count.add_(w.sum().to(self.dtype))

    def result(self) -> torch.Tensor:
        return divide_no_nan(self.total.clone(), self.count.clone())


class MeanMetricWrapper(Mean):
    """The mean over examples of ``fn(y_true, y_pred)`` (a per-example metric function).

    Args:
        fn: ``fn(y_true, y_pred, **kwargs) -> per-example values``.
        name: Name in logs (default: the function's name).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        dtype: torch.dtype = torch.float64,
        **kwargs: Any,
    ) -> None:
        super().__init__(str(name or getattr(fn, "__name__", "metric")), dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        values = torch.as_tensor(self._fn(y_true, y_pred, **self._fn_kwargs))
        if values.dim() > 1:
            values = values.reshape(values.shape[0], -1).mean(dim=1)
        super().update_state(values, sample_weight)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, **self._fn_kwargs}
