"""How a worker learns that it will be terminated, and what it does then (`TerminationConfig`).

By default a worker is told by SIGTERM, the signal Kubernetes, SLURM, torchrun and `phalanx
launch` send before they kill a process; a ``termination_watcher_fn`` replaces it for platforms
that announce maintenance another way (a metadata server, a file). `TerminationNotice` turns
either into one event with the time it arrived.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = ["POLL_SECONDS", "RESTART_EXIT_CODE", "TerminationConfig", "TerminationNotice"]

RESTART_EXIT_CODE = 42  # TF's default restart code (its Borg and unknown-platform configs)
POLL_SECONDS = 1.0  # how often a termination_watcher_fn is called (TF's interval)


def _exit_for_restart() -> None:
    """The default ``exit_fn``: exit with `RESTART_EXIT_CODE`, so that the platform restarts the task."""
    sys.exit(RESTART_EXIT_CODE)


def _optional_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"TerminationConfig's {name} must be callable or None. Received: {value!r}.")


class TerminationConfig:
    """What a `PreemptionCheckpointHandler` watches, how long it may train on, how it saves and exits
    (tf.distribute.experimental.TerminationConfig).

    Args:
        termination_watcher_fn: Called every second on a thread of its own; returns True once a
            termination notice is available. It must not block. None (default): SIGTERM is the
            notice.
        exit_fn: Called on every worker after the checkpoint is saved. Default: ``sys.exit(42)``
            (TF's restart code), so that the platform restarts the task; the interpreter then
            exits normally, leaving the cluster together with the other workers.
        grace_period: Seconds between the notice and the actual termination. 0 (default): save
            at once and exit. A longer one: save at once, train on, and save again just before
            the notice's time is up (see docs/multi_worker.md), then exit.
        save_fn: Saves instead of the handler's `CheckpointManager` (all workers call it,
            inside the strategy's scope), e.g. ``lambda: manager.save(checkpoint_number=step)``.

    Raises:
        TypeError: A function that is not callable.
        ValueError: A negative or non-numeric ``grace_period``.
    """

    def __init__(
        self,
        termination_watcher_fn: Callable[[], bool] | None = None,
        exit_fn: Callable[[], Any] | None = None,
        grace_period: float | None = None,
        save_fn: Callable[[], Any] | None = None,
    ) -> None:
        for name, value in (("termination_watcher_fn", termination_watcher_fn), ("exit_fn", exit_fn)):
            _optional_callable(name, value)
        _optional_callable("save_fn", save_fn)
        period = 0.0 if grace_period is None else grace_period
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not period >= 0:
            raise ValueError(
                "grace_period must be a non-negative number of seconds. Received: "
                f"{grace_period!r}. HINT: leave it None to save and exit at once."
            )
        self.termination_watcher_fn = termination_watcher_fn
        self.exit_fn = exit_fn if exit_fn is not None else _exit_for_restart
        self.grace_period = float(period)
        self.save_fn = save_fn

    def __repr__(self) -> str:
        return (
            f"TerminationConfig(termination_watcher_fn={self.termination_watcher_fn!r}, "
            f"exit_fn={self.exit_fn!r}, grace_period={self.grace_period:g}, save_fn={self.save_fn!r})"
        )


class TerminationNotice:
    """This worker's own termination notice: SIGTERM, or a watcher function that returned True.

    `start` installs the SIGTERM handler (main thread only) or starts the polling thread; `stop`
    puts the previous handler back and stops the thread. A second SIGTERM puts the previous
    handler back and is delivered to it (by default the process terminates). The notice is only recorded here:
    whoever owns it acts on it at a safe point (between steps).

    Args:
        watcher_fn: The ``termination_watcher_fn``, or None for SIGTERM.
        poll_seconds: How often ``watcher_fn`` is called.
    """

    def __init__(self, watcher_fn: Callable[[], bool] | None, poll_seconds: float = POLL_SECONDS) -> None:
        self._watcher_fn, self._poll_seconds = watcher_fn, poll_seconds
        self._received = threading.Event()
        self._stopping = threading.Event()
        self.received_at: float | None = None  # time.monotonic() of the notice
        self.reason = ""
        self.error: BaseException | None = None  # what the watcher function raised, if anything
        self._previous: Any = None
        self._thread: threading.Thread | None = None

    @property
    def received(self) -> bool:
        """Whether the notice arrived."""
        return self._received.is_set()

    def start(self) -> None:
        """Starts watching.

        Raises:
            ValueError: SIGTERM is the notice but this is not the main thread (Python delivers
                signals to the main thread only).
        """
        if self._watcher_fn is not None:
            self._thread = threading.Thread(
                target=self._poll, name="phalanx-termination-watcher", daemon=True
            )
            self._thread.start()
            return
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "A PreemptionCheckpointHandler that watches SIGTERM must be created on the main thread: "
                "Python runs signal handlers there only. Received: thread "
                f"{threading.current_thread().name!r}. "
                "HINT: create it on the main thread, or pass TerminationConfig(termination_watcher_fn=...)."
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def stop(self) -> None:
        """Stops watching: the previous SIGTERM handler is back, the polling thread has ended."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def mark(self, reason: str) -> None:
        """Records the notice (the first one counts)."""
        if self._received.is_set():
            return
        self.received_at, self.reason = time.monotonic(), reason
        self._received.set()

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if not self._received.is_set():
            self.mark("received SIGTERM")
            return
        # A second SIGTERM (training ended, or the notice is not acted on): terminate as before.
        previous = self._previous if self._previous is not None else signal.SIG_DFL
        self._previous = None
        signal.signal(signal.SIGTERM, previous)
        os.kill(os.getpid(), signal.SIGTERM)

    def _poll(self) -> None:
        assert self._watcher_fn is not None
        while not self._stopping.is_set():
            try:
                if self._watcher_fn():
                    self.mark("its termination_watcher_fn returned True")
                    return
            except Exception as exc:  # surfaced on the training thread at the next step
                self.error = exc
                return
            self._stopping.wait(self._poll_seconds)
