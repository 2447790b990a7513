"""ClusterCoordinator: schedules functions on the workers of a parameter-server cluster.

One thread per worker takes functions from the shared `ClosureQueue` and runs them on its
worker, one at a time. A function whose worker is lost (the process died, or it stopped
answering heartbeats) goes back to the front of the queue and runs on another worker; the
lost worker's thread waits for it to come back (a restarted worker makes its per-worker
datasets again). If no worker is left for ``worker_recovery_timeout`` seconds, every pending
function fails with an error naming the lost workers. A function that raises cancels the
queued ones; the error is raised by the next `schedule`, `join` or `done` (TF's rules).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.input.per_worker import PerWorkerDataset, PerWorkerValues
from phalanx.ps.coordinator.closure import Closure, ClosureQueue
from phalanx.ps.coordinator.remote_value import RemoteValue
from phalanx.ps.coordinator.remote_worker import RemoteWorker, WorkerLostError

if TYPE_CHECKING:
    from phalanx.strategies.parameter_server import ParameterServerStrategy

__all__ = ["ClusterCoordinator", "NoWorkerAvailableError"]

log = logging.getLogger("phalanx")


class NoWorkerAvailableError(RuntimeError):
    """Every worker was lost for longer than the coordinator's recovery timeout."""


class ClusterCoordinator:
    """Schedules functions on the workers of a `ParameterServerStrategy` cluster (the chief
    only; tf.distribute.coordinator.ClusterCoordinator).

    Args:
        strategy: The `ParameterServerStrategy` whose workers run the functions.
        worker_recovery_timeout: Seconds to wait for a lost worker while no other worker
            is available (default 3600, TF's bound), then fail.
    """

    def __init__(self, strategy: ParameterServerStrategy, worker_recovery_timeout: float = 3600.0) -> None:
        from phalanx.strategies.parameter_server import ParameterServerStrategy

        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError(
                "ClusterCoordinator works with ParameterServerStrategy only. Received: "
                f"{type(strategy).__name__}. HINT: other strategies run steps with strategy.run."
            )
        if strategy._coordinator is not None:
            raise ValueError(
                "This strategy already has a ClusterCoordinator. HINT: create one coordinator per "
                "strategy and reuse it (strategy.cluster_coordinator)."
            )
        self._strategy = strategy
        self._queue = ClosureQueue()
        self._recovery_timeout = worker_recovery_timeout
        self._stop = threading.Event()
        self._lost: set[int] = set()
        self._outage_since: float | None = None
        self._lock = threading.Lock()
        self._workers = strategy._connect_workers()
        self._threads = [
            threading.Thread(
                target=self._serve, args=(w,), name=f"phalanx-coordinator-{w.index}", daemon=True
            )
            for w in self._workers
        ]
        strategy._coordinator = self
        for thread in self._threads:
            thread.start()
        # before the interpreter finalizes: a thread still inside a gRPC call then would abort it
        atexit.register(self.shutdown)

    @property
    def strategy(self) -> ParameterServerStrategy:
        """The strategy this coordinator schedules for."""
        return self._strategy

    # ------------------------------------------------------------------ the user's API
    def schedule(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteValue:
        """Queues ``fn(*args, **kwargs)`` to run on some worker; returns at once.

        Returns:
            A `RemoteValue` of the result (``fetch()`` blocks until a worker ran it).

        Raises:
            The error of an earlier function that failed since it was last raised.
            RuntimeError: The coordinator was shut down.
        """
        if self._stop.is_set():
            raise RuntimeError("schedule was called after the coordinator was shut down.")
        if not callable(fn):
            raise TypeError(f"schedule needs a callable. Received: {type(fn).__name__}.")
        self._strategy._push_coordinator_writes()
        closure = Closure(fn, tuple(args or ()), dict(kwargs or {}))
        self._queue.put(closure)
        self._strategy._mark_stale()
        return closure.output

    def join(self) -> None:
        """Blocks until every scheduled function finished; then the coordinator's copies of
        the variables hold the ps tasks' values.

        Raises:
            The first error a scheduled function raised (then forgotten).
        """
        try:
            self._queue.wait()
        finally:
            self._strategy._refresh()

    def done(self) -> bool:
        """Whether every scheduled function finished (does not block).

        Raises:
            The first error a scheduled function raised (then forgotten).
        """
        return self._queue.done()

    def fetch(self, value: Any) -> Any:
        """``value`` with every `RemoteValue` fetched (blocks) and `PerWorkerValues` as tuples."""
        if isinstance(value, RemoteValue):
            return value.fetch()
        if isinstance(value, PerWorkerValues):
            return tuple(self.fetch(v) for v in value.values)
        if isinstance(value, (list, tuple)):
            return type(value)(self.fetch(v) for v in value)
        if isinstance(value, dict):
            return {k: self.fetch(v) for k, v in value.items()}
        return value

    def create_per_worker_dataset(self, dataset_fn: Callable[..., Any]) -> PerWorkerDataset:
        """A dataset made on every worker by ``dataset_fn`` (see `PerWorkerDataset`)."""
        return PerWorkerDataset(dataset_fn)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the worker threads, cancelling running calls (pending functions stay
        unfinished); waits up to ``timeout`` seconds for the threads. Idempotent; also run at exit."""
        atexit.unregister(self.shutdown)
        self._stop.set()
        self._queue.stop()
        for worker in self._workers:
            worker.close()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(max(deadline - time.monotonic(), 0.0))

    # ------------------------------------------------------------------ worker threads
    def _serve(self, worker: RemoteWorker) -> None:
        while not self._stop.is_set():
            closure = self._queue.get(timeout=0.5)
            if closure is None:
                continue
            try:
                payload = self._strategy._pickle_closure(closure)
            except Exception as exc:
                self._queue.mark_failed(closure, exc)
                continue
            try:
                ok, data = worker.run(payload)
            except WorkerLostError as exc:
                self._queue.put_back(closure)
                self._recover(worker, exc)
                continue
            except Exception as exc:  # the connection was closed (shutdown)
                if not self._stop.is_set():
                    self._queue.mark_failed(closure, exc)
                continue
            self._finish(closure, ok, data)

    def _finish(self, closure: Closure, ok: bool, data: bytes) -> None:
        try:
            value = RemoteWorker.result(ok, data)
        except BaseException as exc:
            self._queue.mark_failed(closure, exc)
        else:
            self._queue.mark_finished(closure, value)
        self._strategy._mark_stale()

    def _recover(self, worker: RemoteWorker, exc: WorkerLostError) -> None:
        """Waits for a lost worker (pinging it); meanwhile fails the pending functions if no
        worker at all was available for ``worker_recovery_timeout`` seconds."""
        self._set_lost(worker, True)
        log.warning(
            "Lost %s (%s); its function runs on another worker. Waiting for it to come back.",
            worker.name,
            exc,
        )
        while not self._stop.is_set():
            if worker.wait_until_back(0.5, self._stop):
                self._set_lost(worker, False)
                log.warning("%s is back.", worker.name)
                return
            self._fail_if_no_worker_for_too_long()

    def _set_lost(self, worker: RemoteWorker, lost: bool) -> None:
        with self._lock:
            if lost:
                self._lost.add(worker.index)
            else:
                self._lost.discard(worker.index)
            everyone = len(self._lost) == len(self._workers)
            self._outage_since = (self._outage_since or time.monotonic()) if everyone else None

    def _fail_if_no_worker_for_too_long(self) -> None:
        with self._lock:
            since = self._outage_since
            names = [w.name for w in self._workers if w.index in self._lost]
        if since is None or time.monotonic() - since < self._recovery_timeout or self._queue.pending == 0:
            return
        if any(w.ping(2.0) for w in self._workers):  # longer than a reconnect backoff
            return  # one is back: its thread takes the functions
        self._queue.fail_all(
            NoWorkerAvailableError(
                f"No worker was available for {self._recovery_timeout:g}s: lost {names}. HINT: restart "
                "the worker tasks (they rejoin by themselves), or check their logs."
            )
        )
