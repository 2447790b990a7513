"""The point-to-point TLS links between any two workers (`phalanx.communication.transports.tls.peers`),
which carry ``send``/``recv`` when a job's collectives go over TLS: real TLS connections on
127.0.0.1 between workers made on threads of this process. A peer without the token is
refused in the handshake both ways, what travels is unreadable, and every failure names the
worker."""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time

import pytest
import torch
import torch.distributed as dist

from phalanx.communication.group.work import PeerGoneError
from phalanx.communication.transports.tls.endpoint import TlsEndpoint, tls_contexts
from phalanx.communication.transports.tls.peers import TlsPeers
from phalanx.security.certificates import task_certificate
from security.redirecting import Redirecting, worker_name

TOKEN = "the-cluster-secret-0123456789abcdef"
OTHER = "another-clusters-secret-0123456789"
MARKER = 4321.8765  # a value whose bytes must never be seen on the wire
KEY = "tls-p2p/addr/{}"


def _peers(world, store=None, redirect=None, timeout=5.0):
    store = store or dist.HashStore()
    made = []
    for rank in range(world):
        view = Redirecting(store, KEY.format(2), redirect) if rank == 0 and redirect is not None else store
        made.append(
            TlsPeers(
                TlsEndpoint("127.0.0.1", ("127.0.0.1", 1), TOKEN),
                view,
                rank,
                world,
                worker_name,
                lambda: None,
                timeout,
            )
        )
    return made


def _close(peers):
    for p in peers:
        p.close()


def _port(store, rank):
    return lambda: int(store.get(KEY.format(rank)).decode().split("|")[1])


def test_any_two_workers_exchange_messages_matched_by_tag_and_group():
    peers = _peers(3)
    try:
        group = [p.channel("0", [0, 1, 2]) for p in peers]
        other = [p.channel("1", [2, 0]) for p in peers]  # another torch group: ranks of its own
        sends = [
            group[0].send_async(torch.tensor([1.0, 1.0]), 2, tag=1),
            group[0].send_async(torch.tensor([2.0, 2.0]), 2, tag=2),
            other[0].send_async(torch.tensor([3.0, 3.0]), 0, tag=1),  # group rank 0 = worker 2
        ]
        got = {tag: torch.zeros(2) for tag in ("two", "one", "other")}
        works = [
            group[2].recv_async(got["two"], 0, 2),  # tags taken out of the order they were sent
            group[2].recv_async(got["one"], 0, 1),
            other[2].recv_async(got["other"], 1, 1),
        ]
        for work in [*sends, *(w for w, _ in works)]:
            work.wait()
        assert [got[k].tolist() for k in ("one", "two", "other")] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
        anyone = torch.zeros(1)
        work, sender = group[1].recv_async(anyone, None, 9)
        group[2].send_async(torch.tensor([7.0]), 1, 9).wait()
        work.wait()
        assert anyone.item() == 7.0
        assert sender() == 2
    finally:
        _close(peers)


def test_what_travels_between_two_workers_is_encrypted():
    store = dist.HashStore()
    seen = bytearray()
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(source, sink, record):
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                sink.close()
                return
            if record:
                seen.extend(data)
            try:
                sink.sendall(data)
            except OSError:
                return

    def relay():  # rank 0 -> here -> rank 2, recording what rank 0 sends
        inside, _ = listener.accept()
        outside = socket.create_connection(("127.0.0.1", _port(store, 2)()))
        threading.Thread(target=pump, args=(outside, inside, False), daemon=True).start()
        pump(inside, outside, True)

    threading.Thread(target=relay, daemon=True).start()
    peers = _peers(3, store, redirect=lambda: listener.getsockname()[1])
    try:
        into = torch.zeros(4096)
        work, _ = peers[2].recv_async(into, 0, 0, channel=5, what="recv")
        peers[0].send_async(torch.full((4096,), MARKER), 2, 0, channel=5).wait()
        work.wait()
        assert torch.equal(into, torch.full((4096,), MARKER))  # through the relay
        assert len(seen) > 4096 * 4
        assert torch.tensor([MARKER]).numpy().tobytes() not in seen
        assert TOKEN.encode() not in seen
    finally:
        _close(peers)
        listener.close()


