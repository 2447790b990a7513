"""prefetch: a background thread produces elements ahead into a bounded buffer.

The thread holds no reference to the consumer's iterator, so dropping the iterator (or
calling ``close()``) stops it: the buffer is closed, the producer wakes, closes its source
and exits. An exception in the producer is raised in the consumer at the same position.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

from phalanx.data.op import Input, Op

__all__ = ["Prefetch", "PrefetchIterator"]


class _End:
    """The producer's last message: the source ended, or failed with ``error``."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class _Channel:
    """A bounded buffer between one producer and one consumer that either side can close."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, item: Any) -> bool:
        """Waits for room, then adds ``item``; False (nothing added) once closed."""
        with self._cond:
            while len(self._items) >= self._capacity and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def finish(self, end: _End) -> None:
        """Adds the producer's last message without waiting for room."""
        with self._cond:
            self._items.append(end)
            self._cond.notify_all()

    def get(self) -> Any:
        """Waits for the next item."""
        with self._cond:
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """Stops the producer at its next ``put``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _produce(source: Iterator[Any], channel: _Channel) -> None:
    try:
        for item in source:
            if not channel.put(item):
                return
        channel.finish(_End())
    except BaseException as error:  # handed to the consumer, raised there
        channel.finish(_End(error))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()  # stops nested prefetchers and thread pools in this thread


class PrefetchIterator(Iterator[Any]):
    """Elements of ``source`` produced ahead by a daemon thread, at most ``size`` waiting.

    Closing or dropping the iterator waits for the element being produced, if any, then the
    thread has ended.

    Args:
        source: The iterator to read on the background thread (it is closed there).
        size: How many elements may wait in the buffer (>= 1).
        thread_name: Name of the producer thread.
    """

    def __init__(self, source: Iterator[Any], size: int, thread_name: str = "phalanx-prefetch") -> None:
        self._channel = _Channel(size)
        self._done = False
        self._thread = threading.Thread(
            target=_produce, args=(source, self._channel), name=thread_name, daemon=True
        )
        self._thread.start()
        # The producer holds no reference to self, so dropping the iterator runs this: the
        # thread stops (and, dropped inside an outer producer, the outer one waits for it).
        stop = weakref.finalize(self, _stop, self._channel, self._thread)
        stop.atexit = False  # daemon threads need no stopping at interpreter exit

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._channel.get()
        if not isinstance(item, _End):
            return item
        self.close()
        if item.error is not None:
            raise item.error
        raise StopIteration

    def close(self) -> None:
        """Stops the producer and waits for its thread to end (at most one element's work)."""
        self._done = True
        _stop(self._channel, self._thread)


def _stop(channel: _Channel, thread: threading.Thread) -> None:
    channel.close()
    if thread is not threading.current_thread():
        thread.join()


class Prefetch(Op):
    """The input, produced ``buffer_size`` elements ahead on a background thread."""

    name = "prefetch"

    def __init__(self, buffer_size: int) -> None:
        self._size = buffer_size

    def iterate(self, inputs: Sequence[Input]) -> Iterator[Any]:
        if self._size == 0:
            return iter(inputs[0])
        return PrefetchIterator(iter(inputs[0]), self._size)

    def cardinality(self, inputs: Sequence[int]) -> int:
        return inputs[0]

    def shard_block_below(self, block: int) -> int | None:
        return block  # the same elements, read ahead

    def describe(self) -> str:
        return f"prefetch({self._size})"
