"""ProgbarLogger: Keras' progress display on tqdm, printed by the chief only."""

from __future__ import annotations

import sys
import time
from typing import Any

from phalanx.callbacks.callback import Callback, Logs

__all__ = ["ProgbarLogger", "format_logs"]


def _format_value(value: Any) -> str:
    value = float(value)
    return f"{value:.4e}" if value != 0 and abs(value) < 1e-3 else f"{value:.4f}"


def format_logs(logs: Logs) -> str:
    """``loss: 0.2800 - accuracy: 0.9100`` (Keras number format)."""
    return " - ".join(f"{k}: {_format_value(v)}" for k, v in (logs or {}).items())


def _is_chief(model: Any) -> bool:
    strategy = getattr(model, "strategy", None)
    return strategy is None or bool(strategy.is_chief)


class ProgbarLogger(Callback):
    """verbose=1: a live bar per epoch ``70/70 [====] - 1s 12ms/step - loss: ...``;
    verbose=2: one line per epoch; verbose=0: nothing. Only the chief prints."""

    def __init__(self, stream: Any = None) -> None:
        super().__init__()
        self._stream = stream
        self._bar: Any = None
        self._start = 0.0
        self._seen = 0

    @property
    def _verbose(self) -> int:
        return int(self.params.get("verbose", 1))

    def _active(self) -> bool:
        return self._verbose > 0 and _is_chief(self.model)

    def on_epoch_begin(self, epoch: int, logs: Logs = None) -> None:
        if not self._active():
            return
        out = self._stream or sys.stdout
        print(f"Epoch {epoch + 1}/{self.params.get('epochs', '?')}", file=out, flush=True)
        self._start, self._seen = time.perf_counter(), 0
        if self._verbose == 1:
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.params.get("steps"),
                file=out,
                ncols=100,
                leave=True,
                bar_format="{n_fmt}/{total_fmt} [{bar:30}] - {elapsed} - {desc}",
                ascii=".=",
            )

    def on_train_batch_end(self, batch: int, logs: Logs = None) -> None:
        self._seen += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_description_str(f"{self._per_step()} - {format_logs(logs)}", refresh=False)

    def _per_step(self) -> str:
        return f"{(time.perf_counter() - self._start) / max(self._seen, 1) * 1000:.0f}ms/step"

    def on_epoch_end(self, epoch: int, logs: Logs = None) -> None:
        if not self._active():
            return
        elapsed = time.perf_counter() - self._start
        line = f"{self._seen}/{self._seen} - {elapsed:.0f}s {self._per_step()} - {format_logs(logs)}"
        if self._bar is not None:
            self._bar.set_description_str(f"{self._per_step()} - {format_logs(logs)}", refresh=True)
            self._bar.close()
            self._bar = None
        else:
            print(line, file=self._stream or sys.stdout, flush=True)

    def on_train_end(self, logs: Logs = None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
