"""Data-test hygiene: no test may leave a thread behind (prefetch, parallel map, interleave)."""

from __future__ import annotations

import gc
import threading
import time

import pytest


def wait_for_threads(count: int, timeout: float = 5.0) -> int:
    """``threading.active_count()`` once it is back to ``count`` (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > count and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return threading.active_count()


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    before = threading.active_count()
    yield
    assert wait_for_threads(before) == before, [t.name for t in threading.enumerate()]


@pytest.fixture
def settled_thread_count():
    """``wait_for_threads``: the thread count once background threads have ended."""
    return wait_for_threads