def test_an_impostor_at_a_peers_address_fails_the_handshake_names_the_peer_and_gets_nothing():
    received = bytearray()
    server, _ = tls_contexts(task_certificate(OTHER, ["127.0.0.1"]))
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():  # holds a certificate of another CA; records any application bytes
        raw, _ = listener.accept()
        try:
            tls = server.wrap_socket(raw, server_side=True)
            received.extend(tls.recv(1024))
        except (OSError, ssl.SSLError):
            pass

    threading.Thread(target=impostor, daemon=True).start()
    peers = _peers(3, redirect=lambda: listener.getsockname()[1])
    try:
        work = peers[0].send_async(torch.full((8,), MARKER), 2, 0, channel=5)
        with pytest.raises(PeerGoneError) as failed:
            work.wait()
        message = str(failed.value)
        assert message.startswith(
            "worker:2 (127.0.0.1:2222) failed the TLS handshake of its point-to-point link ("
        )
        assert "does not hold this cluster's token or certificate" in message
        time.sleep(0.2)
        assert received == bytearray()  # not even the hello
        with pytest.raises(PeerGoneError, match="worker:2"):  # the link stays refused
            peers[0].send_async(torch.zeros(1), 2, 0, channel=5).wait()
    finally:
        _close(peers)
        listener.close()


@pytest.mark.parametrize("who", ["no TLS", "another token", "a worker's name twice"])
def test_a_stranger_that_dials_a_workers_link_is_refused_and_the_workers_still_talk(who, caplog):
    caplog.set_level(logging.WARNING, logger="phalanx")
    store = dist.HashStore()
    peers = _peers(2, store)
    try:
        if who == "a worker's name twice":  # the real worker:0 links first
            peers[0].send_async(torch.zeros(1), 1, 0, channel=5).wait()
        raw = socket.create_connection(("127.0.0.1", _port(store, 1)()))
        try:
            if who == "no TLS":
                raw.sendall(b"\x00" * 8 + b"tls-p2p".ljust(32, b"\x00"))  # a plaintext hello
                raw.recv(1)
            else:
                token = OTHER if who == "another token" else TOKEN
                _, client = tls_contexts(task_certificate(token, ["127.0.0.1"]))
                client.check_hostname = False
                tls = client.wrap_socket(raw, server_hostname=None)
                tls.sendall(b"\x00" * 8 + b"tls-p2p".ljust(32, b"\x00"))  # "I am worker:0"
                tls.sendall(b"\x00" * 24)  # a frame header, if it were read
                tls.recv(1)
        except (OSError, ssl.SSLError):
            pass
        finally:
            raw.close()
        deadline = time.monotonic() + 10
        while "A point-to-point TLS link refused" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        into = torch.zeros(1)
        work, receive = peers[1].recv_async(into, 0, 3, channel=5, what="recv")
        peers[0].send_async(torch.tensor([5.0]), 1, 3, channel=5).wait()
        work.wait()
        assert into.item() == 5.0
        assert receive.sender == 0
    finally:
        _close(peers)


def test_a_peer_that_closes_fails_the_receives_posted_for_it_naming_it():
    peers = _peers(2)
    try:
        peers[0].send_async(torch.zeros(1), 1, 0, channel=5).wait()  # the link is open
        work, _ = peers[1].recv_async(torch.zeros(1), 0, 1, channel=5, what="recv")
        peers[0].close()
        with pytest.raises(
            PeerGoneError, match=r"worker:0 \(127\.0\.0\.1:2220\) closed its point-to-point link"
        ):
            work.wait(timeout=None)
        with pytest.raises(ValueError, match=r"another worker of the job \(0..1 but not itself, 1\)"):
            peers[1].send_async(torch.zeros(1), 1, 0, channel=5)
    finally:
        _close(peers)


def test_a_peer_outside_the_group_is_refused_saying_which_ranks_it_has():
    peers = _peers(2)
    try:
        pair = peers[0].channel("3", [0, 1])
        with pytest.raises(ValueError, match=r"a rank of the group \(0..1\). Received: 2"):
            pair.send_async(torch.zeros(1), 2, 0)
        assert pair.describe("recv from", 1, 4) == "recv from worker:1 (127.0.0.1:2221) with tag 4"
        assert pair.describe("recv from", None, 4) == "recv from any worker with tag 4"
    finally:
        _close(peers)
