"""The parameter-server data path (`phalanx.ps.data_path.server`): outsiders, relays, bad frames.

Against a real `RpcServer` in its own process (tests/security/scripts/data_path_server.py)
whose ``assign`` runs on the data path and writes a canary line: a caller without the
cluster's credentials runs nothing; a relay that reads the wire sees none of a tensor's bytes;
a relay that flips one bit makes the call fail with `TaskUnavailableError` naming the task
(and nothing ran with the changed bytes); an authenticated peer's oversized or malformed frame
is refused without the server's peak resident memory growing with what was announced or sent.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

from phalanx.communication.transports.tls.links import tls_contexts
from phalanx.ps import wire
from phalanx.ps.data_path.client import DataClient
from phalanx.ps.data_path.frames import FRAME, MAGIC, Kind, read_frame, read_message, send_frame
from phalanx.ps.rpc.common import DATA_PATH_METHOD
from phalanx.ps.rpc.errors import MessageTooLargeError, TaskUnavailableError
from phalanx.ps.transport import RpcClient
from phalanx.security.certificates import task_certificate
from security.helpers import SCRIPTS
from security.impostor import own_tls_identity
from support.cluster import child_env

MIB = 1 << 20
SENT = 192 * MIB
GROWTH = 64 * MIB
TOKEN = "the-cluster-secret-0123456789ab"
PATTERN = b"TENSOR-BYTES-NOBODY-ELSE-MAY-READ"


class Server:
    """The server process: its gRPC address, data port, canary, log and peak memory."""

    def __init__(self, tmp_path, **env: str) -> None:
        self.canary = tmp_path / "canary.txt"
        self.insecure = env.get("PHALANX_INSECURE_TRANSPORT", "0") == "1"
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "data_path_server.py"), str(self.canary)],
            env=child_env({"PHALANX_CLUSTER_TOKEN": TOKEN, **env}),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("port "), f"the server did not start: {line}{self.proc.stderr.read()}"
        self.address = f"127.0.0.1:{int(line.split()[1])}"
        with contextlib.closing(self.client()) as client:  # what any caller gRPC let in learns
            header, _ = client._grpc_call(DATA_PATH_METHOD, None, (), 60, False)
        self.data_port = int(header["port"])
        self._log = b""  # what `log_until` read of its standard error

    def log_until(self, text: str, timeout: float = 60) -> str:
        """Its log so far, read until ``text`` appears while it runs (blocks).

        Raises:
            AssertionError: ``text`` did not appear within ``timeout`` seconds (the log says why).
        """
        fd, deadline = self.proc.stderr.fileno(), time.monotonic() + timeout
        while text.encode() not in self._log:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                pytest.fail(
                    f"the server did not log {text!r} within {timeout:g}s; it logged:\n{self._log.decode()}"
                )
            chunk = os.read(fd, 65536)
            if not chunk:
                pytest.fail(f"the server exited before it logged {text!r}; it logged:\n{self._log.decode()}")
            self._log += chunk
        return self._log.decode()

    def client(self) -> RpcClient:
        return RpcClient(self.address, TOKEN, name="ps:0 (test)", timeout=60)

    def data_client(self, port: int | None = None, segments: bool = False) -> DataClient:
        return DataClient(
            "127.0.0.1",
            port or self.data_port,
            TOKEN,
            name="ps:0 (test)",
            address=self.address,
            limit=1 << 30,
            insecure=self.insecure,
            segments=segments,
        )

    def peak_rss(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    def ran(self) -> list[str]:
        return self.canary.read_text().splitlines() if self.canary.exists() else []

    def stop(self) -> str:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("the server did not stop within 30s")
        return self._log.decode() + self.proc.stderr.read()


@pytest.fixture
def server(tmp_path):
    started = Server(tmp_path)
    yield started
    started.stop()


def _patterned(nbytes: int) -> torch.Tensor:
    data = (PATTERN * (nbytes // len(PATTERN) + 1))[:nbytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _request(tag: str) -> list[memoryview]:
    return wire.pack_parts({"tag": tag}, [_patterned(4096)])


def _outsider_contexts(tmp_path) -> dict[str, ssl.SSLContext | None]:
    """Ways in without the cluster's credentials (the cluster CA is public: trusting it is allowed)."""

    def context(cert: bytes | None = None, key: bytes | None = None) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if cert is not None and key is not None:
            (tmp_path / "c.pem").write_bytes(cert)
            (tmp_path / "k.pem").write_bytes(key)
            ctx.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
        return ctx

    other = task_certificate("another-cluster-secret-0123")
    return {
        "plaintext": None,
        "TLS without a client certificate": context(),
        "TLS with a self-signed certificate": context(*own_tls_identity()),
        "TLS with another token's CA": context(other.chain, other.key),
    }


