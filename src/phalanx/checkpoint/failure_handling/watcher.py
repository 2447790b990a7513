"""PreemptionWatcher: tells any worker of the job that some worker was told to terminate."""

from __future__ import annotations

from phalanx.checkpoint.failure_handling.board import Board, board_for
from phalanx.strategies.default import get_strategy

__all__ = ["PreemptionWatcher"]


class PreemptionWatcher:
    """Watches the job for a preemption: a worker whose `PreemptionCheckpointHandler` (or
    ``BackupAndRestore(save_before_preemption=True)``) received its termination notice
    (tf.distribute.experimental.PreemptionWatcher).

    Create it inside the strategy's scope (all workers, in the same order as the handlers).
    Every worker's handler tells the others through the job's rendezvous store the moment it
    acts on its notice; a watcher reads those messages on a thread of its own, so that, after
    training stopped, a program can tell a preemption from an error::

        watcher = phalanx.experimental.PreemptionWatcher()
        try:
            train()
        except Exception:
            if watcher.preemption_message is None:
                raise  # a real error, not a preemption
            watcher.block_until_worker_exit()

    In a job of one worker it sees this process's own handlers.
    """

    def __init__(self) -> None:
        self._board: Board = board_for(get_strategy())

    @property
    def preemption_message(self) -> str | None:
        """``"worker:1 (host:port) received SIGTERM"`` once a worker acted on its notice, else None."""
        notices = self._board.messages("notice")
        return f"{notices[0].task} {notices[0].text}" if notices else None

    def block_until_worker_exit(self, timeout: float = 60.0) -> None:
        """Waits until every worker that received a notice saved and exited (returns at once if
        none did).

        Raises:
            TimeoutError: Some did not within ``timeout`` seconds (they are named).
        """

        def missing() -> list[str]:
            exited = {m.task for m in self._board.messages("exit")}
            return sorted({m.task for m in self._board.messages("notice")} - exited)

        if not self._board.wait_for(lambda: not missing(), timeout):
            raise TimeoutError(
                f"Gave up after {timeout:g}s waiting for {missing()} to save their checkpoint and exit "
                "after their preemption notice. HINT: check those tasks' logs; a step or a save that "
                "takes longer needs a longer timeout."
            )
