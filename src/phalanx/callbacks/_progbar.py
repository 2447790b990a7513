"""Progbar: one Keras progress display (an epoch, an evaluation or a prediction), drawn with tqdm."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from phalanx.callbacks._progbar_format import progress_line, summary_line

__all__ = ["Progbar"]


def dynamic_display() -> bool:
    """Whether stdout redraws a line in place (a terminal or a notebook), as Keras checks."""
    return bool(getattr(sys.stdout, "isatty", lambda: False)()) or "ipykernel" in sys.modules


class _Line(tqdm):  # type: ignore[type-arg,misc]
    """A tqdm that only redraws one line of text (no monitor thread per process)."""

    monitor_interval = 0


class Progbar:
    """Keras' Progbar: verbose=1 redraws a live line, verbose=2 prints one line when finalized.

    When stdout is not a terminal (a log file, a launcher's pipe), verbose=1 prints only the
    finished line of each bar instead of a stream of carriage-return frames.

    Args:
        target: Total number of steps, or None when unknown (infinite or unsized data).
        verbose: 0 silent, 1 live bar, 2 one line at the end.
        width: Width of the bar in characters.
        interval: Least seconds between two redraws of the live line.
        unit_name: Name of a step in the time per step.
        clock: Time source (seconds).
    """

    def __init__(
        self,
        target: int | None,
        verbose: int = 1,
        width: int = 30,
        interval: float = 0.05,
        unit_name: str = "step",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target, self.verbose, self.width = target, verbose, width
        self.interval, self.unit_name, self._clock = interval, unit_name, clock
        self._start = clock()
        self._last_update = float("-inf")
        self._time_after_first_step: float | None = None
        self._line: Any = None
        self._dynamic = dynamic_display()

    def update(self, current: int, logs: dict[str, Any] | None = None, finalize: bool = False) -> None:
        """Shows progress at step ``current`` (1-based) with the running ``logs``."""
        now = self._clock()
        per_step = self._seconds_per_step(current, now)
        live = self._dynamic and now - self._last_update >= self.interval
        if self.verbose == 1 and (finalize or live):
            self._draw(
                progress_line(current, self.target, now - self._start, per_step, logs, finalize, self.width)
            )
            if finalize:
                self.close()
        elif self.verbose == 2 and finalize and self.target:
            print(
                summary_line(current, self.target, now - self._start, per_step, logs),
                file=sys.stdout,
                flush=True,
            )
        self._last_update = now

    def _seconds_per_step(self, current: int, now: float) -> float:
        # Keras leaves the first step out once there are more: it includes warm-up work.
        if not current:
            return 0.0
        if self._time_after_first_step is not None and current > 1:
            per_step = (now - self._time_after_first_step) / (current - 1)
        else:
            per_step = (now - self._start) / current
        if current == 1:
            self._time_after_first_step = now
        return per_step

    def _draw(self, text: str) -> None:
        if not self._dynamic:  # only finished lines get here
            print(text, file=sys.stdout, flush=True)
            return
        if self._line is None:
            self._line = _Line(file=sys.stdout, bar_format="{desc}", leave=True, mininterval=0)
        self._line.set_description_str(text, refresh=True)

    def close(self) -> None:
        """Ends the live line (a new line follows it)."""
        if self._line is not None:
            self._line.close()
            self._line = None