def _try_as(context: ssl.SSLContext | None, port: int, parts: list[memoryview], hello: dict) -> None:
    with (
        socket.create_connection(("127.0.0.1", port), timeout=30) as raw,
        contextlib.suppress(OSError, ssl.SSLError),
    ):
        sock = raw if context is None else context.wrap_socket(raw)
        send_frame(sock, Kind.HELLO, wire.pack_parts(hello))
        send_frame(sock, Kind.REQUEST, parts, method="assign")
        while sock.recv(65536):
            pass


def test_callers_without_the_clusters_credentials_run_nothing_on_the_data_path(server, tmp_path):
    for how, context in _outsider_contexts(tmp_path).items():
        _try_as(context, server.data_port, _request(how), {"token": TOKEN})
    assert server.ran() == []
    with contextlib.closing(server.client()) as client:  # the cluster still gets through
        _, (back,) = client.call("assign", {"tag": "the cluster"}, [_patterned(4096)])
    assert torch.equal(back, _patterned(4096))
    assert server.ran() == [f"ran {{'tag': 'the cluster'}} {int(_patterned(4096).sum())}"]
    assert client._data is not None  # it went by the data path
    assert "refused a data-path connection" in server.stop()


def test_in_plaintext_mode_a_wrong_token_in_the_hello_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PHALANX_INSECURE_TRANSPORT", "1")
    server = Server(tmp_path, PHALANX_INSECURE_TRANSPORT="1")
    try:
        for token in ("", "a-wrong-token-0123456789"):
            _try_as(None, server.data_port, _request("wrong token"), {"token": token})
        assert server.ran() == []
        with contextlib.closing(server.data_client()) as client:
            client.call("assign", {"tag": "right token"}, [_patterned(16)], 60)
        assert server.ran()[-1].startswith("ran {'tag': 'right token'}")
    finally:
        log = server.stop()
    assert "wrong or missing cluster token" in log


class _Relay:
    """A TCP relay to ``port`` that records both directions and, with ``flip_at``, flips one bit
    of what the client sends at that byte."""

    def __init__(self, port: int, flip_at: int | None = None) -> None:
        self._target, self._flip_at = port, flip_at
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.sent, self.received = bytearray(), bytearray()
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self._target))

        def pump(source, sink, record, flip):
            with contextlib.suppress(OSError):
                while data := bytearray(source.recv(65536)):
                    start = len(record)
                    record.extend(data)
                    if flip is not None and start <= flip < len(record):
                        data[flip - start] ^= 0x01
                    sink.sendall(data)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

        threading.Thread(target=pump, args=(upstream, client, self.received, None), daemon=True).start()
        pump(client, upstream, self.sent, self._flip_at)
        self._listener.close()


@pytest.mark.parametrize("segments", [False, True], ids=["stream", "shared-memory"])
def test_a_relay_reading_the_wire_sees_no_tensor_bytes(server, segments):
    relay = _Relay(server.data_port)
    tensor = _patterned(256 * 1024)
    with contextlib.closing(server.data_client(relay.port, segments=segments)) as client:
        _, (back,) = client.call("assign", {"tag": "watched"}, [tensor], 60)
    assert torch.equal(back, tensor)
    assert len(relay.sent) > 0
    assert len(relay.received) > 0
    for seen in (relay.sent, relay.received):
        assert PATTERN not in seen
        assert PATTERN[:16] not in seen
        assert TOKEN.encode() not in seen
    if not segments:  # on the stream, every byte of the tensor crossed the relay, encrypted
        assert len(relay.sent) > tensor.numel()
        assert len(relay.received) > tensor.numel()


