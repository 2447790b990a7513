"""What `Model.compile` resolves: the loss (possibly one per output) and the metrics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from phalanx.input.splitting import as_tensors, batch_size_of
from phalanx.losses.averaging import compute_average_loss, default_global_batch_size
from phalanx.losses.torch_loss import TorchLoss

__all__ = ["LossContainer", "ReplicaLoss", "identifier_config", "resolve_metrics"]


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


class ReplicaLoss(NamedTuple):
    """One replica's loss of a step and what the loss tracker adds for it.

    ``loss`` is the replica's share (the shares of all replicas sum to the loss of the global
    batch); the tracker adds ``tracked`` weighted by ``tracked_weight`` (None: one per
    example), so that it logs the batch-size-weighted mean of the steps' global losses.
    """

    loss: torch.Tensor
    tracked: torch.Tensor
    tracked_weight: torch.Tensor | None


class LossContainer:
    """Per-example losses of one or several outputs, weighted and summed.

    Args:
        loss: One loss (name, `phalanx.losses.Loss`, a PyTorch loss or callable) for a single
            output, or a list/dict of them matching tuple/dict outputs.
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
        if isinstance(self._losses, dict):
            every = list(self._losses.values())
        else:
            every = self._losses if isinstance(self._losses, list) else [self._losses]
        self._has_torch_loss = any(isinstance(loss, TorchLoss) for loss in every)

    def _items(self, y_true: Any, y_pred: Any) -> list[tuple[Any, Any, Any, Any]]:
        """``(weight, loss, y_true, y_pred)`` per output."""
        if isinstance(self._losses, dict):
            keys: list[Any] = list(self._losses)
            trues, preds = [y_true[k] for k in keys], [y_pred[k] for k in keys]
        elif isinstance(self._losses, list):
            if not isinstance(y_pred, (list, tuple)) or len(y_pred) != len(self._losses):
                raise ValueError(
                    f"compile got {len(self._losses)} losses but the model returned "
                    f"{type(y_pred).__name__}. HINT: return one output per loss."
                )
            keys, trues, preds = list(range(len(self._losses))), list(y_true), list(y_pred)
        else:
            return [(1.0, self._losses, y_true, y_pred)]
        weights = [1.0 if self._weights is None else self._weights[k] for k in keys]
        losses = [self._losses[k] for k in keys]
        return list(zip(weights, losses, trues, preds, strict=True))

    def per_example(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """The weighted per-example loss, shape ``[batch]``, summed over outputs."""
        items = self._items(y_true, y_pred)
        if len(items) == 1 and not isinstance(self._losses, (list, dict)):
            return _per_example(self._losses, y_true, y_pred, sample_weight)
        total: torch.Tensor | None = None
        for weight, loss, yt, yp in items:
            term = weight * _per_example(loss, yt, yp, sample_weight)
            total = term if total is None else total + term
        assert total is not None
        return total

    def tracked(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> tuple[torch.Tensor, Any]:
        """What the loss tracker adds for a batch, ``(values, weights)`` (replica context).

        The per-example losses for Keras losses; see `replica_loss` with a PyTorch loss.
        """
        if not self._has_torch_loss:
            return self.per_example(y_true, y_pred, sample_weight), None
        _, values, weights = self.replica_loss(y_true, y_pred, sample_weight)
        return values, weights

    def replica_loss(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> ReplicaLoss:
        """This replica's share of the step's loss, and the loss tracker's update (replica context).

        Keras losses: the per-example losses summed over the global batch size, the tracker
        counting every example. With a PyTorch loss among them, each loss's own reduction
        (`phalanx.losses.TorchLoss.replica_loss`) and the tracker weighted by batch size.
        """
        if not self._has_torch_loss:
            per_example = self.per_example(y_true, y_pred, sample_weight)
            return ReplicaLoss(compute_average_loss(per_example), per_example, None)
        total: torch.Tensor | None = None
        for weight, loss, yt, yp in self._items(y_true, y_pred):
            share = (
                loss.replica_loss(yt, yp, sample_weight)
                if isinstance(loss, TorchLoss)
                else compute_average_loss(_per_example(loss, yt, yp, sample_weight))
            )
            total = weight * share if total is None else total + weight * share
        assert total is not None
        return _batch_weighted(total, batch_size_of(as_tensors(y_pred)))


def _batch_weighted(share: torch.Tensor, local_batch: int) -> ReplicaLoss:
    """The tracker's update that adds ``share * global_batch`` over ``global_batch`` examples.

    Summed over the replicas of a step, the tracker's total grows by the step's loss times
    its global batch size and its count by that size: Keras' batch-size-weighted mean.
    """
    global_batch = default_global_batch_size(local_batch)
    scale = global_batch / local_batch if local_batch else 0.0
    weight = torch.tensor([float(local_batch)], device=share.device)
    return ReplicaLoss(share, (share.detach() * scale).reshape(1), weight)


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
