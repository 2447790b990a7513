"""Memory per worker: what a strategy's worker will hold (`estimate_memory`) and what it held
(`PeakMeter`), and handing the C heap's free memory back to the system."""

from __future__ import annotations

from phalanx.memory.estimate import (
    STRATEGY_KINDS,
    MemoryEstimate,
    MemoryPlan,
    activation_bytes,
    estimate_memory,
    optimizer_factors,
    plan_memory,
)
from phalanx.memory.measure import (
    PeakMeter,
    map_large_allocations,
    peak_resident_bytes,
    release_free_memory,
    resident_bytes,
)

__all__ = [
    "STRATEGY_KINDS",
    "MemoryEstimate",
    "MemoryPlan",
    "PeakMeter",
    "activation_bytes",
    "estimate_memory",
    "map_large_allocations",
    "optimizer_factors",
    "peak_resident_bytes",
    "plan_memory",
    "release_free_memory",
    "resident_bytes",
]
