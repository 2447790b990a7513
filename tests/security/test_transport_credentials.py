"""Credentials of the parameter-server transport: wrong, missing, replayed; oversized and garbage.

Against a real `RpcServer` in its own process (tests/security/scripts/rpc_server.py) whose
``run`` handler writes a canary line: each test proves that the handler never ran for a
caller without the cluster's credentials (nothing ran), that the caller learnt nothing but a
refusal (nothing leaked), that the server still serves its own cluster afterwards and that
every call ended (nothing hung), and, for oversized and garbage requests, that the server's
resident memory did not grow with what was sent (measured in /proc, no timing thresholds).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from grpc import StatusCode

from phalanx.ps import wire
from phalanx.ps.transport import PeerAuthenticationError, RpcClient
from phalanx.security.certificates import task_certificate
from security.helpers import SCRIPTS
from security.impostor import own_tls_identity
from support.cluster import child_env

MIB = 1 << 20
SENT = 256 * MIB  # per oversized request: far above what the server may buffer
GROWTH = 64 * MIB  # what RSS may grow by (allocator noise, gRPC's buffers): far below SENT
TOKEN = "the-cluster-secret-0123456789ab"


class Server:
    """The server process: its address, canary and resident memory."""

    def __init__(self, tmp_path, **env: str) -> None:
        self.canary = tmp_path / "canary.txt"
        self.env = child_env({"PHALANX_CLUSTER_TOKEN": TOKEN, **env})
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "rpc_server.py"), str(self.canary)],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        line = self.proc.stdout.readline()
        assert line.startswith("port "), f"the server did not start: {line}{self.proc.stderr.read()}"
        self.address = f"127.0.0.1:{int(line.split()[1])}"

    def peak_rss(self) -> int:
        """The most resident memory the server ever had, in bytes (VmHWM): a request it
        buffered shows here even if it was freed before the measurement (VmRSS alone raced
        with the server freeing the control request)."""
        with open(f"/proc/{self.proc.pid}/status") as status:
            line = next(line for line in status if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024

    def ran(self) -> list[str]:
        return self.canary.read_text().splitlines() if self.canary.exists() else []

    def call_as_the_cluster(self, header: dict, size: int = 0) -> None:
        """A call with the cluster's credentials (and ``size`` bytes of tensor): the server
        still serves (nothing hung)."""
        tensors = [torch.zeros(size, dtype=torch.uint8)] if size else []
        with contextlib.closing(RpcClient(self.address, TOKEN, name="worker:0 (test)", timeout=60)) as client:
            client.call("run", header, tensors)

    def stop(self) -> str:
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail("the server did not stop within 30s")
        return self.proc.stderr.read()


@pytest.fixture
def server(tmp_path):
    started = Server(tmp_path)
    yield started
    started.stop()


def _request(tag: str, size: int = 0) -> bytes:
    return wire.pack({"tag": tag}, [torch.zeros(size, dtype=torch.uint8)] if size else [])


def _refused(channel: grpc.Channel, request: bytes, metadata=()) -> grpc.StatusCode:
    """Calls ``run`` on ``channel`` expecting a refusal; returns its code."""
    with pytest.raises(grpc.RpcError) as info:
        channel.unary_unary("/phalanx.Task/run")(request, timeout=60, metadata=metadata)
    channel.close()
    return info.value.code()


def _options(size: int = SENT) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", 2 * size), ("grpc.max_receive_message_length", 2 * size)]


def _outsider_channels(address: str) -> dict[str, grpc.Channel]:
    """Ways in without the cluster's credentials, from nothing to everything but the CA key."""
    cluster_ca = task_certificate(TOKEN).ca  # public: every task shows it in its handshake
    own_cert, own_key = own_tls_identity()
    other = task_certificate("another-cluster-secret-0123")
    return {
        "plaintext": grpc.insecure_channel(address, options=_options()),
        "TLS without a client certificate": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(cluster_ca), options=_options()
        ),
        "TLS with a self-signed certificate": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(cluster_ca, own_key, own_cert), options=_options()
        ),
        "TLS with another token's CA": grpc.secure_channel(
            address, grpc.ssl_channel_credentials(cluster_ca, other.key, other.chain), options=_options()
        ),
    }


def test_callers_without_the_clusters_credentials_never_reach_a_handler(server):
    for how, channel in _outsider_channels(server.address).items():
        code = _refused(channel, _request(how), metadata=(("phalanx-token", TOKEN),))
        assert code == grpc.StatusCode.UNAVAILABLE, how  # the connection failed: no call was made
    assert server.ran() == []
    server.call_as_the_cluster({"tag": "the cluster"})
    assert server.ran() == ["ran {'tag': 'the cluster'}"]


