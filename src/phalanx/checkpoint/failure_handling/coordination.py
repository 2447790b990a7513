"""What every worker's preemption handling shares: its own notice, the agreement at each step
boundary, the decision, and errors told to the other workers by name.

Used by `PreemptionCheckpointHandler` (custom loops) and `BackupAndRestore(save_before_preemption=True)`
(``Model.fit``); they differ only in what they save.

**The agreement.** At every step boundary each worker contributes its `Flags` (has a notice,
its time is up) to one all-reduce, ``strategy.reduce`` of two integers; every worker gets the
same sums at the same step, so every worker decides the same (`PreemptionPolicy`) and saves at
the same step, with nothing else to wait for. (TF instead has the noticed worker announce a step
in its coordination service and wait for every worker's acknowledgement.) The all-reduce is a
collective like the gradients': a worker that stops answering is named within the heartbeat
bound, and one that does not call it within the stall bound. A job of one worker agrees with
itself.
"""

from __future__ import annotations

import _thread
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from phalanx.checkpoint.failure_handling.board import Board, Message, board_for
from phalanx.checkpoint.failure_handling.policy import Decision, Flags, PreemptionPolicy
from phalanx.checkpoint.failure_handling.termination import TerminationConfig, TerminationNotice
from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError

__all__ = ["PEER_ERROR_WAIT", "PeerFailedError", "PreemptionCoordinator", "check_supported"]

log = logging.getLogger("phalanx")

PEER_ERROR_WAIT = 2.0  # seconds a worker whose collective failed waits for the failed peer's own error
_PEER_FAILURES = (PeerUnavailableError, CollectiveMismatchError)


class PeerFailedError(RuntimeError):
    """Another worker's training function raised; this worker stops with its error, named.

    Attributes:
        task: The worker that raised (``"worker:1 (host:port)"``).
        error: Its error, as ``"TypeName: message"``.
    """

    def __init__(self, task: str, error: str, here: str) -> None:
        super().__init__(
            f"{task} raised {error} in its training function, so {here} stopped too (every worker "
            "steps together). HINT: fix the error reported by that task; restart the job, which "
            "resumes from the latest checkpoint."
        )
        self.task, self.error = task, error


def check_supported(strategy: Any, what: str) -> None:
    """Refuses a strategy whose workers do not step together.

    Raises:
        NotImplementedError: ParameterServerStrategy.
    """
    if strategy.schedules_steps:
        raise NotImplementedError(
            f"{what} needs workers that step together (OneDevice, Mirrored, CentralStorage or "
            f"MultiWorkerMirroredStrategy). Received: {strategy!r}. HINT: under ParameterServerStrategy the "
            "coordinator retries the functions of a lost worker by itself; save with a "
            "CheckpointManager on the chief between steps."
        )


