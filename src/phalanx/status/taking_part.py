"""A task's part in the status page: report while it runs, and serve the page on the chief.

`MultiWorkerMirroredStrategy` calls `join_status` when it is created (every task) and
`TaskStatus.close` when it is closed. With the page off (no ``PHALANX_STATUS_ADDRESS``) both
cost nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx.status.board import Board
from phalanx.status.counters import COUNTERS
from phalanx.status.reports import Reporter
from phalanx.status.settings import StatusSettings

if TYPE_CHECKING:
    from phalanx.status.server import StatusServer  # made only where the page is served

__all__ = ["TaskStatus", "expect_steps", "join_status"]

log = logging.getLogger("phalanx")


def expect_steps(total: int | None) -> None:
    """Tells the status page how many steps the job runs in all, for its ETA (any task).

    Raises:
        ValueError: ``total`` is below 1.
    """
    COUNTERS.expect_steps(total)


class TaskStatus:
    """This task's reporter, and the page's server when this task is the chief that serves it."""

    def __init__(self, reporter: Reporter, server: StatusServer | None) -> None:
        self._reporter, self.server = reporter, server

    def running(self) -> None:
        """The worker group formed: the task trains."""
        self._reporter.state = "running"

    def failed(self, error: BaseException) -> None:
        """Keeps ``error`` as the task's last error (the next report carries it)."""
        COUNTERS.failed(error)

    def close(self) -> None:
        """Sends the last report (``done``) and stops reporting; the chief's server stays up
        until the process exits, so the page shows how the job ended."""
        self._reporter.stop("done")


def join_status(
    task: str, is_chief: bool, epoch: Callable[[], int | None] = lambda: None
) -> TaskStatus | None:
    """Starts reporting (every task) and, on the chief of a job whose chief serves the page,
    the page's server; None when the page is off.

    Args:
        task: ``"worker:1"``.
        is_chief: Whether this task is the job's chief (``chief:0``, else ``worker:0``).
        epoch: Returns the task's membership epoch (None: not an elastic job).

    Raises:
        ValueError: A malformed ``PHALANX_STATUS_ADDRESS``, or the chief cannot serve there.
    """
    settings = StatusSettings.from_env()
    if settings is None:
        return None
    server = _server_for(settings) if is_chief and settings.served_by == "chief" else None
    reporter = Reporter(task, settings.address, settings.token, epoch)
    reporter.start()
    return TaskStatus(reporter, server)


_SERVERS: dict[tuple[str, int], StatusServer] = {}  # one per address and process
_SERVERS_LOCK = threading.Lock()


def _server_for(settings: StatusSettings) -> StatusServer:
    from phalanx.status.server import StatusServer  # http.server only in the process that serves

    """The chief's server at the settings' address: started by the first strategy of this
    process, kept by the next ones (a program that makes a strategy again reuses the page)."""
    key = (settings.host, settings.port)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None:
            board = Board(secrets=(settings.token,) if settings.token else ())
            server = _SERVERS[key] = StatusServer(settings.host, settings.port, board, settings.token).start()
        return server