class _Recorder:
    """A TCP relay between a client and the server that records what the client sent."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.sent = bytearray()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        client, _ = self._listener.accept()
        upstream = socket.create_connection(self._target)

        def pump(source, sink, record):
            with contextlib.suppress(OSError):
                while data := source.recv(65536):
                    if record:
                        self.sent.extend(data)
                    sink.sendall(data)
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, client, False), daemon=True)
        back.start()
        pump(client, upstream, True)
        back.join(timeout=30)
        client.close()
        upstream.close()
        self._listener.close()


class _SlowRelay:
    """A TCP relay that holds the server's first bytes of every connection (its TLS
    ServerHello) for ``delay`` seconds: a handshake as slow as on a loaded machine."""

    def __init__(self, target: str, delay: float) -> None:
        host, port = target.rsplit(":", 1)
        self._target, self._delay = (host, int(port)), delay
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self._target)
                threading.Thread(target=self._pump, args=(upstream, client, self._delay), daemon=True).start()
                threading.Thread(target=self._pump, args=(client, upstream, 0.0), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket, delay: float) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                time.sleep(delay)
                delay = 0.0
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()


def test_a_slow_handshake_is_waited_for_not_taken_for_an_impostor(server):
    # gRPC gives a connection attempt at least grpc.min_reconnect_backoff_ms: at 100 ms a
    # handshake slowed by a loaded machine failed and was reported as PeerAuthenticationError
    relay = _SlowRelay(server.address, delay=0.5)
    try:
        client = RpcClient(relay.address, TOKEN, name="worker:0 (test)", timeout=60)
        with contextlib.closing(client):
            client.call("run", {"tag": "slow"})
    finally:
        relay.close()
    assert server.ran() == ["ran {'tag': 'slow'}"]


def test_a_recorded_call_replayed_to_the_server_runs_nothing(server):
    recorder = _Recorder(server.address)
    with contextlib.closing(RpcClient(recorder.address, TOKEN, name="worker:0 (test)", timeout=60)) as client:
        client.call("run", {"tag": "recorded"})
    assert server.ran() == ["ran {'tag': 'recorded'}"]
    assert len(recorder.sent) > 0
    assert TOKEN.encode() not in recorder.sent  # the token never travels
    for _ in range(3):  # the exact bytes of the authenticated call, on fresh connections
        with socket.create_connection(server.address.rsplit(":", 1)) as replay:
            replay.settimeout(30)
            replay.sendall(bytes(recorder.sent))
            with contextlib.suppress(OSError):  # the server ends the connection (reset or close)
                while replay.recv(65536):
                    pass
    assert server.ran() == ["ran {'tag': 'recorded'}"]  # the replays ran nothing


def _send_garbage(address: str, size: int) -> None:
    chunk = bytes(range(256)) * 4096  # 1 MiB that is neither a TLS record nor HTTP/2
    with socket.create_connection(address.rsplit(":", 1)) as sock:
        sock.settimeout(30)
        with contextlib.suppress(OSError):  # the server closes the connection early: good
            for _ in range(size // len(chunk)):
                sock.sendall(chunk)


@pytest.mark.parametrize("insecure", ["0", "1"], ids=["tls", "plaintext-opt-out"])
def test_oversized_and_garbage_unauthenticated_requests_do_not_grow_the_servers_memory(
    tmp_path, insecure, monkeypatch
):
    """1 GiB of unauthenticated requests under the (default, 1 GiB) size limit and 512 MiB of
    garbage leave the server's peak RSS flat: nothing is read before authentication, in TLS mode
    by the handshake, in plaintext mode by the interceptor. The control: one authenticated
    request of the same size does grow it, so the measurement would see a leak."""
    monkeypatch.setenv("PHALANX_INSECURE_TRANSPORT", insecure)  # for this process's RpcClient
    server = Server(tmp_path, PHALANX_INSECURE_TRANSPORT=insecure)
    try:
        server.call_as_the_cluster({"tag": "warm-up"})  # gRPC's threads and buffers exist now
        before = server.peak_rss()
        big = _request("oversized", SENT)
        attempts = []
        for _ in range(2):
            for channel in _outsider_channels(server.address).values():
                metadata = (("phalanx-token", "a-wrong-token-0123456789"),)
                attempts.append(_refused(channel, big, metadata))
            _send_garbage(server.address, SENT)
        grown = server.peak_rss() - before
        assert grown < GROWTH, f"the server's peak RSS grew by {grown / MIB:.0f} MiB"
        assert server.ran() == ["ran {'tag': 'warm-up'}"]
        assert set(attempts) <= {StatusCode.UNAVAILABLE, StatusCode.UNAUTHENTICATED}, attempts
        server.call_as_the_cluster({"tag": "after"}, SENT)  # still serving; and the control:
        assert server.ran()[-1] == "ran {'tag': 'after'}"
        assert server.peak_rss() - before > GROWTH  # an authenticated request of that size is read
    finally:
        log = server.stop()
    if insecure == "1":
        assert "refused a call to /phalanx.Task/run: wrong or missing cluster token" in log


def test_an_impostor_client_learns_nothing_from_the_refusal(server):
    impostor = RpcClient(server.address, "another-cluster-secret-0123", name="worker:0 (test)")
    with contextlib.closing(impostor), pytest.raises(PeerAuthenticationError) as info:
        impostor.call("run", {"tag": "impostor"})
    assert TOKEN not in str(info.value)
    assert server.ran() == []
