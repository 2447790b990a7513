"""Callback and CallbackList, with Keras' hook names so users' callbacks port directly.

Under several workers every worker runs every callback (a metric read inside one may be a
collective); only writes to files are chief-only, through `phalanx.checkpoint`'s rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["Callback", "CallbackList"]

Logs = dict[str, Any] | None


class Callback:
    """Base class: override the hooks you need. ``self.model`` and ``self.params`` are set by fit."""

    def __init__(self) -> None:
        self.model: Any = None
        self.params: dict[str, Any] = {}

    def set_model(self, model: Any) -> None:
        self.model = model

    def set_params(self, params: dict[str, Any]) -> None:
        self.params = params

    def on_train_begin(self, logs: Logs = None) -> None: ...
    def on_train_end(self, logs: Logs = None) -> None: ...
    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None: ...
    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None: ...
    def on_train_batch_begin(self, batch: int, logs: Logs = None) -> None: ...
    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None: ...
    def on_test_begin(self, logs: Logs = None) -> None: ...
    def on_test_end(self, logs: Logs = None) -> None: ...
    def on_test_batch_begin(self, batch: int, logs: Logs = None) -> None: ...
    def on_test_batch_end(self, batch: int, logs: Logs = None) -> None: ...
    def on_predict_begin(self, logs: Logs = None) -> None: ...
    def on_predict_end(self, logs: Logs = None) -> None: ...
    def on_predict_batch_begin(self, batch: int, logs: Logs = None) -> None: ...
    def on_predict_batch_end(self, batch: int, logs: Logs = None) -> None: ...


_HOOKS = [name for name in vars(Callback) if name.startswith("on_")]


class CallbackList(Callback):
    """Calls every hook on every callback, in order.

    Args:
        callbacks: The callbacks.
        add_history: Append a `History` (fit does; it becomes ``model.history``).
        add_progbar: Append a `ProgbarLogger` (printed by the chief only).
        model: The model the callbacks act on.
        **params: Run parameters (``verbose``, ``epochs``, ``steps``).
    """

    def __init__(
        self,
        callbacks: Iterable[Callback] | None = None,
        add_history: bool = False,
        add_progbar: bool = False,
        model: Any = None,
        **params: Any,
    ) -> None:
        super().__init__()
        from phalanx.callbacks.history import History
        from phalanx.callbacks.progbar import ProgbarLogger

        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callbacks must be phalanx.callbacks.Callback instances. Received: {cb!r}.")
        if add_progbar and not any(isinstance(c, ProgbarLogger) for c in self.callbacks):
            self.callbacks.append(ProgbarLogger())
        if add_history and not any(isinstance(c, History) for c in self.callbacks):
            self.callbacks.append(History())
        self.set_params(params)
        if model is not None:
            self.set_model(model)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        for cb in self.callbacks:
            cb.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        super().set_params(params)
        for cb in self.callbacks:
            cb.set_params(params)


def _dispatcher(name: str) -> Any:
    def dispatch(self: CallbackList, *args: Any, **kwargs: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, name)(*args, **kwargs)

    dispatch.__name__ = name
    return dispatch


for _name in _HOOKS:
    setattr(CallbackList, _name, _dispatcher(_name))
