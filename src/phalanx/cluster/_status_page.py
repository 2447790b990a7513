"""The status page served by ``phalanx launch --status HOST:PORT`` (the launcher's process).

The launcher outlives every task, so its page shows a lost chief as well as a lost worker.
It tells the tasks where to report (``PHALANX_STATUS_ADDRESS``) and that the launcher serves
(``PHALANX_STATUS_SERVED_BY=launcher``: no chief starts a server of its own).
"""

from __future__ import annotations

from phalanx.cluster._supervisor import describe_exit
from phalanx.status.board import Board
from phalanx.status.server import StatusServer, is_loopback
from phalanx.status.settings import ADDRESS_ENV, SERVED_BY_ENV, StatusSettings, parse_address

__all__ = ["LaunchedPage"]


class LaunchedPage:
    """Serves the page of a local launch until `stop` (the launcher only).

    Args:
        status: ``HOST:PORT`` from ``--status`` (port 0: a free one).
        token: The cluster token the tasks get; reports must carry it.
        user_given: Whether the user gave that token (``PHALANX_CLUSTER_TOKEN``): an address
            off loopback needs one the user knows, to open the page with.

    Raises:
        ValueError: A malformed address, an address off loopback with a token the launcher
            made up, or an address it cannot listen at.
    """

    def __init__(self, status: str, token: str, user_given: bool) -> None:
        host, port = parse_address(status, "--status")
        if not is_loopback(host) and not user_given:
            raise ValueError(
                "A status page off loopback requires the cluster token, and only a token you chose can "
                f"be typed into a browser. Received: --status {status} and no PHALANX_CLUSTER_TOKEN. "
                "HINT: export PHALANX_CLUSTER_TOKEN=<a secret of 16+ characters> and open "
                "http://HOST:PORT/?token=<it>, or use --status 127.0.0.1:PORT."
            )
        self._server = StatusServer(host, port, Board(secrets=(token,)), token).start()
        self.settings = StatusSettings(host, self._server.port, "launcher")

    @property
    def url(self) -> str:
        """Where to open the page (without the token)."""
        return f"http://{self.settings.address}/"

    def environment(self) -> dict[str, str]:
        """The variables every task gets."""
        return {ADDRESS_ENV: self.settings.address, SERVED_BY_ENV: "launcher"}

    def task_exited(self, name: str, code: int) -> None:
        """A task's process exited (the launcher's supervision loop): one that failed is lost
        at once, with how it ended (``worker-1``: the launcher's name for ``worker:1``)."""
        if code != 0:
            how = f"exited with code {code}{describe_exit(code)}"
            self._server.board.task_exited(name.replace("-", ":", 1), how)

    def stop(self) -> None:
        """Stops serving (at the end of the launch)."""
        self._server.stop()
