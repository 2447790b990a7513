"""The built-in losses: a function wrapper and the Keras classes around the loss functions."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from phalanx.losses import functions
from phalanx.losses._utils import mean_trailing
from phalanx.losses.loss import Loss

__all__ = [
    "BinaryCrossentropy",
    "CategoricalCrossentropy",
    "Huber",
    "LossFunctionWrapper",
    "MeanAbsoluteError",
    "MeanSquaredError",
    "SparseCategoricalCrossentropy",
]

_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {
    name: getattr(functions, name) for name in functions.__all__
}


class LossFunctionWrapper(Loss):
    """A Loss around ``fn(y_true, y_pred, **kwargs)`` returning per-example (or per-element) values.

    Args:
        fn: The loss function; must not reduce over the batch.
        reduction: See `Loss`.
        name: Name (default: the function's name).
        dtype: See `Loss`.
        **kwargs: Passed to ``fn`` on every call.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        reduction: str | None = "sum_over_batch_size",
        name: str | None = None,
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name or getattr(fn, "__name__", "loss"), reduction, dtype)
        self.fn = fn
        self._fn_kwargs = kwargs

    def _unreduced(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(self.fn(y_true, y_pred, **self._fn_kwargs))

    def call(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        """Per-example losses, shape ``[batch]``."""
        return mean_trailing(self._unreduced(y_true, y_pred))

    def get_config(self) -> dict[str, Any]:
        """Name, reduction, dtype, the function's name and its keyword arguments."""
        return {**super().get_config(), "fn": getattr(self.fn, "__name__", None), **self._fn_kwargs}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        """Rebuilds a wrapper around one of phalanx's loss functions, named by ``fn``.

        Raises:
            ValueError: ``fn`` does not name a phalanx loss function.
        """
        config = dict(config)
        fn = _FUNCTIONS.get(str(config.pop("fn", None)))
        if fn is None:
            raise ValueError(
                f"LossFunctionWrapper.from_config can only rebuild phalanx's loss functions "
                f"{sorted(_FUNCTIONS)}. Received: fn={config.get('fn')!r}. HINT: subclass "
                "phalanx.losses.Loss (with get_config) for a loss that can be saved and rebuilt."
            )
        return cls(fn, **config)


class _Builtin(LossFunctionWrapper):
    """A wrapper whose function is fixed by the class: its config is its constructor's."""

    def get_config(self) -> dict[str, Any]:
        return {**Loss.get_config(self), **self._fn_kwargs}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Loss:
        return cls(**config)


# How many calls of a cross-entropy loss look at y_pred for logits: each look reads one bool
# back from the device, so it is done while training starts and then no more.
LOGITS_CHECKED_CALLS = 10
_warn_lock = threading.Lock()  # module-level: a loss object stays picklable for ps workers


class _ProbabilityCrossentropy(_Builtin):
    """A cross-entropy on probabilities unless ``from_logits``: warns once if y_pred looks like logits.

    Keras' default is ``from_logits=False`` and phalanx keeps it (a model ported from Keras
    ends with a softmax or sigmoid). A torch model usually returns logits; with the default
    the loss would clip them to [1e-7, 1 - 1e-7] and train badly without an error. The first
    `LOGITS_CHECKED_CALLS` calls therefore look at y_pred, and the first one whose values
    are clearly not probabilities warns (once per loss object) with the fix.
    """

    _rows_sum_to_one = False  # the categorical losses: each row of probabilities sums to 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls_checked = 0
        self._warned_logits = False

    def _unreduced(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor:
        if not self._fn_kwargs.get("from_logits") and self._calls_checked < LOGITS_CHECKED_CALLS:
            self._check_probabilities(y_pred)
        return super()._unreduced(y_true, y_pred)

    def _check_probabilities(self, y_pred: torch.Tensor) -> None:
        if torch.compiler.is_compiling() or y_pred.numel() == 0:
            return  # a graph break per step would cost more than the hint is worth
        self._calls_checked += 1
        pred = y_pred.detach()
        clearly_logits = ((pred < 0) | (pred > 1)).any()
        if self._rows_sum_to_one and pred.dim() > 0:
            clearly_logits = clearly_logits | ((pred.sum(dim=-1) - 1).abs() > 1e-3).any()
        if not bool(clearly_logits):
            return
        with _warn_lock:
            if self._warned_logits:
                return
            self._warned_logits = True
        rule = "outside [0, 1] or rows not summing to 1" if self._rows_sum_to_one else "outside [0, 1]"
        warnings.warn(
            f"{type(self).__name__} (from_logits=False, Keras' default) received y_pred values {rule}: "
            "they look like logits, and the loss treats them as probabilities (clipped), so training "
            f"goes wrong silently. HINT: pass from_logits=True, e.g. loss=phalanx.losses."
            f"{type(self).__name__}(from_logits=True), or end the model with a "
            f"{'softmax' if self._rows_sum_to_one else 'sigmoid'}.",
            UserWarning,
            stacklevel=2,
        )


class MeanSquaredError(_Builtin):
    """Mean of squared errors ("mse")."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str = "mean_squared_error",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(functions.mean_squared_error, reduction, name, dtype)


class MeanAbsoluteError(_Builtin):
    """Mean of absolute errors ("mae")."""

    def __init__(
        self,
        reduction: str | None = "sum_over_batch_size",
        name: str = "mean_absolute_error",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(functions.mean_absolute_error, reduction, name, dtype)


class Huber(_Builtin):
    """Huber loss: quadratic for errors up to ``delta``, linear beyond.

    Raises:
        ValueError: ``delta`` is not positive.
    """

    def __init__(
        self,
        delta: float = 1.0,
        reduction: str | None = "sum_over_batch_size",
        name: str = "huber_loss",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        if not delta > 0:
            raise ValueError(f"Huber's delta must be > 0. Received: delta={delta}. HINT: 1.0 is the default.")
        super().__init__(functions.huber, reduction, name, dtype, delta=delta)


class BinaryCrossentropy(_ProbabilityCrossentropy):
    """Binary cross-entropy for 0/1 targets; ``from_logits=True`` for raw scores.

    Warns once if ``from_logits=False`` and y_pred is clearly not probabilities.
    """

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        reduction: str | None = "sum_over_batch_size",
        name: str = "binary_crossentropy",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        functions._check_label_smoothing(label_smoothing)
        super().__init__(
            functions.binary_crossentropy,
            reduction,
            name,
            dtype,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
        )


class CategoricalCrossentropy(_ProbabilityCrossentropy):
    """Cross-entropy against one-hot targets; ``from_logits=True`` for raw scores.

    Warns once if ``from_logits=False`` and y_pred's rows are clearly not probabilities.
    """

    _rows_sum_to_one = True

    def __init__(
        self,
        from_logits: bool = False,
        label_smoothing: float = 0.0,
        reduction: str | None = "sum_over_batch_size",
        name: str = "categorical_crossentropy",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        functions._check_label_smoothing(label_smoothing)
        super().__init__(
            functions.categorical_crossentropy,
            reduction,
            name,
            dtype,
            from_logits=from_logits,
            label_smoothing=label_smoothing,
        )


class SparseCategoricalCrossentropy(_ProbabilityCrossentropy):
    """Cross-entropy against integer class ids; ``from_logits=True`` for raw scores.

    Warns once if ``from_logits=False`` and y_pred's rows are clearly not probabilities.
    Targets equal to ``ignore_class`` count neither in the sum nor in the average (Keras'
    mask: under "sum_over_batch_size" the mean is over the other entries of the batch).
    """

    def __init__(
        self,
        from_logits: bool = False,
        ignore_class: int | None = None,
        reduction: str | None = "sum_over_batch_size",
        name: str = "sparse_categorical_crossentropy",
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(
            functions.sparse_categorical_crossentropy,
            reduction,
            name,
            dtype,
            from_logits=from_logits,
            ignore_class=ignore_class,
        )
        self.ignore_class = ignore_class

    _rows_sum_to_one = True

    def _mask(self, y_true: Any, y_pred: torch.Tensor) -> torch.Tensor | None:
        if self.ignore_class is None:
            return None
        true = torch.as_tensor(y_true, device=y_pred.device)
        if true.dim() == y_pred.dim() > 0 and true.shape[-1] == 1:
            true = true.squeeze(-1)
        return true != self.ignore_class
