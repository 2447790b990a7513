"""The TLS ring that carries MultiWorkerMirrored collectives between machines
(`phalanx.communication.transports.tls.ring`): real TLS connections on 127.0.0.1 between rings made on
threads of this process. What travels is unreadable and tamper-evident, a peer without the
token is refused in the handshake both ways, and every failure names the worker."""

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
from phalanx.communication.transports.choice import collectives_mode, ring_if_needed
from phalanx.communication.transports.tls import links as tls_links
from phalanx.communication.transports.tls import ring as tls_ring
from phalanx.communication.transports.tls.endpoint import TlsEndpoint
from phalanx.communication.transports.tls.links import RingLinks
from phalanx.communication.transports.tls.ring import TlsRing
from phalanx.security.certificates import task_certificate
from security.redirecting import Redirecting, worker_name

TOKEN = "the-cluster-secret-0123456789abcdef"
OTHER = "another-clusters-secret-0123456789"
MARKER = 1234.5678  # a value whose bytes must never be seen on the wire


def _ring(store, rank, world, failure, timeout):
    """Worker ``rank``'s ring on 127.0.0.1 with the cluster's token (blocks until connected)."""
    links = RingLinks(store, rank, world, TlsEndpoint("127.0.0.1", ("127.0.0.1", 1), TOKEN), worker_name)
    return TlsRing(links, failure, timeout)


def _rings(world, store=None, redirect=None, timeout=10.0, first=None):
    """``world`` rings made at once on threads; each entry a ring or the error it raised.
    ``first``: ``(rank, then)``: that rank starts alone, ``then()`` runs once it published its
    address, and the others start after."""
    store = store or dist.HashStore()
    made = [None] * world

    def make(rank):
        view = Redirecting(store, "tls-ring/addr/1", redirect) if rank == 0 else store
        try:
            made[rank] = _ring(view, rank, world, lambda: None, timeout)
        except Exception as exc:
            made[rank] = exc

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    if first is not None:
        rank, then = first
        threads[rank].start()
        _wait_for_key(store, f"tls-ring/addr/{rank}")
        then()
    for thread in threads:
        if not thread.is_alive() and thread.ident is None:
            thread.start()
    for thread in threads:
        thread.join(timeout + 10)
    return made


def _wait_for_key(store, key):
    deadline = time.monotonic() + 10
    while not store.check([key]):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _close(rings):
    for ring in rings:
        if isinstance(ring, TlsRing):
            ring.close()