def test_a_relay_flipping_one_bit_fails_the_call_naming_the_task(server):
    relay = _Relay(server.data_port, flip_at=60_000)  # past the handshake, inside the tensor
    named = (
        r"ps:0 \(test\) (broke the TLS connection of the data path|closed its data-path connection) during"
    )
    with (
        contextlib.closing(server.data_client(relay.port)) as client,
        pytest.raises(TaskUnavailableError, match=named),
    ):
        client.call("assign", {"tag": "tampered"}, [_patterned(256 * 1024)], 60)
    # OpenSSL sends its alert as the record fails, before the server's thread logs: the client
    # may raise first, so the log is awaited while the server runs (a stop would end the thread)
    server.log_until("closed the data-path connection")
    assert server.ran() == []  # nothing ran with the changed bytes


def _authenticated(port: int) -> ssl.SSLSocket:
    """A connection with the cluster's own credentials, past the hello."""
    context = tls_contexts(task_certificate(TOKEN, ()))[1]
    context.check_hostname = False
    sock = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=60))
    send_frame(sock, Kind.HELLO, wire.pack_parts({}))
    _, _, _, length = read_frame(sock)
    read_message(sock, length)
    return sock


def _send_then_read_answer(port: int, head: bytes, garbage: int) -> dict | None:
    """Sends ``head`` then ``garbage`` bytes on an authenticated connection; the error the
    server answered (None: it closed without one)."""
    with contextlib.closing(_authenticated(port)) as sock:
        answer: dict | None = None
        with contextlib.suppress(OSError, ssl.SSLError, ConnectionError):
            sock.sendall(head)
            kind, _, _, length = read_frame(sock)
            if kind == Kind.ERROR:
                answer = read_message(sock, length)[0]["error"]
        with contextlib.suppress(OSError, ssl.SSLError):  # the server closed: the rest goes nowhere
            chunk = bytes(range(256)) * 4096
            for _ in range(garbage // len(chunk)):
                sock.sendall(chunk)
        return answer


def _frame(length: int, method: bytes = b"assign", magic: bytes = MAGIC) -> bytes:
    return FRAME.pack(magic, int(Kind.REQUEST), 0, len(method), length) + method


def _lying_header(length: int) -> bytes:
    """A message prefix and header announcing a tensor far larger than ``length``."""
    body = b'{"__tensors__": [["float32", [1099511627776], 4398046511104]]}'
    return _frame(length) + wire.MAGIC + struct.pack("<I", len(body)) + body


def test_oversized_and_malformed_frames_from_an_authenticated_peer_do_not_grow_the_server(server):
    with contextlib.closing(server.client()) as client:  # warm up: threads and buffers exist
        client.call("assign", {"tag": "warm-up"}, [_patterned(16)])
    before = server.peak_rss()
    oversized = _send_then_read_answer(server.data_port, _frame(2 << 30), SENT)
    assert oversized is not None
    assert oversized["type"] == MessageTooLargeError.__name__
    lying = _send_then_read_answer(server.data_port, _lying_header(SENT), SENT)
    assert lying is not None
    assert "tensors of 4398046511104 bytes" in lying["message"]
    assert _send_then_read_answer(server.data_port, _frame(16, magic=b"JUNK"), SENT) is None
    assert _send_then_read_answer(server.data_port, _frame(16, method=b"m" * 5000), SENT) is None
    grown = server.peak_rss() - before
    assert grown < GROWTH, f"the server's peak RSS grew by {grown / MIB:.0f} MiB"
    assert server.ran() == [f"ran {{'tag': 'warm-up'}} {int(_patterned(16).sum())}"]
    with contextlib.closing(server.data_client()) as client:  # still serving; and the control:
        client.call("assign", {"tag": "after"}, [torch.zeros(SENT, dtype=torch.uint8)], 120)
    assert server.ran()[-1] == "ran {'tag': 'after'} 0"
    assert server.peak_rss() - before > GROWTH  # an authenticated request of that size is read
    log = server.stop()
    assert "refused a frame" in log
