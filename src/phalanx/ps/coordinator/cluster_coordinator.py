"""ClusterCoordinator: schedules functions on the workers of a parameter-server cluster.

One thread per worker takes functions from the shared `ClosureQueue` and runs them on its
worker, one at a time. A function that raises cancels the queued ones; the error is raised by
the next `schedule`, `join` or `done` (TF's rules). Worker loss is decided by
`phalanx.ps.coordinator.worker_loss` (the threads report events and carry out its decisions):
a function whose worker is lost (the process died, or it stopped answering heartbeats) goes
back to the front of the queue and runs on another worker; the lost worker's thread waits for
it to come back (a restarted worker makes its per-worker datasets again). If no worker is left
for ``worker_recovery_timeout`` seconds, every pending function fails with an error naming the
lost workers. A function that runs past ``closure_timeout`` on a worker that still answers
fails with `ClosureTimeoutError` (its worker is waited for until the function returns);
``join`` and ``fetch`` are bounded too (`phalanx.ps.coordinator.deadlines`).

The coordinator talks to the strategy through its `Chief` only (see `phalanx.ps.coordinator.chief`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.input.per_worker import PerWorkerDataset, PerWorkerValues
from phalanx.ps.coordinator.chief import Chief
from phalanx.ps.coordinator.closure import Closure, ClosureQueue
from phalanx.ps.coordinator.deadlines import Deadlines, Waiter
from phalanx.ps.coordinator.remote_value import RemoteValue
from phalanx.ps.coordinator.remote_worker import ClosureTimeoutError, RemoteWorker, WorkerLostError
from phalanx.ps.coordinator.worker_loss import Action, Decision, FailurePolicy, WorkerStateMachine
from phalanx.ps.pickling import dumps
from phalanx.ps.variables import BufferChanges
from phalanx.ps.worker.running import ClosureAbandonedError
from phalanx.status.counters import COUNTERS

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy as Strategy

__all__ = ["ClusterCoordinator"]

log = logging.getLogger("phalanx")


class ClusterCoordinator:
    """Schedules functions on the workers of a `ParameterServerStrategy` cluster (the chief
    only; tf.distribute.coordinator.ClusterCoordinator).

    Args:
        strategy: The `ParameterServerStrategy` whose workers run the functions.
        worker_recovery_timeout: Seconds to wait for a lost worker while no other worker
            is available (default 3600, TF's bound), then fail.
        closure_timeout: Seconds one function may run on a worker that still answers before
            it fails with `ClosureTimeoutError` (default: ``PHALANX_CLOSURE_TIMEOUT_SECONDS``,
            else 3600).
        heartbeat_timeout: Seconds of silence after which a worker is lost and its function
            reruns elsewhere (default: ``PHALANX_HEARTBEAT_TIMEOUT_SECONDS``, else 5).
        wait_timeout: ``join()`` and ``fetch()`` without a timeout raise `TimeoutError` once no
            function finished for this long (default: ``PHALANX_WAIT_TIMEOUT_SECONDS``, else
            longer than the deadlines above; see `phalanx.ps.coordinator.deadlines`).

    Raises:
        TypeError: ``strategy`` is not a ParameterServerStrategy.
        ValueError: The strategy already has a coordinator, or a deadline is not positive.
    """

    def __init__(
        self,
        strategy: Strategy,
        worker_recovery_timeout: float = 3600.0,
        *,
        closure_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        wait_timeout: float | None = None,
    ) -> None:
        chief = Chief.of(strategy)
        if chief is None:
            raise TypeError(
                "ClusterCoordinator works with ParameterServerStrategy only. Received: "
                f"{type(strategy).__name__}. HINT: other strategies run steps with strategy.run."
            )
        self.deadlines = Deadlines.resolve(
            closure_timeout, heartbeat_timeout, worker_recovery_timeout, wait_timeout
        )
        self._strategy, self._chief = strategy, chief
        self._queue = ClosureQueue()
        self._waiter = Waiter(self.deadlines.wait_timeout, lambda: self._queue.last_progress, self._pending)
        chief.attach(self, lambda: self._queue.pending)
        self._stop = threading.Event()
        self._workers = chief.connect_workers(self.deadlines)
        self._running: dict[int, tuple[Closure, float]] = {}  # worker index -> closure, start
        self._session, self._runs = secrets.token_hex(8), itertools.count(1)  # fence tags
        self._worker_states = WorkerStateMachine(
            [w.name for w in self._workers], FailurePolicy(self.deadlines.recovery_timeout)
        )
        self._threads = [
            threading.Thread(
                target=self._serve, args=(w,), name=f"phalanx-coordinator-{w.index}", daemon=True
            )
            for w in self._workers
        ]
        for thread in self._threads:
            thread.start()
        # before the interpreter finalizes: a thread still inside a gRPC call then would abort it
        atexit.register(self.shutdown)

    @property
    def strategy(self) -> Strategy:
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
        self._chief.before_schedule()
        closure = Closure(fn, tuple(args or ()), dict(kwargs or {}), self._waiter)
        self._queue.put(closure)
        self._chief.after_schedule()
        return closure.output

    def join(self, timeout: float | None = None) -> None:
        """Blocks until every scheduled function finished; then the coordinator's copies of
        the variables hold the ps tasks' values. When a function failed, its error is raised
        as it is: the copies are read from the ps tasks on their next use instead.

        Args:
            timeout: Seconds to wait at most (default: until no function finished for the
                coordinator's ``wait_timeout``).

        Raises:
            The first error a scheduled function raised (then forgotten).
            TimeoutError: The bound passed; the message names the pending functions and workers.
        """
        self._waiter.wait(self._queue.wait, timeout, "join()")
        self._chief.refresh()

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
        return PerWorkerDataset(dataset_fn, dumps)

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

    def _pending(self) -> str:
        """What is pending, for a wait's error: the running functions and the lost or hung workers."""
        now = time.monotonic()
        running = [
            f"{closure.describe()} on {self._workers[i].name} for {now - start:.0f}s"
            for i, (closure, start) in sorted(self._running.items())
        ]
        lost = [self._workers[i].name for i in sorted(self._worker_states.lost)]
        hung = [self._workers[i].name for i in sorted(self._worker_states.hung)]
        return (
            f"{self._queue.pending} function(s) queued or running; running: {running or 'none'}; "
            f"lost workers: {lost or 'none'}; workers still running a timed-out function: {hung or 'none'}"
        )

    @property
    def _lost(self) -> frozenset[int]:
        """The indices of the lost workers (for tests that wait for one to come back)."""
        return self._worker_states.lost

    # ------------------------------------------------------------------ worker threads
    def _serve(self, worker: RemoteWorker) -> None:
        """One worker's thread: runs queued closures on ``worker`` until shutdown; a lost
        worker is reported to the worker state machine, whose decisions it carries out."""
        while not self._stop.is_set():
            closure = self._queue.get(timeout=0.5)
            if closure is None:
                continue
            try:
                payload = self._chief.pickle_closure(closure)
            except Exception as exc:
                self._queue.mark_failed(closure, exc)
                continue
            self._running[worker.index] = (closure, time.monotonic())
            run = next(self._runs)
            try:
                ok, data, changes = worker.run(payload, run, closure.describe(), self._session)
            except WorkerLostError as exc:
                if not self._stop.is_set():  # else shutdown closed the connection: nothing was lost
                    self._lost_running(worker, closure, run, exc)
                continue
            except ClosureTimeoutError as exc:
                self._timed_out(worker, closure, run, exc)
                continue
            except Exception as exc:  # the connection was closed (shutdown)
                if not self._stop.is_set():
                    self._queue.mark_failed(closure, exc)
                continue
            finally:
                self._running.pop(worker.index, None)
            self._finish(closure, ok, data, changes, (worker.index, run))

    def _lost_running(self, worker: RemoteWorker, closure: Closure, run: int, exc: WorkerLostError) -> None:
        """``worker`` was lost running ``closure``: fence the run, run it again elsewhere, and
        wait for the worker to come back."""
        self._chief.fence(self._session, worker.index, run)
        decision = self._worker_states.worker_lost(worker.index)
        retried = int(decision.action is Action.RETRY)
        COUNTERS.closure(f"worker:{worker.index}", lost=1, rescheduled=retried)
        self._act(decision, closure)
        log.warning(
            "Lost %s (%s); its function runs on another worker. Waiting for it to come back.",
            worker.name,
            exc,
        )
        self._wait_for(worker)

    def _timed_out(self, worker: RemoteWorker, closure: Closure, run: int, exc: ClosureTimeoutError) -> None:
        """``closure`` ran past its deadline on ``worker``: fence the run, fail the closure,
        and wait until the worker runs nothing."""
        self._chief.fence(self._session, worker.index, run)
        self._act(self._worker_states.closure_timed_out(worker.index), closure, exc)
        log.error("%s Waiting for %s to finish it.", exc, worker.name)
        self._wait_for(worker, idle=True)

    def _finish(
        self, closure: Closure, ok: bool, data: bytes, changes: BufferChanges, run: tuple[int, int]
    ) -> None:
        try:
            value = RemoteWorker.result(ok, data)
            self._chief.take_buffers(changes)  # once: only the run whose result is taken adds them
        except ClosureAbandonedError as exc:  # its worker missed our pings: run it again (TF's rule)
            log.warning("%s; it runs again.", exc)
            self._chief.fence(self._session, *run)
            self._queue.put_back(closure)
            COUNTERS.closure(f"worker:{run[0]}", rescheduled=1)  # the status page's counts
        except BaseException as exc:
            self._queue.mark_failed(closure, exc)
        else:
            self._queue.mark_finished(closure, value)
            COUNTERS.closure(f"worker:{run[0]}", done=1)
        self._chief.after_closure()

    def _wait_for(self, worker: RemoteWorker, idle: bool = False) -> None:
        """Pings a lost worker until it answers (a hung one: until it runs nothing); meanwhile
        reports each wait to the worker state machine and carries out its decisions (probe
        every worker, fail the queue)."""
        while not self._stop.is_set():
            if worker.wait_until_back(0.5, self._stop, idle=idle):
                self._act(self._worker_states.worker_back(worker.index))
                log.warning("%s is back.", worker.name)
                return
            decision = self._worker_states.waited(self._queue.pending)
            if decision.action is Action.PROBE:
                answered = any(w.ping(2.0) for w in self._workers)  # longer than a reconnect backoff
                decision = self._worker_states.probed(answered, self._queue.pending)
            self._act(decision)

    def _act(
        self, decision: Decision, closure: Closure | None = None, error: Exception | None = None
    ) -> None:
        """Carries out what the queue must do for ``decision`` (WAIT, PROBE and RESUME are
        the waiting loop's); ``error`` is ``closure``'s for ABORT."""
        if decision.action is Action.RETRY and closure is not None:
            self._queue.put_back(closure)
        elif decision.action is Action.ABORT and closure is not None and error is not None:
            self._queue.mark_failed(closure, error)
            self._chief.after_closure()
        elif decision.action is Action.FAIL and decision.error is not None:
            self._queue.fail_all(decision.error)
