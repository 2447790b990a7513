"""The parameter-server data path in one process: which path a call takes, the frames, the
shared-memory segments' checks, and the errors (tests/security/test_ps_data_path.py has the
attacks)."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from phalanx.ps import wire
from phalanx.ps.data_path.frames import SEGMENT_RESERVED, Segment
from phalanx.ps.data_path.server import data_path_mode
from phalanx.ps.rpc.errors import MessageTooLargeError, RemoteError
from phalanx.ps.transport import RpcClient, RpcServer

TOKEN = "data-path-secret-0123456789"


def _server(port: int = 0) -> RpcServer:
    def assign(header, tensors):
        return {"seen": header.get("tag")}, [t * 2 for t in tensors]

    def fail(header, tensors):
        raise KeyError("no variable 'w'")

    server = RpcServer(
        "127.0.0.1",
        port,
        TOKEN,
        {"assign": assign, "read": fail},
        name="ps:0 (test)",
        data_methods=["assign", "read"],
    )
    server.start()
    return server


@pytest.mark.parametrize("mode", ["auto", "stream", "grpc"])
@pytest.mark.parametrize("numel", [0, 10, 1 << 20])
def test_a_call_gives_the_same_reply_on_every_path(monkeypatch, mode, numel):
    monkeypatch.setenv("PHALANX_PS_DATA_PATH", mode)
    server = _server()
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    try:
        values = torch.randn(numel)
        for _ in range(2):  # the second call reuses the connection (and its segment)
            header, (back,) = client.call("assign", {"tag": "x"}, [values])
            assert header == {"seen": "x"}
            assert torch.equal(back, values * 2)
        assert (client._data is not None) == (mode != "grpc")
        segment = client._data._idle[0].segment if client._data is not None else None
        assert (segment is not None) == (mode == "auto" and numel * 4 >= 1 << 16)
    finally:
        client.close()
        server.stop()


def test_a_handler_error_comes_back_named_and_the_connection_serves_on():
    server = _server()
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    try:
        with pytest.raises(RemoteError, match=r"read on ps:0 \(test\) failed: KeyError: .*no variable 'w'"):
            client.call("read", {})
        assert client.call("assign", {"tag": 1}, [torch.ones(2)])[0] == {"seen": 1}
        assert len(client._data._idle) == 1
    finally:
        client.close()
        server.stop()


def test_a_request_over_the_limit_is_refused_before_it_is_sent(monkeypatch):
    monkeypatch.setenv("PHALANX_MAX_MESSAGE_BYTES", str(1 << 20))
    server = _server()
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    try:
        with pytest.raises(MessageTooLargeError, match="The request of assign to ps:0"):
            client.call("assign", {}, [torch.zeros(1 << 20)])
    finally:
        client.close()
        server.stop()


def test_a_task_restarted_on_another_data_port_is_found_again():
    server = _server()
    port = server.port
    client = RpcClient(f"127.0.0.1:{port}", TOKEN, name="ps:0 (test)")
    try:
        client.call("assign", {}, [torch.ones(1)])
        first = client._data
        server.stop()
        server = _server(port)  # same gRPC address, a new data port
        assert client.call("assign", {"tag": "back"}, [torch.ones(1)])[0] == {"seen": "back"}
        assert client._data is not first
    finally:
        client.close()
        server.stop()


def test_the_mode_setting_refuses_a_typo(monkeypatch):
    monkeypatch.setenv("PHALANX_PS_DATA_PATH", "shm")
    with pytest.raises(
        ValueError, match="PHALANX_PS_DATA_PATH must be auto, stream or grpc. Received: .*'shm'"
    ):
        data_path_mode()


def test_a_segment_is_mapped_only_with_its_nonce_size_and_place(tmp_path):
    segment = Segment.create(1 << 16)
    try:
        with contextlib.closing(Segment.open(segment.path, segment.size, segment.nonce, 1 << 20)) as other:
            other.view[:4] = b"abcd"
            assert bytes(segment.view[:4]) == b"abcd"  # the same memory
        with pytest.raises(ValueError, match="does not hold the nonce"):
            Segment.open(segment.path, segment.size, os.urandom(32), 1 << 20)
        with pytest.raises(ValueError, match="is not a"):
            Segment.open(segment.path, segment.size + 1, segment.nonce, 1 << 20)
        with pytest.raises(ValueError, match="the message limit"):
            Segment.open(segment.path, segment.size, segment.nonce, 1 << 10)
        planted = tmp_path / "phalanx-psd-x"
        planted.write_bytes(segment.nonce + bytes(SEGMENT_RESERVED - 32 + (1 << 16)))
        with pytest.raises(ValueError, match="must be /dev/shm/phalanx-psd"):
            Segment.open(str(planted), segment.size, segment.nonce, 1 << 20)
    finally:
        segment.unlink()
        segment.close()
    assert not os.path.exists(segment.path)


def test_a_message_read_from_a_stream_checks_its_lengths_first():
    parts = wire.pack_parts({"a": 1}, [torch.arange(4)])
    data = b"".join(bytes(p) for p in parts)
    stream = memoryview(data)
    position = 0

    def read(n):
        nonlocal position
        position += n
        return bytes(stream[position - n : position])

    header, entries = wire.read_header(read, len(data))
    assert header == {"a": 1}
    assert entries == [(torch.int64, [4], 32)]
    position = 0
    with pytest.raises(ValueError, match="tensors of 32 bytes"):
        wire.read_header(read, len(data) + 100)
    with pytest.raises(ValueError, match="truncated"):
        wire.read_header(read, 3)


def test_a_task_that_announces_no_usable_data_path_is_called_on_grpc(caplog):
    """Something at a task's address that answers ``__data_path__`` without a port (not a
    phalanx task of this version; in the plaintext opt-out, anyone at the address) gets its
    calls on gRPC, as a task without a data path."""

    def assign(header, tensors):
        return {"ran": True}, []

    server = RpcServer(
        "127.0.0.1",
        0,
        TOKEN,
        {"assign": assign, "__data_path__": lambda header, tensors: ({"methods": "assign"}, [])},
        name="ps:0 (test)",
    )
    server.start()
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    try:
        with caplog.at_level("WARNING", logger="phalanx"):
            assert client.call("assign")[0] == {"ran": True}
        assert client._data is None
        assert "announced no usable data path" in caplog.text
    finally:
        client.close()
        server.stop()


def _slow_worker(release: threading.Event) -> RpcServer:
    """A worker task whose ``run`` waits for ``release``."""

    def run(header, tensors):
        release.wait(30)
        return {"ran": header["closure"]}, list(tensors)

    server = RpcServer("127.0.0.1", 0, TOKEN, {"run": run}, name="worker:0 (test)", data_methods=["run"])
    server.start()
    return server


@pytest.mark.parametrize("mode", ["auto", "stream", "grpc"])
def test_a_watched_call_runs_its_heartbeat_on_the_calling_thread_until_the_reply(monkeypatch, mode):
    """The chief's ``run`` to a worker: on the worker's data path (gRPC when it is off), the
    heartbeat runs every interval on the caller's thread while the function runs."""
    monkeypatch.setenv("PHALANX_PS_DATA_PATH", mode)
    release = threading.Event()
    server = _slow_worker(release)
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="worker:0 (test)")
    beats: list[str] = []

    def heartbeat():
        beats.append(threading.current_thread().name)
        if len(beats) == 3:
            release.set()

    try:
        header, (back,) = client.call_watched(
            "run", {"closure": 7}, [torch.arange(3)], timeout=30, every=0.05, on_wait=heartbeat
        )
        assert header == {"ran": 7}
        assert torch.equal(back, torch.arange(3))
        assert len(beats) >= 3
        assert set(beats) == {threading.current_thread().name}
        assert ("run" in client._on_data_path(5)) == (mode != "grpc")
    finally:
        release.set()
        client.close()
        server.stop()


@pytest.mark.parametrize("mode", ["auto", "grpc"])
def test_what_the_heartbeat_raises_ends_the_call_and_the_next_call_works(monkeypatch, mode):
    """A run given up on (the worker counted lost, or the closure deadline): the heartbeat's
    error reaches the caller unchanged (not a transport error), and the next call gets a
    connection of its own (the late reply of the first never reaches it)."""
    monkeypatch.setenv("PHALANX_PS_DATA_PATH", mode)
    release = threading.Event()
    server = _slow_worker(release)
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="worker:0 (test)")

    def give_up():
        raise TimeoutError("the closure deadline passed")  # an OSError: not to be taken as the link's

    try:
        with pytest.raises(TimeoutError, match="the closure deadline passed"):
            client.call_watched("run", {"closure": 1}, [], timeout=30, every=0.05, on_wait=give_up)
        if mode != "grpc":
            assert client._data is not None
            assert not client._data._idle  # closed, not given back
        release.set()
        header, _ = client.call_watched("run", {"closure": 2}, [], timeout=30, every=5, on_wait=give_up)
        assert header == {"ran": 2}
    finally:
        release.set()
        client.close()
        server.stop()
