"""CallbackList: one object that calls each hook on every callback, in order."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from phalanx.callbacks.callback import Callback, Logs
from phalanx.callbacks.history import History
from phalanx.callbacks.progbar_logger import ProgbarLogger

__all__ = ["CallbackList"]

HOOKS = tuple(name for name in vars(Callback) if name.startswith("on_"))


class CallbackList(Callback):
    """Calls every hook on every callback, in the order given (History, then the progress bar, last).

    Args:
        callbacks: The callbacks.
        add_history: Append a `History` unless one is given (`fit` does; it becomes
            ``model.history``).
        add_progbar: Append a `ProgbarLogger` unless one is given (printed by the chief only).
        model: The model the callbacks act on.
        **params: Run parameters (``verbose``, ``epochs``, ``steps``).

    Raises:
        TypeError: An element is not a `Callback`.
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
        self.callbacks: list[Callback] = []
        for callback in callbacks or []:
            self.append(callback)
        if add_history and not any(isinstance(c, History) for c in self.callbacks):
            self.callbacks.append(History())
        if add_progbar and not any(isinstance(c, ProgbarLogger) for c in self.callbacks):
            self.callbacks.append(ProgbarLogger())
        self.set_params(params)
        if model is not None:
            self.set_model(model)

    def append(self, callback: Callback) -> None:
        """Adds a callback at the end (bind it with `set_model`/`set_params` afterwards).

        Raises:
            TypeError: ``callback`` is not a `Callback`.
        """
        if not isinstance(callback, Callback):
            raise TypeError(
                f"callbacks must be phalanx.callbacks.Callback instances. Received: {callback!r}. "
                "HINT: subclass phalanx.callbacks.Callback, or wrap functions in LambdaCallback."
            )
        self.callbacks.append(callback)

    def reads_batch_logs(self, mode: str = "train") -> bool:
        """Whether any of the callbacks reads its batch logs in ``mode`` ("train", "test")."""
        return any(callback.reads_batch_logs(mode) for callback in self.callbacks)

    def set_model(self, model: Any) -> None:
        """Binds every callback to ``model``."""
        super().set_model(model)
        for callback in self.callbacks:
            callback.set_model(model)

    def set_params(self, params: dict[str, Any]) -> None:
        """Gives every callback the run parameters."""
        super().set_params(params)
        for callback in self.callbacks:
            callback.set_params(params)


def _dispatch(name: str) -> Callable[..., None]:
    # Logs are always passed positionally, as Keras does: user hooks such as
    # ``lambda logs: ...`` or ``lambda epoch, logs: ...`` may require them.
    if "batch" in name or "epoch" in name:

        def dispatch(self: CallbackList, index: int, logs: Logs = None) -> None:
            for callback in self.callbacks:
                getattr(callback, name)(index, logs)

    else:

        def dispatch(self: CallbackList, logs: Logs = None) -> None:  # type: ignore[misc]
            for callback in self.callbacks:
                getattr(callback, name)(logs)

    dispatch.__name__ = dispatch.__qualname__ = name
    dispatch.__doc__ = f"Calls ``{name}`` on every callback."
    return dispatch


# Every hook forwards to each callback (the batch aliases too: a list forwards, never translates).
for _hook in HOOKS:
    setattr(CallbackList, _hook, _dispatch(_hook))
