"""PyTorch's own losses in `Model.compile`: torch's argument order and reduction, TF's global batch.

A torch loss is called ``loss(prediction, target)`` and reduces the batch itself ('mean' by
default). `TorchLoss` calls it in that order with ``reduction='none'`` and reduces the
values itself, so that each replica's share sums (gradients are summed across replicas) to
the torch loss of the *global* batch:

* ``'mean'`` and ``'none'``: the sum of the replica's values over the global number of
  examples (`compute_average_loss`), the same numbers as the Keras loss with
  ``sum_over_batch_size``; ``'none'`` is averaged this way too, as compile needs a scalar.
* ``'mean'`` of ``cross_entropy``/``nll_loss`` with class-index targets: torch divides by the
  summed class weights of the targets that count (``weight``, ``ignore_index``), so each
  replica divides by that sum over the global batch (one scalar all-reduce per step).
* ``'sum'``: the replica's sum. ``'batchmean'`` (``kl_div``): the sum over the global batch size.

Which callables are torch losses is decided by identity (a `torch.nn.modules.loss._Loss`
instance, or a function of `TORCH_FUNCTIONAL_LOSSES`, possibly in a `functools.partial`),
never guessed from a signature.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from phalanx import context
from phalanx.losses._utils import broadcast_weights, mean_trailing, to_snake_case
from phalanx.losses.averaging import compute_average_loss

__all__ = ["TORCH_FUNCTIONAL_LOSSES", "TorchLoss", "is_torch_loss"]

# torch.nn.functional losses of (input, target, ..., reduction=...) whose unreduced values
# have the batch first. Three-input losses (margin_ranking_loss, triplet_margin_loss,
# cosine_embedding_loss, gaussian_nll_loss, ctc_loss) cannot be compile's (y_pred, y_true).
TORCH_FUNCTIONAL_LOSSES: frozenset[Callable[..., Any]] = frozenset(
    {
        F.binary_cross_entropy,
        F.binary_cross_entropy_with_logits,
        F.cross_entropy,
        F.hinge_embedding_loss,
        F.huber_loss,
        F.kl_div,
        F.l1_loss,
        F.mse_loss,
        F.multi_margin_loss,
        F.multilabel_margin_loss,
        F.multilabel_soft_margin_loss,
        F.nll_loss,
        F.poisson_nll_loss,
        F.smooth_l1_loss,
        F.soft_margin_loss,
    }
)
_THREE_INPUT_MODULES: tuple[type[nn.Module], ...] = (
    nn.CosineEmbeddingLoss,
    nn.CTCLoss,
    nn.GaussianNLLLoss,
    nn.MarginRankingLoss,
    nn.TripletMarginLoss,
    nn.TripletMarginWithDistanceLoss,
)
# Their 'mean' divides by the summed weights of the counted targets, not the element count.
_WEIGHTED_MEAN_FUNCTIONS = (F.cross_entropy, F.nll_loss)
_WEIGHTED_MEAN_MODULES: tuple[type[nn.Module], ...] = (nn.CrossEntropyLoss, nn.NLLLoss)
_REDUCTIONS = ("mean", "sum", "none", "batchmean")


def _functional_parts(obj: Any) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """``(function, keywords)`` when ``obj`` is a known functional loss or a partial of one."""
    if isinstance(obj, functools.partial) and obj.func in TORCH_FUNCTIONAL_LOSSES and not obj.args:
        return obj.func, dict(obj.keywords)
    try:
        known = obj in TORCH_FUNCTIONAL_LOSSES
    except TypeError:  # unhashable
        return None
    return (obj, {}) if known else None


def is_torch_loss(obj: Any) -> bool:
    """Whether ``obj`` is a torch.nn loss module or a known torch.nn.functional loss."""
    return isinstance(obj, nn.modules.loss._Loss) or _functional_parts(obj) is not None


class TorchLoss:
    """A torch.nn loss module or torch.nn.functional loss, as `Model.compile` uses it.

    Args:
        loss: A `torch.nn.modules.loss._Loss` (``torch.nn.CrossEntropyLoss()``...), a function
            of `TORCH_FUNCTIONAL_LOSSES` (``torch.nn.functional.cross_entropy``...), or a
            ``functools.partial`` of one with keyword arguments (``label_smoothing=0.1``).
        name: Name (default: the class or function name in snake case).

    Raises:
        ValueError: ``loss`` is none of those, takes three inputs, or has an unknown reduction.
    """

    def __init__(self, loss: Any, name: str | None = None) -> None:
        parts = _functional_parts(loss)
        if isinstance(loss, _THREE_INPUT_MODULES):
            raise ValueError(
                f"{type(loss).__name__} takes three inputs; compile's loss gets (prediction, target). "
                "HINT: compute it in a custom training loop (see docs/custom_training_loops.md)."
            )
        if isinstance(loss, nn.modules.loss._Loss):
            self._module: nn.Module | None = loss
            self.torch_reduction = str(loss.reduction)
            default_name = type(loss).__name__
        elif parts is not None:
            self._module = None
            fn, keywords = parts
            self.torch_reduction = str(keywords.pop("reduction", "mean"))
            self._fn, self._keywords = fn, keywords
            default_name = fn.__name__
        else:
            raise ValueError(
                "TorchLoss takes a torch.nn loss module or one of torch.nn.functional's losses "
                f"{sorted(f.__name__ for f in TORCH_FUNCTIONAL_LOSSES)}. Received: {loss!r}. HINT: "
                "wrap other functions as fn(y_true, y_pred) returning per-example losses."
            )
        if self.torch_reduction not in _REDUCTIONS:
            raise ValueError(
                f"A torch loss's reduction must be one of {list(_REDUCTIONS)}. Received: "
                f"{self.torch_reduction!r}."
            )
        self.loss = loss
        self.name = name or to_snake_case(default_name)

    def _weighted_mean(self) -> bool:
        if self.torch_reduction != "mean":
            return False
        if self._module is not None:
            return isinstance(self._module, _WEIGHTED_MEAN_MODULES)
        return self._fn in _WEIGHTED_MEAN_FUNCTIONS

    def unreduced(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        """The loss with ``reduction='none'``, called torch's way: ``(y_pred, y_true)``.

        Raises:
            ValueError: The loss gave a scalar (a custom module that ignores ``reduction``).
        """
        if self._module is not None:
            module: Any = copy.copy(self._module)  # shares buffers (weight) with the user's module
            module.reduction = "none"
            values = module(y_pred, y_true)
        else:
            values = self._fn(y_pred, y_true, reduction="none", **self._keywords)
        values = torch.as_tensor(values)
        if values.dim() == 0:
            raise ValueError(
                f"The torch loss {self.name!r} returned a scalar with reduction='none'; compile needs "
                "its values per example (shape [batch, ...]). HINT: make the module's forward honour "
                "self.reduction, as torch.nn's losses do."
            )
        return values

    def per_example(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """Per-example values ``[batch]`` (trailing axes averaged; summed for 'sum'/'batchmean')."""
        values = self._weighted_values(y_true, y_pred, sample_weight)
        if self.torch_reduction in ("sum", "batchmean"):
            return values.reshape(values.shape[0], -1).sum(dim=1) if values.dim() > 1 else values
        return mean_trailing(values)

    def _weighted_values(self, y_true: Any, y_pred: Any, sample_weight: Any) -> torch.Tensor:
        values = self.unreduced(y_true, y_pred)
        if sample_weight is None:
            return values
        return values * broadcast_weights(sample_weight, values)

    def replica_loss(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """This replica's share of the torch loss of the global batch (call inside ``strategy.run``).

        The shares of all replicas sum to the loss torch would give on the whole global batch
        (``sample_weight`` multiplies each example's values, the denominators are torch's).
        """
        if self._weighted_mean() and _class_targets(y_true):
            values = self._weighted_values(y_true, y_pred, sample_weight)
            return values.sum() / _global_sum(self._target_weights(y_true, y_pred))
        if self.torch_reduction == "sum":
            return self._weighted_values(y_true, y_pred, sample_weight).sum()
        return compute_average_loss(self.per_example(y_true, y_pred, sample_weight))

    def _target_weights(self, y_true: Any, y_pred: Any) -> torch.Tensor:
        """The summed weight of this replica's counted targets (torch's 'mean' denominator)."""
        target = torch.as_tensor(y_true)
        if self._module is not None:
            weight = getattr(self._module, "weight", None)
            ignore_index = int(getattr(self._module, "ignore_index", -100))
        else:
            weight = self._keywords.get("weight")
            ignore_index = int(self._keywords.get("ignore_index", -100))
        counted = target != ignore_index
        if weight is None:
            return counted.sum().to(torch.as_tensor(y_pred).dtype)
        picked = torch.as_tensor(weight)[torch.where(counted, target, torch.zeros_like(target))]
        return (picked * counted).sum()

    def __call__(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> torch.Tensor:
        """The torch loss of this batch alone, with its own reduction (Keras' argument order)."""
        values = self._weighted_values(y_true, y_pred, sample_weight)
        if self._weighted_mean() and _class_targets(y_true):
            return values.sum() / self._target_weights(y_true, y_pred)
        if self.torch_reduction == "none":
            return values
        if self.torch_reduction == "batchmean":
            return values.sum() / values.shape[0]
        return values.sum() if self.torch_reduction == "sum" else values.mean()

    def __repr__(self) -> str:
        return f"TorchLoss({self.loss!r}, reduction={self.torch_reduction!r})"


def _class_targets(y_true: Any) -> bool:
    target = torch.as_tensor(y_true)
    return not target.is_floating_point() and not target.is_complex()


def _global_sum(value: torch.Tensor) -> torch.Tensor:
    """``value`` summed over every replica of the step (itself outside a replica context)."""
    ctx = context.current_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return value
    return ctx.all_reduce("sum", value.detach())