def _both(rings, issue):
    """Issues a collective on every ring (each its own tensor) and waits for all of them."""
    works = [issue(rank, ring) for rank, ring in enumerate(rings)]
    for work in works:
        work.wait()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_every_collective_gives_the_same_bits_on_every_worker(world, dtype):
    rings = _rings(world)
    try:
        sizes = [0, 1, 7, tls_ring.PIECE_BYTES // 4 * 3 + 5]  # empty, tiny, odd, several pieces
        for numel in sizes:
            values = [(torch.arange(numel) * (r + 1) % 97).to(dtype) for r in range(world)]
            for op, combine in ((dist.ReduceOp.SUM, torch.add), (dist.ReduceOp.MAX, torch.maximum)):
                tensors = [v.clone() for v in values]
                _both(rings, lambda r, ring, op=op, t=tensors: ring.all_reduce_async(t[r], op))
                expected = values[0]
                for v in values[1:]:
                    expected = combine(expected, v)
                assert all(torch.equal(t, expected) for t in tensors), (numel, op)
            sent = [
                values[r].clone() if r == world - 1 else torch.zeros_like(values[r]) for r in range(world)
            ]
            _both(rings, lambda r, ring, s=sent: ring.broadcast_async(s[r], world - 1))
            assert all(torch.equal(s, values[world - 1]) for s in sent)
            gathered = [ring.all_gather_async(values[r]) for r, ring in enumerate(rings)]
            for work, _ in gathered:
                work.wait()
            assert all(all(torch.equal(o, values[i]) for i, o in enumerate(out)) for _, out in gathered)
        floats = [torch.randn(1001, generator=torch.Generator().manual_seed(r)) for r in range(world)]
        _both(rings, lambda r, ring: ring.all_reduce_async(floats[r]))
        assert all(torch.equal(f, floats[0]) for f in floats)  # one order of additions everywhere
    finally:
        _close(rings)


class _Relay:
    """A man in the middle between rank 0 and rank 1: records what rank 0 sends and, with
    ``flip_after``, flips one bit of it past that many bytes."""

    def __init__(self, target_port, flip_after=None):
        self.seen = bytearray()
        self._target, self._flip_after = target_port, flip_after
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        inside, _ = self._listener.accept()
        outside = socket.create_connection(("127.0.0.1", self._target()))
        threading.Thread(target=self._pump, args=(outside, inside, False), daemon=True).start()
        self._pump(inside, outside, True)

    def _pump(self, source, sink, record):
        flipped = False
        while True:
            try:
                data = bytearray(source.recv(65536))
            except OSError:
                data = bytearray()
            if not data:
                sink.close()
                return
            if record:
                start = len(self.seen)
                self.seen += data
                if self._flip_after is not None and not flipped and start + len(data) > self._flip_after:
                    data[max(self._flip_after - start, 0)] ^= 0x01
                    flipped = True
            try:
                sink.sendall(data)
            except OSError:
                return


def _real_port(store, rank):
    return lambda: int(store.get(f"tls-ring/addr/{rank}").decode().split("|")[1])


def test_what_travels_is_encrypted_and_nothing_readable_is_on_the_wire():
    store = dist.HashStore()
    relay = _Relay(_real_port(store, 1))
    rings = _rings(2, store, redirect=lambda: relay.port)
    try:
        tensors = [torch.full((4096,), MARKER), torch.full((4096,), MARKER)]
        _both(rings, lambda r, ring: ring.all_reduce_async(tensors[r]))
        assert torch.equal(tensors[0], torch.full((4096,), 2 * MARKER))  # it went through the relay
        assert len(relay.seen) > 4096 * 4 // 2  # rank 0's half of the tensor passed it
        for value in (MARKER, 2 * MARKER):
            assert torch.tensor([value]).numpy().tobytes() not in relay.seen
        assert TOKEN.encode() not in relay.seen
    finally:
        _close(rings)


def test_a_tampered_byte_fails_the_collective_naming_the_sender_instead_of_changing_a_number():
    store = dist.HashStore()
    relay = _Relay(_real_port(store, 1), flip_after=6000)  # past the handshake, inside the data
    rings = _rings(2, store, redirect=lambda: relay.port)
    try:
        tensors = [torch.ones(100_000), torch.ones(100_000)]
        works = [ring.all_reduce_async(tensors[r]) for r, ring in enumerate(rings)]
        with pytest.raises(PeerGoneError, match=r"worker:0 \(127\.0\.0\.1:2220\) broke its TLS connection"):
            works[1].wait()
        rings[1].close()  # the receiver gives up; the sender learns it as a closed connection
        with pytest.raises(PeerGoneError, match="worker:1"):
            works[0].wait()
    finally:
        _close(rings)


def _impostor_server(token, received):
    """A TLS server holding a certificate of ``token``'s CA; records any application bytes."""
    cert = task_certificate(token, ["127.0.0.1"])
    server, _ = tls_links.tls_contexts(cert)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        raw, _ = listener.accept()
        try:
            tls = server.wrap_socket(raw, server_side=True)
            received.extend(tls.recv(1024))
        except (OSError, ssl.SSLError):
            pass

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1]


def test_an_impostor_at_the_next_workers_address_fails_the_handshake_and_gets_nothing():
    received = bytearray()
    port = _impostor_server(OTHER, received)
    rings = _rings(2, redirect=lambda: port, timeout=5.0)
    try:
        assert isinstance(rings[0], PeerGoneError)
        assert str(rings[0]).startswith(
            "worker:1 (127.0.0.1:2221) failed the TLS handshake of the TLS ring ("
        )
        assert "does not hold this cluster's token or certificate" in str(rings[0])
        time.sleep(0.2)
        assert received == bytearray()  # not even the hello: nothing was sent to it
    finally:
        _close(rings)


