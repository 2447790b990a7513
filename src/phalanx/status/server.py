"""The status page's HTTP server: ``/`` (the page), ``/status.json`` and ``/report``.

A stdlib `http.server` on a daemon thread, served by the chief (or by ``phalanx launch``).
It is bounded: at most `MAX_CONNECTIONS` requests are handled at once (more are closed at
once), each connection's socket reads time out after `REQUEST_TIMEOUT` seconds, and a request
body is at most `MAX_BODY` bytes.

Who may ask (docs/status_page.md, docs/security.md): on a loopback address anyone on the
machine may read the page; reports must carry the cluster token when the job has one. On any
other address the server refuses to start without the cluster token, and every request must
carry it: the ``X-Phalanx-Token`` header (the tasks' reports, scripts) or ``?token=`` in the
page's address (a browser; the page passes it on to its own requests). The token is compared
in constant time and never shown: every string the page or the JSON shows is scrubbed of it.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from phalanx.status.board import Board
from phalanx.status.page import render_page
from phalanx.status.reports import TOKEN_HEADER

__all__ = ["MAX_BODY", "MAX_CONNECTIONS", "REQUEST_TIMEOUT", "StatusServer", "is_loopback"]

log = logging.getLogger("phalanx")

MAX_CONNECTIONS = 16
REQUEST_TIMEOUT = 5.0
MAX_BODY = 256 * 1024
_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # everything inline, nothing fetched from elsewhere
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
    ),
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], family: int, status: StatusServer) -> None:
        self.address_family = family
        self.status = status
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):  # bounded: too many at once are closed
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT
    server_version = "phalanx-status"
    sys_version = ""

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        log.debug("status page: " + format, *args)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if not self._allowed(url.query, report=False):
            return
        status = self.server.status
        if url.path == "/status.json":
            self._answer(HTTPStatus.OK, "application/json", json.dumps(status.board.snapshot()).encode())
        elif url.path in ("/", "/index.html"):
            self._answer(
                HTTPStatus.OK, "text/html; charset=utf-8", render_page(status.board.snapshot()).encode()
            )
        else:
            self._answer(HTTPStatus.NOT_FOUND, "text/plain", b"not found: try / or /status.json\n")

    def do_POST(self) -> None:
        url = urlsplit(self.path)
        if url.path != "/report":
            self._answer(HTTPStatus.NOT_FOUND, "text/plain", b"not found\n")
            return
        if not self._allowed(url.query, report=True):
            return
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= MAX_BODY:
            self._answer(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "text/plain", b"a report is 1..256 KiB\n")
            return
        try:
            self.server.status.board.receive(json.loads(self.rfile.read(length)))
        except ValueError as exc:  # json.JSONDecodeError is one
            self._answer(HTTPStatus.BAD_REQUEST, "text/plain", f"{exc}\n".encode())
            return
        self._answer(HTTPStatus.NO_CONTENT, "text/plain", b"")

    def _allowed(self, query: str, report: bool) -> bool:
        token = self.server.status.token
        if token is None or (self.server.status.loopback and not report):
            return True
        given = self.headers.get(TOKEN_HEADER) or next(iter(parse_qs(query).get("token", [])), "")
        if hmac.compare_digest(given.encode(), token.encode()):
            return True
        self._answer(
            HTTPStatus.UNAUTHORIZED,
            "text/plain",
            b"this status page needs the cluster token: open /?token=<PHALANX_CLUSTER_TOKEN>, "
            b"or send it in the X-Phalanx-Token header\n",
        )
        return False

    def _answer(self, status: HTTPStatus, kind: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        for name, value in _SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        if body:
            self.wfile.write(body)


class StatusServer:
    """Serves the status page of one job (the chief, or the launcher).

    Args:
        host, port: Where to listen (port 0: a free one, see `port`).
        board: The job's reports.
        token: The cluster token; required off loopback.

    Raises:
        ValueError: A non-loopback address without a token.
    """

    def __init__(self, host: str, port: int, board: Board, token: str | None) -> None:
        self.loopback = is_loopback(host)
        if not self.loopback and not token:
            raise ValueError(
                "A status page on an address other than loopback must require the cluster token: anyone "
                f"who reaches it would see the job. Received: address {host}:{port}, no "
                "PHALANX_CLUSTER_TOKEN. HINT: set PHALANX_CLUSTER_TOKEN on every task (docs/security.md), "
                "or serve the page on 127.0.0.1 and reach it through an SSH tunnel."
            )
        self.host, self.board, self.token = host, board, token or None
        self._requested_port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port it listens on (after `start`)."""
        assert self._server is not None
        return int(self._server.server_address[1])

    def start(self) -> StatusServer:
        """Listens and serves on a daemon thread.

        Raises:
            ValueError: It cannot listen there (the port is taken, the address is not this machine's).
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self._server = _Server((self.host, self._requested_port), family, self)
        except OSError as exc:
            raise ValueError(
                f"The status page cannot listen at {self.host}:{self._requested_port} ({exc}). "
                "HINT: choose a free port of this machine's address in --status / PHALANX_STATUS_ADDRESS."
            ) from exc
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.5},
            name="phalanx-status",
            daemon=True,
        )
        self._thread.start()
        log.info("Status page at http://%s:%d/", self.host, self.port)
        return self

    def stop(self) -> None:
        """Stops serving (waits up to 5 s for the thread)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
