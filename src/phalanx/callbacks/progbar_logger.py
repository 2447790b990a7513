"""ProgbarLogger: Keras' progress display for fit, evaluate and predict, printed by the chief only."""

from __future__ import annotations

from typing import Any

from phalanx.callbacks._progbar import Progbar
from phalanx.callbacks.callback import Callback, Logs, batch_ends
from phalanx.strategies.workers.distributed_files import is_chief, strategy_of

__all__ = ["ProgbarLogger"]


class ProgbarLogger(Callback):
    """Prints progress: verbose=1 a live bar per epoch, verbose=2 one line per epoch, 0 nothing.

    ``70/70 [==============================] - 1s 12ms/step - loss: 0.2800 - accuracy: 0.9100``

    Every worker runs it, but only the chief (``model.strategy.is_chief``; a model without a
    strategy counts as chief) prints. Each epoch opens with ``Epoch i/n`` (tf.keras prints it
    for one epoch too; Keras 3 only for several). With an unknown number of steps the bar shows
    ``12/Unknown`` and learns the epoch's length when it ends. Inside `fit`, validation is
    silent, as in Keras.
    """

    def __init__(self) -> None:
        super().__init__()
        self.verbose, self.epochs = 1, 1
        self.target: int | None = None
        self.seen = 0
        self.progbar: Progbar | None = None
        self._called_in_fit = False

    def set_params(self, params: dict[str, Any]) -> None:
        """Reads ``verbose`` ("auto" is 1), ``epochs`` and ``steps``."""
        super().set_params(params)
        verbose = params.get("verbose", 1)
        self.verbose = 1 if verbose == "auto" else int(verbose)
        self.epochs = params.get("epochs", 1)
        self.target = params.get("steps")

    def _start(self) -> None:
        self.close()
        self.seen = 0
        verbose = self.verbose if is_chief(strategy_of(self.model)) else 0
        self.progbar = Progbar(self.target, verbose=verbose)

    def _update(self, batch: int, logs: Logs) -> None:
        if self.progbar is None:
            self._start()
        assert self.progbar is not None
        self.seen = batch + 1
        if self.progbar.verbose == 1:
            self.progbar.update(self.seen, logs, finalize=False)

    def _finalize(self, logs: Logs) -> None:
        if self.progbar is None:
            self._start()
        assert self.progbar is not None
        if self.target is None:
            self.target = self.progbar.target = self.seen  # learnt: later epochs show a bar
        # The steps that ran (an epoch stopped early shows where it stopped).
        self.progbar.update(self.seen or self.progbar.target or 0, logs, finalize=True)
        self.progbar = None

    def close(self) -> None:
        """Ends a live line left open (an interrupted epoch)."""
        if self.progbar is not None:
            self.progbar.close()
            self.progbar = None

    def on_train_begin(self, logs: Logs = None) -> None:
        self._called_in_fit = True

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        self._start()
        if self.progbar is not None and self.progbar.verbose:
            print(f"Epoch {epoch + 1}/{self.epochs}", flush=True)

    def reads_batch_logs(self, mode: str = "train") -> bool:
        """The live bar (verbose=1) shows every step's logs (an evaluation's only outside
        `fit`); one line per epoch reads none."""
        batch_ends(mode)  # raises for another mode
        return self.verbose == 1 and (mode == "train" or not self._called_in_fit)

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._update(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        self._finalize(logs)

    def on_train_end(self, logs: Logs = None) -> None:
        self.close()
        self._called_in_fit = False

    def on_test_begin(self, logs: Logs = None) -> None:
        if not self._called_in_fit:
            self._start()

    def on_test_batch_end(self, batch: int, logs: Logs = None) -> None:
        if not self._called_in_fit:
            self._update(batch, logs)

    def on_test_end(self, logs: Logs = None) -> None:
        if not self._called_in_fit:
            self._finalize(logs)

    def on_predict_begin(self, logs: Logs = None) -> None:
        self._start()

    def on_predict_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._update(batch, None)  # prediction outputs are not logs

    def on_predict_end(self, logs: Logs = None) -> None:
        self._finalize(None)
