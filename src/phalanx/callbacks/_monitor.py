"""Which direction of a monitored log value is better (Keras' mode='auto' rule)."""

from __future__ import annotations

import operator
from collections.abc import Callable

__all__ = ["improvement"]


def improvement(monitor: str, mode: str) -> tuple[Callable[[float, float], bool], float]:
    """(is_better(current, best), initial best) for ``mode`` in auto/min/max.

    Raises:
        ValueError: Unknown mode.
    """
    if mode not in ("auto", "min", "max"):
        raise ValueError(f"mode must be 'auto', 'min' or 'max'. Received: {mode!r}.")
    if mode == "auto":
        name = monitor.removeprefix("val_")
        mode = (
            "max" if ("acc" in name or name.startswith("auc") or name in ("precision", "recall")) else "min"
        )
    if mode == "max":
        return operator.gt, float("-inf")
    return operator.lt, float("inf")