class PreemptionCoordinator:
    """Watches this worker's termination notice and agrees with every worker on what to do
    at each step boundary (all workers make it, and call `check` at the same boundaries).

    Args:
        strategy: The strategy whose workers step together.
        config: The `TerminationConfig`.
        what: The caller, for messages.

    Raises:
        NotImplementedError: ParameterServerStrategy.
        ValueError: SIGTERM is the notice and this is not the main thread.
    """

    def __init__(self, strategy: Any, config: TerminationConfig, what: str) -> None:
        check_supported(strategy, what)
        self.strategy, self.config = strategy, config
        self.policy = PreemptionPolicy(config.grace_period)
        self.board: Board = board_for(strategy)
        self.notice = TerminationNotice(config.termination_watcher_fn)
        self.notice.start()
        self.save_seconds = 0.0
        self.clock = time.monotonic  # the notice's time base (tests replace it)
        self._step_seconds, self._steps = 0.0, 0
        self._announced = False
        self._guard = threading.Lock()
        self._stepping_thread: int | None = None  # the thread inside `share_errors`
        self._interrupted = False
        self.board.subscribe(self._on_message)

    def step_took(self, seconds: float) -> None:
        """Records how long a step took (a running average, for the grace period's margin)."""
        self._steps += 1
        self._step_seconds += (seconds - self._step_seconds) / self._steps

    def check(self) -> Decision:
        """What every worker does now (all workers, at the same step boundary; one collective).

        Raises:
            RuntimeError: The ``termination_watcher_fn`` raised.
        """
        if self.notice.error is not None:
            raise RuntimeError(
                f"The termination_watcher_fn of {self.board.own_name} raised "
                f"{type(self.notice.error).__name__}: {self.notice.error}. HINT: it must return "
                "True or False and never raise."
            ) from self.notice.error
        if self.notice.received and not self._announced:
            self._announced = True
            log.warning(
                "%s %s: saving a checkpoint with every worker.", self.board.own_name, self.notice.reason
            )
            self.board.post("notice", self.notice.reason)
        mine = self.policy.local_flags(
            self.notice.received_at, self.clock(), self._step_seconds, self.save_seconds
        )
        return self.policy.decide(self._agree(mine))

    def _agree(self, mine: Flags) -> Flags:
        if self.strategy.num_workers_in_sync <= 1:
            return mine
        with self.share_errors(), self.strategy.scope():
            flags = torch.tensor(mine.as_ints(), dtype=torch.int64)
            total = self.strategy.reduce("SUM", flags, axis=None)  # (2,) summed over every replica
        return Flags(notice=bool(total[0] > 0), time_is_up=bool(total[1] > 0))

    def exit(self, where: str) -> None:
        """Tells the others this worker exits, stops watching, and runs ``exit_fn``."""
        log.warning("%s saved %s and exits (preemption).", self.board.own_name, where)
        self.board.post("exit", where)
        self.close()
        self.config.exit_fn()

    def close(self) -> None:
        """Stops watching this worker's notice (the previous SIGTERM handler is back)."""
        self.notice.stop()

    def _on_message(self, message: Message) -> None:
        """A peer's error interrupts this worker's step at once (as Ctrl-C would), instead of
        leaving it in a collective the peer will never join until the stall bound (30 s)."""
        if message.kind != "error" or message.task == self.board.own_name:
            return
        with self._guard:
            if self._stepping_thread == threading.main_thread().ident and not self._interrupted:
                self._interrupted = True
                _thread.interrupt_main()  # as Ray's task cancellation does

    def _peer_failed(self, cause: BaseException | None) -> PeerFailedError | None:
        peer = self.board.peer_error(0 if cause is None else PEER_ERROR_WAIT)
        return None if peer is None else PeerFailedError(peer.task, peer.text, self.board.own_name)

    @contextlib.contextmanager
    def share_errors(self) -> Iterator[None]:
        """Tells the other workers about an error raised inside, by this worker's name; raises
        `PeerFailedError` when a peer told its own error (at once if it is known already, else
        by interrupting the wait for that peer: see `_on_message`)."""
        known = self._peer_failed(None)
        if known is not None:
            raise known
        with self._guard:
            self._stepping_thread = threading.get_ident()
        try:
            yield
        except BaseException as exc:
            self._step_ended()  # no interruption while the error is handled
            self._raise_shared(exc)
            raise
        finally:
            self._step_ended()

    def _step_ended(self) -> None:
        with self._guard:
            self._stepping_thread = None

    def _raise_shared(self, exc: BaseException) -> None:
        """Raises `PeerFailedError` for an error a peer told; posts this worker's own error."""
        if isinstance(exc, PeerFailedError) or not isinstance(exc, (Exception, KeyboardInterrupt)):
            return
        if isinstance(exc, KeyboardInterrupt) and not self._interrupted:
            return  # a real Ctrl-C
        if isinstance(exc, (KeyboardInterrupt, *_PEER_FAILURES)):
            membership = getattr(self.strategy, "membership", None)
            if membership is not None and membership.failure() is not None:
                return  # an elastic job lost a worker: no error of its to wait for
            failed = self._peer_failed(exc)
            if failed is not None:
                raise failed from exc
            return
        self.board.post("error", f"{type(exc).__name__}: {exc}")
