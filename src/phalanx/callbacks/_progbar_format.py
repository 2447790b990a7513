"""Keras' progress text, as pure functions of numbers (the display itself is in `_progbar`).

``70/70 [==============================] - 1s 12ms/step - loss: 0.2800 - accuracy: 0.9100``
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["bar", "format_eta", "format_logs", "format_time", "format_value", "progress_line", "summary_line"]


def format_value(value: Any) -> str:
    """Keras' number format: 4 decimals, or scientific when ``|v| <= 1e-3`` (zero included).

    Several numbers (e.g. precision at several thresholds) show their mean; text stays text.
    """
    if isinstance(value, str):
        return value
    try:
        number = float(torch.as_tensor(value, dtype=torch.float64).mean())
    except (TypeError, ValueError, RuntimeError):
        return str(value)
    return f"{number:.4f}" if abs(number) > 1e-3 else f"{number:.4e}"


def format_logs(logs: Iterable[tuple[str, Any]] | dict[str, Any] | None) -> str:
    """``"loss: 0.2800 - accuracy: 0.9100"``."""
    items = logs.items() if isinstance(logs, dict) else (logs or [])
    return " - ".join(f"{key}: {format_value(value)}" for key, value in items)


def format_time(seconds_per_unit: float, unit: str = "step") -> str:
    """``"12ms/step"`` (s, ms or us, as Keras)."""
    if seconds_per_unit >= 1 or seconds_per_unit == 0:
        return f"{seconds_per_unit:.0f}s/{unit}"
    if seconds_per_unit >= 1e-3:
        return f"{seconds_per_unit * 1e3:.0f}ms/{unit}"
    return f"{seconds_per_unit * 1e6:.0f}us/{unit}"


def format_eta(seconds: float) -> str:
    """``"1:02:03"``, ``"2:03"`` or ``"3s"``."""
    if seconds > 3600:
        return f"{int(seconds // 3600)}:{int(seconds % 3600 // 60):02d}:{int(seconds % 60):02d}"
    if seconds > 60:
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"
    return f"{int(seconds)}s"


def _count(current: int, target: int) -> str:
    return f"{current:{int(math.log10(target)) + 1}d}/{target}"


def bar(current: int, target: int | None, width: int = 30) -> str:
    """``" 35/70 [==============>...............]"``, or ``"     12/Unknown"`` without a target."""
    if not target or target <= 0:
        return f"{current:7d}/Unknown"
    filled = min(int(width * current / target), width)
    arrow = ""
    if filled > 0:
        arrow = "=" * (filled - 1) + (">" if current < target else "=")
    return f"{_count(current, target)} [{arrow}{'.' * (width - filled)}]"


def progress_line(
    current: int,
    target: int | None,
    elapsed: float,
    seconds_per_step: float,
    logs: Iterable[tuple[str, Any]] | dict[str, Any] | None,
    finalize: bool,
    width: int = 30,
) -> str:
    """The live line (verbose=1): the bar, then the ETA (running) or time and time per step."""
    if target and target > 0 and not finalize:
        timing = f"ETA: {format_eta(seconds_per_step * (target - current))}"
    else:
        timing = f"{elapsed:.0f}s {format_time(seconds_per_step)}"
    values = format_logs(logs)
    return f"{bar(current, target, width)} - {timing}" + (f" - {values}" if values else "")


def summary_line(
    current: int,
    target: int,
    elapsed: float,
    seconds_per_step: float,
    logs: Iterable[tuple[str, Any]] | dict[str, Any] | None,
) -> str:
    """The one line per epoch of verbose=2: ``"70/70 - 1s - 12ms/step - loss: 0.2800"``."""
    values = format_logs(logs)
    head = f"{_count(current, target)} - {elapsed:.0f}s - {format_time(seconds_per_step)}"
    return head + (f" - {values}" if values else "")
