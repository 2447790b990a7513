"""The persistent threads that execute replicas 1..n-1 (replica 0 runs in the caller)."""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["ReplicaThreads", "ReplicaWatch", "thread_modes"]


class ReplicaWatch(Protocol):
    """Told when each replica's function starts and returns (the meeting points' stall
    inspector, `phalanx.strategies.replicas.rendezvous.ReplicaRendezvous`); ``returned`` may raise."""

    def started(self, index: int) -> None: ...

    def returned(self, index: int) -> None: ...


def thread_modes() -> Callable[[], contextlib.AbstractContextManager[Any]]:
    """The caller's thread-local modes (inference mode, autocast), to enter on replica threads."""
    inference = torch.is_inference_mode_enabled()
    autocast = [
        (kind, torch.get_autocast_dtype(kind)) for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)
    ]
    if not inference and not autocast:
        return contextlib.nullcontext

    def enter() -> contextlib.AbstractContextManager[Any]:
        stack = contextlib.ExitStack()
        if inference:
            stack.enter_context(torch.inference_mode())
        for kind, dtype in autocast:
            stack.enter_context(torch.autocast(kind, dtype=dtype))
        return stack

    return enter


_STOP = object()


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        job()
        del job  # the job holds the strategy; holding it here would keep it alive


class ReplicaThreads:
    """Runs one callable per replica, concurrently, and collects results or the first error.

    Threads start on first use and stop when this object is garbage-collected or `close`d.

    Args:
        num_replicas: Replicas per call; replica 0 runs on the calling thread.
        name: Prefix of the thread names.
    """

    def __init__(self, num_replicas: int, name: str) -> None:
        self._n = num_replicas
        self._name = name
        self._queues: list[queue.SimpleQueue[Any]] = []
        self._threads: list[threading.Thread] = []
        self._finalizer: weakref.finalize | None = None

    def _start(self) -> None:
        for i in range(1, self._n):
            jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
            thread = threading.Thread(
                target=_serve, args=(jobs,), name=f"{self._name}-replica-{i}", daemon=True
            )
            thread.start()
            self._queues.append(jobs)
            self._threads.append(thread)
        self._finalizer = weakref.finalize(self, _stop_all, list(self._queues), list(self._threads))

    def run(
        self,
        fn: Callable[[int], Any],
        on_error: Callable[[BaseException], None],
        watch: ReplicaWatch | None = None,
    ) -> list[Any]:
        """Calls ``fn(i)`` for every replica i and waits for all of them.

        ``on_error`` is called as soon as one replica fails, so it can wake the others;
        ``watch`` learns when each replica's ``fn`` starts and returns (its error, if it
        raises one, is that replica's: a replica that returned while others wait). With
        several replicas each thread (the caller's too, for the call) gets its share of the
        caller's intra-op threads.

        Returns:
            The results in replica order.

        Raises:
            BaseException: The first failure (by time), after every replica has returned.
        """
        if self._n == 1:
            return [fn(0)]
        if not self._queues:
            self._start()
        # Replicas share the cores: each replica thread gets its share of the intra-op threads
        # (torch's setting is per OS thread), so 2 replicas x 2 threads do not fight over 2 cores.
        caller_threads = torch.get_num_threads()
        try:
            return self._dispatch(_watched(fn, watch), on_error, max(1, caller_threads // self._n))
        finally:
            if torch.get_num_threads() != caller_threads:
                torch.set_num_threads(caller_threads)

    def _dispatch(
        self, fn: Callable[[int], Any], on_error: Callable[[BaseException], None], share: int
    ) -> list[Any]:
        """`run` for several replicas, each thread limited to ``share`` intra-op threads."""
        results: list[Any] = [None] * self._n
        errors: list[tuple[int, BaseException]] = []
        done = threading.Semaphore(0)
        lock = threading.Lock()

        def job(i: int) -> None:
            try:
                if torch.get_num_threads() != share:
                    torch.set_num_threads(share)
                results[i] = fn(i)
            except BaseException as exc:
                with lock:
                    errors.append((i, exc))
                on_error(exc)
            finally:
                if i:
                    done.release()

        for i, jobs in enumerate(self._queues, start=1):
            jobs.put(lambda i=i: job(i))
        job(0)
        for _ in range(self._n - 1):
            done.acquire()
        if errors:
            raise _first_cause(errors)
        return results

    def close(self) -> None:
        """Stops the threads (they finish the job in hand first)."""
        if self._finalizer is not None:
            self._finalizer()
        self._queues, self._threads = [], []


def _watched(fn: Callable[[int], Any], watch: ReplicaWatch | None) -> Callable[[int], Any]:
    """``fn`` telling ``watch`` when each replica starts and returns."""
    if watch is None:
        return fn

    def call(i: int) -> Any:
        watch.started(i)
        result = fn(i)
        watch.returned(i)
        return result

    return call


def _first_cause(errors: list[tuple[int, BaseException]]) -> BaseException:
    # A replica aborted because another failed is not the cause; report the cause.
    from phalanx.strategies.replicas.rendezvous import ReplicaAbortedError

    for _, exc in errors:
        if not isinstance(exc, ReplicaAbortedError):
            return exc
    return errors[0][1]


def _stop_all(queues: list[queue.SimpleQueue[Any]], threads: list[threading.Thread]) -> None:
    for jobs in queues:
        jobs.put(_STOP)
    current = threading.current_thread()
    for thread in threads:
        if thread is not current:
            thread.join(timeout=5)
