"""What `Model.compile` resolves: the loss (possibly one per output) and the metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["LossContainer", "identifier_config", "resolve_metrics"]


def _losses_module() -> Any:
    from phalanx import losses

    return losses


def _metrics_module() -> Any:
    from phalanx import metrics

    return metrics


def identifier_config(obj: Any) -> Any:
    """A JSON-able way to rebuild a loss/metric: its string name, or class name + config."""
    if obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (list, tuple)):
        return [identifier_config(o) for o in obj]
    if isinstance(obj, dict):
        return {k: identifier_config(v) for k, v in obj.items()}
    get_config = getattr(obj, "get_config", None)
    if callable(get_config):
        return {"class_name": type(obj).__name__, "config": get_config()}
    return None  # a plain callable: cannot be saved


def rebuild(config: Any, module: Any) -> Any:
    """The inverse of `identifier_config` for one loss or metric module (phalanx.losses/metrics)."""
    if isinstance(config, dict) and "class_name" in config:
        cls = getattr(module, config["class_name"], None)
        if cls is None:
            raise ValueError(f"Unknown {module.__name__} class {config['class_name']!r} in a saved model.")
        return cls.from_config(config["config"]) if hasattr(cls, "from_config") else cls(**config["config"])
    if isinstance(config, list):
        return [rebuild(c, module) for c in config]
    return config


class LossContainer:
    """Per-example losses of one or several outputs, weighted and summed.

    Args:
        loss: One loss (name, `phalanx.losses.Loss` or callable) for a single output, or a
            list/dict of them matching tuple/dict outputs.
        loss_weights: Matching list/dict of scalar weights (default 1).

    Raises:
        ValueError: The structure of losses, weights and outputs do not match.
    """

    def __init__(self, loss: Any, loss_weights: Any = None) -> None:
        if loss is None:
            raise ValueError("compile needs a loss. Received: loss=None.")
        get = _losses_module().get
        if isinstance(loss, dict):
            self._losses: Any = {k: get(v) for k, v in loss.items()}
        elif isinstance(loss, (list, tuple)):
            self._losses = [get(v) for v in loss]
        else:
            self._losses = get(loss)
        self._weights = loss_weights
        if loss_weights is not None and not isinstance(loss_weights, (list, tuple, dict)):
            raise ValueError(f"loss_weights must be a list or dict. Received: {loss_weights!r}.")
        self.primary = self._losses if not isinstance(self._losses, (list, dict)) else None

    def per_example(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """The weighted per-example loss, shape ``[batch]``, summed over outputs."""
        if isinstance(self._losses, dict):
            items = [(k, self._losses[k], y_true[k], y_pred[k]) for k in self._losses]
        elif isinstance(self._losses, list):
            if not isinstance(y_pred, (list, tuple)) or len(y_pred) != len(self._losses):
                raise ValueError(
                    f"compile got {len(self._losses)} losses but the model returned "
                    f"{type(y_pred).__name__}. HINT: return one output per loss."
                )
            items = [(i, loss, y_true[i], y_pred[i]) for i, loss in enumerate(self._losses)]
        else:
            return _per_example(self._losses, y_true, y_pred, sample_weight)
        total: torch.Tensor | None = None
        for key, loss, yt, yp in items:
            weight = 1.0 if self._weights is None else self._weights[key]
            term = weight * _per_example(loss, yt, yp, sample_weight)
            total = term if total is None else total + term
        assert total is not None
        return total


def _per_example(loss: Any, y_true: Any, y_pred: Any, sample_weight: Any) -> torch.Tensor:
    per_example = getattr(loss, "per_example", None)
    if callable(per_example):
        return per_example(y_true, y_pred, sample_weight)
    values = torch.as_tensor(loss(y_true, y_pred))
    if values.dim() == 0:
        raise ValueError(
            "A plain loss function must return per-example losses (shape [batch]) so the "
            "distributed average uses the global batch. Received a scalar. HINT: use "
            "reduction='none' or a phalanx.losses class."
        )
    if values.dim() > 1:
        values = values.reshape(values.shape[0], -1).mean(dim=1)
    if sample_weight is not None:
        values = values * torch.as_tensor(sample_weight, dtype=values.dtype, device=values.device)
    return values


def resolve_metrics(metrics: Any, loss: Any) -> list[Any]:
    """Metric objects from compile's ``metrics`` (names, objects or callables)."""
    if metrics is None:
        return []
    if isinstance(metrics, dict):
        metrics = [m for v in metrics.values() for m in (v if isinstance(v, (list, tuple)) else [v])]
    if not isinstance(metrics, (list, tuple)):
        metrics = [metrics]
    get: Callable[..., Any] = _metrics_module().get
    return [get(m, loss=loss) for m in metrics]
