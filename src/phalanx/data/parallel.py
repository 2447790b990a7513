"""Parallel calls: AUTOTUNE and an order-preserving thread-pool map."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["AUTOTUNE", "parallel_map", "resolve_parallelism"]

AUTOTUNE = -1  # tf.data.AUTOTUNE: let phalanx pick the degree of parallelism


def resolve_parallelism(what: str, value: int | None, hint: str = "use None for sequential calls.") -> int:
    """How many threads ``value`` asks for: None -> 1, AUTOTUNE -> the CPU count.

    Raises:
        TypeError: ``value`` is not an int or None.
        ValueError: ``value`` is 0 or below -1.
    """
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, AUTOTUNE or None. Received: {value!r}.")
    if value == AUTOTUNE:
        return os.cpu_count() or 1
    if value < 1:
        raise ValueError(
            f"{what} must be >= 1, or phalanx.data.AUTOTUNE (-1). Received: {value}. HINT: {hint}"
        )
    return value


def parallel_map(call: Callable[[Any], Any], source: Iterator[Any], workers: int) -> Iterator[Any]:
    """``call`` over ``source`` on ``workers`` threads, results in input order.

    At most ``2 * workers`` calls are in flight. An exception in ``call`` is raised here, at
    its element's position. Closing the generator cancels queued calls and joins the threads.
    """
    pool = ThreadPoolExecutor(workers, thread_name_prefix="phalanx-map")
    pending: deque[Future[Any]] = deque()
    try:
        for element in source:
            pending.append(pool.submit(call, element))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
