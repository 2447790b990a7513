"""The status server on 127.0.0.1 (a real socket): the page, /status.json, reports, and who
may ask: loopback reads are open, reports and anything off loopback need the cluster token."""

from __future__ import annotations

import http.client
import json
import re
import socket

import pytest

from phalanx.status.board import Board
from phalanx.status.page import render_page
from phalanx.status.reports import TOKEN_HEADER, Reporter
from phalanx.status.server import MAX_BODY, StatusServer, is_loopback

TOKEN = "t0ken-for-the-status-tests"  # noqa: S105 - a test's token


@pytest.fixture
def server():
    serving = StatusServer("127.0.0.1", 0, Board(secrets=(TOKEN,)), TOKEN).start()
    yield serving
    serving.stop()


def _ask(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path, body, headers or {})
        answer = connection.getresponse()
        return answer.status, dict(answer.getheaders()), answer.read()
    finally:
        connection.close()


def _report(**fields) -> bytes:
    return json.dumps({"task": "worker:0", "pid": 7, "host": "h", "state": "running", **fields}).encode()


def test_the_page_is_one_document_with_everything_inline(server):
    status, headers, body = _ask(server.port, "GET", "/")
    assert status == 200
    page = body.decode()
    assert "<script>" in page
    assert "<style>" in page
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page)  # nothing fetched elsewhere
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert "fetch('status.json'" in page


def test_a_report_shows_in_status_json(server):
    status, _, _ = _ask(server.port, "POST", "/report", _report(step=3), {TOKEN_HEADER: TOKEN})
    assert status == 204
    status, headers, body = _ask(server.port, "GET", "/status.json")
    assert status == 200
    assert headers["Content-Type"] == "application/json"
    (row,) = json.loads(body)["workers"]
    assert (row["task"], row["pid"], row["state"], row["step"]) == ("worker:0", 7, "running", 3)


def test_a_reporter_reaches_the_server(server):
    reporter = Reporter("worker:3", f"127.0.0.1:{server.port}", TOKEN)
    assert reporter.send()
    assert [row["task"] for row in server.board.snapshot()["workers"]] == ["worker:3"]
    assert not Reporter("worker:4", f"127.0.0.1:{server.port}", "a-wrong-token-value").send()


@pytest.mark.parametrize("given", [None, "a-wrong-token-value"])
def test_reports_need_the_token(server, given):
    headers = {TOKEN_HEADER: given} if given else {}
    status, _, body = _ask(server.port, "POST", "/report", _report(), headers)
    assert status == 401
    assert b"needs the cluster token" in body
    assert server.board.snapshot()["workers"] == []


def test_bad_requests(server):
    auth = {TOKEN_HEADER: TOKEN}
    assert _ask(server.port, "GET", "/secrets")[0] == 404
    assert _ask(server.port, "POST", "/elsewhere", b"{}", auth)[0] == 404
    assert _ask(server.port, "POST", "/report", b"x" * (MAX_BODY + 1), auth)[0] == 413
    status, _, body = _ask(server.port, "POST", "/report", b"{not json", auth)
    assert status == 400
    status, _, body = _ask(server.port, "POST", "/report", b'{"task": 1}', auth)
    assert status == 400
    assert b"A status report must be a JSON object" in body


def test_off_loopback_the_server_needs_a_token():
    with pytest.raises(ValueError, match=r"must require the cluster token.*Received: address 0.0.0.0:0, no"):
        StatusServer("0.0.0.0", 0, Board(), None)  # noqa: S104 - the address refused


def test_off_loopback_every_request_needs_the_token():
    serving = StatusServer("0.0.0.0", 0, Board(), TOKEN).start()  # noqa: S104 - checks the token
    try:
        assert _ask(serving.port, "GET", "/status.json")[0] == 401
        assert _ask(serving.port, "GET", "/")[0] == 401
        assert _ask(serving.port, "GET", "/status.json", headers={TOKEN_HEADER: TOKEN})[0] == 200
        assert _ask(serving.port, "GET", f"/?token={TOKEN}")[0] == 200  # a browser's way
    finally:
        serving.stop()


def test_a_taken_port_is_refused(server):
    with pytest.raises(ValueError, match=r"cannot listen at 127.0.0.1:\d+ .*HINT: choose a free port"):
        StatusServer("127.0.0.1", server.port, Board(), None).start()


def test_too_many_connections_are_closed_not_queued(server):
    idle = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(16)]
    try:  # 16 clients that send nothing hold every slot until their reads time out
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        assert extra.recv(1) == b""  # closed at once
        extra.close()
    finally:
        for s in idle:
            s.close()


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.0.1", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("node-1", False),
    ],
)  # noqa: S104
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_reported_text_cannot_end_the_pages_script():
    board = Board()
    board.receive(
        {"task": "worker:0", "pid": 1, "host": "</script><script>alert(1)</script>", "state": "running"}
    )
    page = render_page(board.snapshot())
    assert page.count("</script>") == 2  # the JSON block's and the script's, nothing from the data
    assert "\\u003c/script\\u003e" in page