@pytest.mark.parametrize("who", ["no TLS", "another token"])
def test_a_stranger_that_dials_a_worker_first_is_refused_and_the_ring_still_forms(who, caplog):
    store = dist.HashStore()
    caplog.set_level(logging.WARNING, logger="phalanx")
    stranger_done = threading.Event()

    def stranger():  # dials worker:1 before worker:0 does
        port = _real_port(store, 1)()
        raw = socket.create_connection(("127.0.0.1", port))
        try:
            if who == "no TLS":
                raw.sendall(b"\x00" * 8 + b"tls-ring".ljust(32, b"\x00"))  # a plaintext hello
                raw.recv(1)
            else:
                _, client = tls_links.tls_contexts(task_certificate(OTHER, ["127.0.0.1"]))
                client.check_hostname = False
                client.wrap_socket(raw, server_hostname=None)
        except (OSError, ssl.SSLError):
            pass
        finally:
            raw.close()
            stranger_done.set()

    rings = _rings(2, store, first=(1, stranger))
    try:
        assert all(isinstance(r, TlsRing) for r in rings), rings
        assert stranger_done.is_set()
        tensors = [torch.tensor([1.0]), torch.tensor([2.0])]
        _both(rings, lambda r, ring: ring.all_reduce_async(tensors[r]))
        assert tensors[0].item() == 3.0
        assert "The TLS ring refused a connection from" in caplog.text
    finally:
        _close(rings)


def test_a_peer_that_closes_mid_collective_is_named_at_once():
    rings = _rings(2)
    try:
        work = rings[0].all_reduce_async(torch.ones(10))
        time.sleep(0.3)
        start = time.monotonic()
        rings[1].close()
        with pytest.raises(PeerGoneError, match=r"worker:1 \(127\.0\.0\.1:2221\) closed its connection"):
            work.wait()
        assert time.monotonic() - start < 5
        later = rings[0].all_reduce_async(torch.ones(10))  # the ring stays broken: at once
        with pytest.raises(PeerGoneError):
            later.wait()
    finally:
        _close(rings)


def test_workers_calling_different_collectives_fail_saying_so():
    rings = _rings(2)
    try:
        works = [rings[0].all_reduce_async(torch.ones(4)), rings[1].all_reduce_async(torch.ones(8))]
        for work in works:
            with pytest.raises(PeerGoneError, match="the workers called different collectives"):
                work.wait()
    finally:
        _close(rings)


def test_a_dead_peer_known_to_the_health_check_ends_a_wait():
    store, dead = dist.HashStore(), []
    made = [None, None]

    def make(rank):
        made[rank] = _ring(store, rank, 2, lambda: dead[0] if dead else None, 10)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    try:
        work = made[0].all_reduce_async(torch.ones(10))  # worker:1 never joins in: it hangs
        dead.append("worker:1 (127.0.0.1:2221) stopped sending heartbeats 10s ago")
        with pytest.raises(PeerGoneError, match="stopped sending heartbeats"):
            work.wait()
    finally:
        _close(made)


def test_a_reduction_the_ring_cannot_do_is_refused_with_what_to_do():
    rings = _rings(2)
    try:
        with pytest.raises(
            ValueError, match="SUM, PRODUCT, MAX or MIN.*HINT: all-reduce with SUM and divide"
        ):
            rings[0].all_reduce_async(torch.ones(2), dist.ReduceOp.AVG)
    finally:
        _close(rings)


def test_the_choice_of_transport(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="phalanx")
    monkeypatch.delenv("PHALANX_INSECURE_TRANSPORT", raising=False)
    monkeypatch.setenv("PHALANX_COLLECTIVES", "tsl")
    with pytest.raises(ValueError, match="PHALANX_COLLECTIVES must be auto, tls or gloo. Received: .*'tsl'"):
        collectives_mode()
    args = (dist.HashStore(), 0, 2, "127.0.0.1", ("127.0.0.1", 1))
    rest = (worker_name, lambda: None, 5.0)
    monkeypatch.setenv("PHALANX_COLLECTIVES", "tls")
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    with pytest.raises(ValueError, match="PHALANX_COLLECTIVES=tls needs PHALANX_CLUSTER_TOKEN"):
        ring_if_needed(*args, True, *rest)
    monkeypatch.setenv("PHALANX_CLUSTER_TOKEN", TOKEN)
    monkeypatch.setenv("PHALANX_COLLECTIVES", "auto")
    assert ring_if_needed(*args, True, *rest) is None  # one machine: the kernel carries it
    assert ring_if_needed(dist.HashStore(), 0, 1, "127.0.0.1", ("127.0.0.1", 1), False, *rest) is None
    caplog.clear()
    monkeypatch.setenv("PHALANX_COLLECTIVES", "gloo")
    assert ring_if_needed(*args, False, *rest) is None
    assert "PLAINTEXT gloo (PHALANX_COLLECTIVES=gloo)" in caplog.text  # the opt-out is logged
    caplog.clear()
    monkeypatch.setenv("PHALANX_COLLECTIVES", "auto")
    monkeypatch.setenv("PHALANX_INSECURE_TRANSPORT", "1")
    assert ring_if_needed(*args, False, *rest) is None
    assert "PLAINTEXT gloo (PHALANX_INSECURE_TRANSPORT=1)" in caplog.text
    caplog.clear()
    monkeypatch.delenv("PHALANX_INSECURE_TRANSPORT")
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN")
    assert ring_if_needed(*args, False, *rest) is None
    assert "PLAINTEXT gloo: PHALANX_CLUSTER_TOKEN is unset" in caplog.text


