"""Sum, Mean and MeanMetricWrapper: metrics that add or average values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.losses._utils import divide_no_nan
from phalanx.metrics._functions import FUNCTIONS
from phalanx.metrics._samplewise import mean_over, reduce_to_samplewise_values, sum_over
from phalanx.metrics.metric import Metric

__all__ = ["Mean", "MeanMetricWrapper", "Sum"]


class Sum(Metric):
    """The (weighted) sum of every value seen.

    Args:
        name: Name in logs.
        dtype: Dtype of the state (default float32).
    """

    total: torch.Tensor

    def __init__(self, name: str = "sum", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(dtype=dtype, name=name)
        self.add_state("total")

    @torch.no_grad()
    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds ``values`` (times ``sample_weight``, broadcast from the leading axes)."""
        values, _ = reduce_to_samplewise_values(values, sample_weight, sum_over, self.dtype)
        self._add(self.total, values.sum())

    def result(self) -> torch.Tensor:
        """The total."""
        return self._read("total")[0]


class Mean(Metric):
    """The (weighted) mean of every example seen.

    Values of rank > 1 are averaged per example first (``[batch, d]`` is ``batch``
    examples); the count is the number (or total weight) of examples, as in Keras.

    Args:
        name: Name in logs.
        dtype: Dtype of the state (default float32).
    """

    total: torch.Tensor
    count: torch.Tensor

    def __init__(self, name: str = "mean", dtype: torch.dtype | str | None = None) -> None:
        super().__init__(dtype=dtype, name=name)
        self.add_state("total")
        self.add_state("count")

    @torch.no_grad()
    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        """Adds a batch of values (``sample_weight``: one weight per example, or per element)."""
        values, weights = reduce_to_samplewise_values(values, sample_weight, mean_over, self.dtype)
        self._add(self.total, values.sum())
        if weights is not None:
            self._add(self.count, weights.sum())
        else:
            self._add(self.count, float(values.shape[0]) if values.dim() else 1.0)

    def result(self) -> torch.Tensor:
        """total / count, 0 when nothing was counted."""
        total, count = self._read("total", "count")
        return divide_no_nan(total, count)


class MeanMetricWrapper(Mean):
    """The mean over examples of ``fn(y_true, y_pred, **kwargs)`` (a per-example metric function).

    Args:
        fn: ``fn(y_true, y_pred, **kwargs)`` returning values of shape ``[batch, ...]``.
        name: Name in logs (default: the function's name).
        dtype: Dtype of the state (default float32).
        **kwargs: Passed to ``fn`` on every call.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name=str(name or getattr(fn, "__name__", "metric")), dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    @torch.no_grad()
    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        """Adds ``fn(y_true, y_pred)`` for a batch, weighted per example by ``sample_weight``."""
        super().update_state(self._fn(y_true, y_pred, **self._fn_kwargs), sample_weight)

    def get_config(self) -> dict[str, Any]:
        """Name, dtype, the function's keyword arguments (and its name, for a plain wrapper)."""
        config = {**super().get_config(), **self._fn_kwargs}
        if type(self) is MeanMetricWrapper:  # subclasses fix the function themselves
            config["fn"] = getattr(self._fn, "__name__", None)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        """The metric `get_config` describes; a plain wrapper's ``fn`` must name a phalanx function.

        Raises:
            ValueError: ``fn`` names no phalanx metric function.
        """
        if cls is not MeanMetricWrapper:
            return cls(**config)
        config = dict(config)
        name = config.pop("fn", None)
        if name not in FUNCTIONS:
            raise ValueError(
                f"MeanMetricWrapper.from_config can only rebuild phalanx's metric functions "
                f"{sorted(FUNCTIONS)}. Received: fn={name!r}. HINT: subclass phalanx.metrics.Metric "
                "(with get_config) for a metric that can be saved and rebuilt."
            )
        return cls(FUNCTIONS[name], **config)
