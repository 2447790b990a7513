"""CheckpointManager's ``checkpoint_interval``: save only every so many steps (TF's rule)."""

from __future__ import annotations

from typing import Any

__all__ = ["SaveInterval"]


class SaveInterval:
    """Whether a save is due: the step counter moved ``interval`` steps since the last save.

    Args:
        step_counter: Read with ``int()`` (a `Counter`, an int tensor, an int).
        interval: Steps between saves (positive), or None: every save is due.

    Raises:
        ValueError: ``interval`` without ``step_counter``, or not a positive integer.
    """

    def __init__(self, step_counter: Any, interval: int | None) -> None:
        if interval is not None:
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise ValueError(
                    f"checkpoint_interval must be a positive integer or None. Received: {interval!r}."
                )
            if step_counter is None:
                raise ValueError(
                    "checkpoint_interval needs a step_counter to count steps with (as in TensorFlow). "
                    "HINT: CheckpointManager(..., step_counter=phalanx.checkpoint.Counter(), "
                    "checkpoint_interval=100)."
                )
        self._counter = step_counter
        self.interval = interval
        self._last: int | None = None

    def due(self) -> bool:
        """Whether `CheckpointManager.save` should write now."""
        if self.interval is None or self._last is None:
            return True
        return int(self._counter) >= self._last + self.interval

    def saved(self) -> None:
        """Notes the step of the save just made."""
        if self.interval is not None:
            self._last = int(self._counter)
