"""The wire format and the gRPC transport: real servers on 127.0.0.1 in this process."""

from __future__ import annotations

import json
import struct
import threading
import time

import pytest
import torch

from phalanx.cluster._ports import free_ports
from phalanx.ps import wire
from phalanx.ps.transport import AuthenticationError, RemoteError, RpcClient, RpcServer, TaskUnavailableError

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_bit_for_bit(dtype):
    value = (torch.randn(3, 5) * 100).to(dtype)
    header, (back,) = wire.unpack(wire.pack({"k": [1, "x"]}, [value]))
    assert header == {"k": [1, "x"]}
    assert back.dtype == dtype
    assert torch.equal(back, value)


def test_shapes_nan_negative_zero_and_non_contiguous_round_trip():
    special = torch.tensor([float("nan"), -0.0, float("inf")])
    tensors = [
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.arange(12.0).view(3, 4).t(),
        special,
        torch.ones(1 << 21),
    ]
    _, back = wire.unpack(wire.pack({}, tensors))
    assert [t.shape for t in back] == [t.shape for t in tensors]
    assert torch.equal(back[2], tensors[2])
    assert torch.equal(back[3].view(torch.int32), special.view(torch.int32))  # the same bits
    back[4].add_(1)  # writable


def _message(header, tail=b""):
    encoded = json.dumps(header).encode()
    return b"PHX1" + struct.pack("<I", len(encoded)) + encoded + tail


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"XXXX\x00\x00\x00\x00", "wrong magic"),
        (b"PHX1\xff\x00\x00\x00{}", "truncated"),
        (b"PHX1\x02\x00\x00\x00{x", "not JSON"),
        (b"PHX1\x02\x00\x00\x00[]", "JSON object"),
        (_message({"__tensors__": [["float32", [2], 8]]}), "needs 8 bytes"),
        (_message({"__tensors__": [["float32", [2], 4]]}, b"1234"), "needs 8 bytes"),
        (_message({"__tensors__": [["float9", [2], 8]]}, b"12345678"), "Unknown tensor dtype"),
    ],
)
def test_bad_messages_are_refused(data, message):
    with pytest.raises(ValueError, match=message):
        wire.unpack(data)


def test_sparse_tensors_are_refused():
    with pytest.raises(ValueError, match="sparse tensors cannot be sent"):
        wire.pack({}, [torch.eye(2).to_sparse()])


class Echo:
    def __init__(self) -> None:
        self.calls = 0

    def echo(self, header, tensors):
        self.calls += 1
        return {"got": header}, [t * 2 for t in tensors]

    def fails(self, header, tensors):
        raise ValueError("no such thing")

    def sleeps(self, header, tensors):
        time.sleep(header["seconds"])
        return {}, []


@pytest.fixture
def served():
    echo = Echo()
    (port,) = free_ports(1)
    handlers = {"echo": echo.echo, "fails": echo.fails, "sleeps": echo.sleeps}
    server = RpcServer("127.0.0.1", port, "secret", handlers, name="ps:0 (test)")
    server.start()
    client = RpcClient(f"127.0.0.1:{port}", "secret", name="ps:0 (test)", timeout=10)
    yield echo, server, client
    client.close()
    server.stop()


def test_a_call_carries_a_header_and_tensors_both_ways(served):
    echo, server, client = served
    header, tensors = client.call("echo", {"a": 1}, [torch.ones(3)])
    assert header == {"got": {"a": 1}}
    assert torch.equal(tensors[0], torch.full((3,), 2.0))


def test_concurrent_calls_from_threads(served):
    echo, server, client = served
    results = []

    def many(i):
        for j in range(20):
            results.append(client.call("echo", {}, [torch.tensor([float(i * 100 + j)])])[1][0].item())

    threads = [threading.Thread(target=many, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(2.0 * (i * 100 + j) for i in range(4) for j in range(20))


def test_a_wrong_token_is_refused_before_the_handler_runs(served):
    echo, server, client = served
    intruder = RpcClient(f"127.0.0.1:{server.port}", "guess", name="ps:0 (test)")
    with pytest.raises(AuthenticationError, match="same PHALANX_CLUSTER_TOKEN"):
        intruder.call("echo", {}, [torch.ones(1)])
    assert echo.calls == 0
    intruder.close()


def test_empty_tokens_are_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        RpcClient("127.0.0.1:1", "", name="x")
    with pytest.raises(ValueError, match="must not be empty"):
        RpcServer("127.0.0.1", 0, "", {}, name="x")


def test_a_handler_error_comes_back_with_its_type_and_traceback(served):
    _, _, client = served
    with pytest.raises(
        RemoteError, match=r"fails on ps:0 \(test\) failed: ValueError: no such thing"
    ) as info:
        client.call("fails")
    assert info.value.remote_type == "ValueError"
    assert "def fails" in info.value.remote_traceback or "fails" in info.value.remote_traceback


def test_an_unknown_method_is_named(served):
    _, _, client = served
    with pytest.raises(RemoteError, match="has no method 'nothing'"):
        client.call("nothing")


def test_a_silent_task_hits_the_deadline(served):
    _, _, client = served
    with pytest.raises(TaskUnavailableError, match=r"ps:0 \(test\) did not answer sleeps within"):
        client.call("sleeps", {"seconds": 2.0}, timeout=0.3)


def test_a_stopped_task_is_unreachable_at_once(served):
    _, server, client = served
    server.stop()
    server.stop()  # idempotent
    assert server.wait_for_termination(timeout=5)
    start = time.monotonic()
    with pytest.raises(TaskUnavailableError, match=r"ps:0 \(test\) is unreachable"):
        client.call("echo")
    assert time.monotonic() - start < 10


def test_waiting_for_a_task_that_never_starts_names_it():
    (port,) = free_ports(1)
    client = RpcClient(f"127.0.0.1:{port}", "secret", name="worker:3 (nowhere)")
    with pytest.raises(TaskUnavailableError, match=r"worker:3 \(nowhere\) was not reachable within 0.2s"):
        client.wait_until_ready(0.2)
    client.close()


def test_a_busy_port_cannot_be_served_twice(served):
    _, server, _ = served
    with pytest.raises(ValueError, match="cannot listen"):
        RpcServer("127.0.0.1", server.port, "secret", {}, name="ps:1 (test)")
