"""prefetch: order, errors raised in the consumer, and no thread outliving its iterator."""

from __future__ import annotations

import threading
import time

import pytest

from phalanx.data import AUTOTUNE, Dataset


def values(ds: Dataset) -> list[int]:
    return [int(e) for e in ds]


def _prefetch_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("phalanx-")]


def test_prefetch_keeps_order_and_is_reiterable():
    ds = Dataset.range(100).prefetch(4)
    assert values(ds) == values(ds) == list(range(100))
    assert values(Dataset.range(5).prefetch(AUTOTUNE)) == list(range(5))
    assert values(Dataset.range(5).prefetch(0)) == list(range(5))
    assert values(Dataset.range(3).prefetch(1).prefetch(1)) == [0, 1, 2]


def test_prefetch_produces_ahead_on_one_thread():
    produced = []

    def record(v):
        produced.append(threading.current_thread().name)
        return v

    it = iter(Dataset.range(10).map(record).prefetch(3))
    assert int(next(it)) == 0
    deadline = time.monotonic() + 5
    while len(produced) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert len(produced) == 5  # 1 consumed, 3 buffered, 1 waiting for room: then it blocks
    assert set(produced) == {"phalanx-prefetch"}
    it.close()


def test_producer_errors_are_raised_in_the_consumer():
    def fail_at_3(v):
        if int(v) == 3:
            raise RuntimeError("bad element 3")
        return v

    it = iter(Dataset.range(10).map(fail_at_3).prefetch(2))
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="bad element 3"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)


def test_thread_ends_when_the_iterator_is_dropped(settled_thread_count):
    before = threading.active_count()
    it = iter(Dataset.range(1_000_000).prefetch(2))
    next(it)
    assert threading.active_count() == before + 1
    del it
    assert settled_thread_count(before) == before


def test_thread_ends_when_a_loop_breaks(settled_thread_count):
    before = threading.active_count()
    for v in Dataset.range(1_000_000).map(lambda v: v).prefetch(2).batch(4):
        if int(v[0]) >= 8:
            break
    del v
    assert settled_thread_count(before) == before


def test_close_joins_the_thread_and_nested_prefetchers():
    before = threading.active_count()
    it = iter(Dataset.range(1_000_000).prefetch(2).map(lambda v: v, num_parallel_calls=2).prefetch(2))
    next(it)
    it.close()
    assert threading.active_count() == before, _prefetch_threads()
    with pytest.raises(StopIteration):
        next(it)


def test_exhaustion_ends_the_thread():
    before = threading.active_count()
    it = iter(Dataset.range(3).prefetch(8))
    assert [int(v) for v in it] == [0, 1, 2]
    assert threading.active_count() == before


def test_prefetch_errors():
    with pytest.raises(ValueError, match="prefetch's buffer_size must be >= 0. Received: -5. HINT: use"):
        Dataset.range(2).prefetch(-5)
    with pytest.raises(TypeError, match="prefetch's buffer_size must be an int"):
        Dataset.range(2).prefetch(None)
