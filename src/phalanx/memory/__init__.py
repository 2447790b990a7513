"""Memory per worker: what a strategy's worker will hold (`estimate_memory`) and what it held
(`PeakMeter`), and handing the C heap's free memory back to the system."""

from __future__ import annotations

from phalanx.memory.measure import (
    PeakMeter,
    map_large_allocations,
    peak_resident_bytes,
    release_free_memory,
    resident_bytes,
)

__all__ = ["PeakMeter", "map_large_allocations", "peak_resident_bytes", "release_free_memory", "resident_bytes"]
