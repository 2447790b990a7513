"""The status page's settings, from its knobs in `phalanx.settings`.

``PHALANX_STATUS_ADDRESS=HOST:PORT`` on every task of a job turns the status page on: the
chief serves it there and every task reports to it. ``phalanx launch --status HOST:PORT``
sets it for its tasks and serves the page itself (``PHALANX_STATUS_SERVED_BY=launcher``,
which it sets too), so the page outlives any task.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from phalanx import settings

__all__ = ["ADDRESS_ENV", "SERVED_BY_ENV", "StatusSettings", "parse_address"]

ADDRESS_ENV = "PHALANX_STATUS_ADDRESS"
SERVED_BY_ENV = "PHALANX_STATUS_SERVED_BY"
_SERVERS = ("chief", "launcher")


def parse_address(text: str, what: str = ADDRESS_ENV) -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[::1]:PORT"`` for IPv6) as ``(host, port)``.

    Raises:
        ValueError: No port, or a port outside 0..65535.
    """
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(
            f"{what} must be HOST:PORT (a port 0..65535; [::1]:PORT for IPv6). Received: {text!r}. "
            "HINT: e.g. 127.0.0.1:8265 (loopback: no token needed)."
        )
    return host, int(port)


@dataclass(frozen=True)
class StatusSettings:
    """Where the page is served and who serves it.

    Args:
        host, port: The page's address (the tasks report there).
        served_by: ``"chief"`` (the chief task starts the server) or ``"launcher"``.
        token: The cluster token (``PHALANX_CLUSTER_TOKEN``), or None.
    """

    host: str
    port: int
    served_by: str = "chief"
    token: str | None = field(default=None, repr=False)  # never shown

    @property
    def address(self) -> str:
        """``HOST:PORT`` as the tasks reach it."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @staticmethod
    def from_env() -> StatusSettings | None:
        """The settings from ``PHALANX_STATUS_ADDRESS`` and ``PHALANX_STATUS_SERVED_BY``
        (None: the status page is off).

        Raises:
            ValueError: A malformed address or an unknown server.
        """
        knobs = settings.current()
        text = knobs.text(ADDRESS_ENV).strip()
        if not text:
            return None
        host, port = parse_address(text)
        served_by = knobs.text(SERVED_BY_ENV).strip() or "chief"
        if served_by not in _SERVERS:
            raise ValueError(
                f"{SERVED_BY_ENV} must be one of {list(_SERVERS)}. Received: {served_by!r}. "
                "HINT: leave it unset: phalanx launch sets it for the jobs it serves the page of."
            )
        if port == 0 and served_by == "chief":
            raise ValueError(
                f"{ADDRESS_ENV} needs a fixed port: every task reports there. Received: {text!r}. "
                "HINT: pick a free port, e.g. 127.0.0.1:8265."
            )
        return StatusSettings(host, port, served_by, knobs.cluster_token or None)