class _RingEngine:
    """The part of `WorkerGroup` a phalanx process group runs on: here a bare TLS ring."""

    uses_tls = True
    point_to_point = None  # a bare ring: no point-to-point links beside it

    def __init__(self, ring):
        self.rank, self.world_size, self._ring = ring.rank, ring.world_size, ring

    def all_reduce_async(self, tensor, op=dist.ReduceOp.SUM):
        return self._ring.all_reduce_async(tensor, op)

    def broadcast_async(self, tensor, src):
        return self._ring.broadcast_async(tensor, src)

    def all_gather_async(self, tensor):
        return self._ring.all_gather_async(tensor)

    def wait(self, work, what, timeout=None):
        work.wait()


def _on_threads(world, run):
    """``run(rank)`` on ``world`` threads at once; their results by rank (an error re-raised)."""
    results = [None] * world

    def call(rank):
        try:
            results[rank] = run(rank)
        except Exception as exc:
            results[rank] = exc

    threads = [threading.Thread(target=call, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for result in results:
        if isinstance(result, Exception):
            raise result
    return results


def test_a_users_own_collectives_on_the_phalanx_group_travel_encrypted():
    # what torch.distributed.all_reduce / all_gather / broadcast call on the default group
    # of a MultiWorkerMirrored job under TLS (phalanx.communication.group.process_group)
    from datetime import timedelta

    from phalanx.communication.group.process_group import PhalanxProcessGroup

    store = dist.HashStore()
    relay = _Relay(_real_port(store, 1))
    rings = _rings(2, store, redirect=lambda: relay.port)
    try:
        groups = _on_threads(
            2,
            lambda r: PhalanxProcessGroup(
                dist.PrefixStore("pg", store), r, 2, timedelta(seconds=30), _RingEngine(rings[r])
            ),
        )
        tensors = [torch.full((4096,), MARKER), torch.full((4096,), MARKER)]
        _on_threads(2, lambda r: groups[r].allreduce([tensors[r]]).wait())
        gathered = [[torch.empty(1024), torch.empty(1024)] for _ in range(2)]
        _on_threads(2, lambda r: groups[r].allgather([gathered[r]], [torch.full((1024,), MARKER)]).wait())
        sent = [torch.full((1024,), 3 * MARKER), torch.zeros(1024)]
        _on_threads(2, lambda r: groups[r].broadcast([sent[r]]).wait())
        assert torch.equal(tensors[1], torch.full((4096,), 2 * MARKER))  # through the relay
        assert torch.equal(gathered[0][1], torch.full((1024,), MARKER))
        assert torch.equal(sent[1], torch.full((1024,), 3 * MARKER))
        for value in (MARKER, 2 * MARKER, 3 * MARKER):
            assert torch.tensor([value]).numpy().tobytes() not in relay.seen
        # no plaintext gloo behind it: torch's C++ paths find no CPU backend, and point-to-point
        # without the job's TLS links (tests/security/test_point_to_point_links.py) is refused
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            groups[0]._get_backend(torch.device("cpu"))
        with pytest.raises(RuntimeError, match="cannot carry send without the job's point-to-point"):
            groups[0].send([torch.zeros(1)], 1, 0)
    finally:
        _close(rings)
