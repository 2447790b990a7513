"""Argument checks shared by the transformations; each error says rule, value and fix."""

from __future__ import annotations

from typing import Any

__all__ = ["require_callable", "require_int"]


def require_int(what: str, value: Any, minimum: int, hint: str = "") -> int:
    """``value`` as an int, checked to be >= ``minimum``.

    Raises:
        TypeError: ``value`` is not an int (bools are refused too).
        ValueError: ``value`` < ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int. Received: {value!r} ({type(value).__name__}).")
    if value < minimum:
        fix = f" HINT: {hint}" if hint else ""
        raise ValueError(f"{what} must be >= {minimum}. Received: {value}.{fix}")
    return value


def require_callable(what: str, value: Any) -> None:
    """Raises TypeError naming ``what`` when ``value`` cannot be called."""
    if not callable(value):
        raise TypeError(f"{what} must be callable. Received: {value!r} ({type(value).__name__}).")
