"""Shared timing helpers for the benchmarks: best-of-N wall time and a ratio line."""

from __future__ import annotations

import time
from collections.abc import Callable


def best_time(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """The best of ``repeats`` timings of ``inner`` calls, in seconds per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def report(case: str, ours: float, reference: float, unit: str = "us", ref_name: str = "reference") -> str:
    """One result line: times per step and the ratio reference/ours (>1 means phalanx is faster)."""
    scale = 1e6 if unit == "us" else 1e3
    ratio = reference / ours
    line = (
        f"{case:<44} phalanx {ours * scale:10.1f} {unit}   {ref_name} {reference * scale:10.1f} {unit}"
        f"   time ratio (ours/ref) {ours / reference:6.3f}   speed ratio {ratio:6.3f}"
    )
    print(line, flush=True)
    return line
