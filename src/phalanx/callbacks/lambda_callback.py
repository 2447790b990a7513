"""LambdaCallback: a callback made of plain functions."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.callbacks.callback import Callback

__all__ = ["LambdaCallback"]

_HOOKS = frozenset(name for name in vars(Callback) if name.startswith("on_"))


class LambdaCallback(Callback):
    """Calls the given functions at their hooks: ``LambdaCallback(on_epoch_end=lambda e, logs: ...)``.

    Epoch hooks get ``(epoch, logs)``, batch hooks ``(batch, logs)``, begin/end hooks ``(logs)``.

    Args:
        on_epoch_begin, on_epoch_end, on_train_begin, on_train_end, on_train_batch_begin,
        on_train_batch_end: Functions for those hooks.
        **kwargs: Functions for any other hook (``on_test_end=...``, ``on_predict_batch_end=...``).

    Raises:
        ValueError: A keyword that is not a hook name.
    """

    def __init__(
        self,
        on_epoch_begin: Callable[..., Any] | None = None,
        on_epoch_end: Callable[..., Any] | None = None,
        on_train_begin: Callable[..., Any] | None = None,
        on_train_end: Callable[..., Any] | None = None,
        on_train_batch_begin: Callable[..., Any] | None = None,
        on_train_batch_end: Callable[..., Any] | None = None,
        **kwargs: Callable[..., Any],
    ) -> None:
        super().__init__()
        unknown = sorted(set(kwargs) - _HOOKS)
        if unknown:
            raise ValueError(
                f"LambdaCallback got unknown hook names {unknown}. Known: {sorted(_HOOKS)}. "
                "HINT: hooks are Keras' names, e.g. on_epoch_end=lambda epoch, logs: ..."
            )
        hooks = {
            "on_epoch_begin": on_epoch_begin,
            "on_epoch_end": on_epoch_end,
            "on_train_begin": on_train_begin,
            "on_train_end": on_train_end,
            "on_train_batch_begin": on_train_batch_begin,
            "on_train_batch_end": on_train_batch_end,
            **kwargs,
        }
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)
