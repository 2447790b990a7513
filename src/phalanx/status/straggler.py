"""Which worker the others wait for: the straggler of a synchronous job.

In synchronous training every worker's step ends in the same collectives, so step times even
out: a slow worker makes every step slow, on every worker. What differs is *where* the time
goes. The slow worker arrives last at each collective and finds the others there: it barely
waits. Every other worker arrives early and waits for it. So the straggler is the worker whose
**collective wait fraction** (the share of wall time spent waiting for collectives to finish,
over the last few seconds) is the lowest while every other worker's is clearly higher.

The rule names a worker only when it stands apart: its fraction is at least `GAP` (0.10: ten
percentage points of wall time) below every other running worker's. So a balanced job, whose
fractions differ by noise, names no one; two equally slow workers, neither of which the other
waits for, name no one; and a job of one worker has no straggler. A worker with no fraction
yet (it has not stepped) is left out.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["GAP", "find_straggler"]

GAP = 0.10


def find_straggler(wait_fractions: Mapping[str, float], gap: float = GAP) -> str | None:
    """The straggler among running workers, or None (see the module doc).

    Args:
        wait_fractions: Each running worker's collective wait fraction (0..1), by task name.
        gap: How far below every other worker's fraction the straggler's must be.

    Returns:
        The task name of the straggler, or None when no worker stands apart.
    """
    if len(wait_fractions) < 2:
        return None
    ranked = sorted(wait_fractions.items(), key=lambda item: (item[1], item[0]))
    (lowest, fraction), (_, next_lowest) = ranked[0], ranked[1]
    return lowest if next_lowest - fraction >= gap else None
