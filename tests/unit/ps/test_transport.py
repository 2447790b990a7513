"""The gRPC transport: real servers on 127.0.0.1 in this process (port 0: a free port each)."""

from __future__ import annotations

import logging
import pickle
import socket
import threading
import time

import grpc
import pytest
import torch

from phalanx.cluster._ports import free_ports
from phalanx.ps import transport, wire
from phalanx.ps.transport import (
    AuthenticationError,
    MessageTooLargeError,
    PeerAuthenticationError,
    RemoteError,
    RpcClient,
    RpcServer,
    TaskUnavailableError,
)
from phalanx.security.channels import INSECURE_ENV

TOKEN = "test-secret-0123456789"
NAME = "ps:0 (test)"


class Handlers:
    """The server's methods, recording what ran."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()

    def methods(self):
        return {"echo": self.echo, "fails": self.fails, "sleeps": self.sleeps, "bad_reply": self.bad_reply}

    def echo(self, header, tensors):
        self.calls.append("echo")
        return {"got": header}, [t * 2 for t in tensors]

    def fails(self, header, tensors):
        self.calls.append("fails")
        raise ValueError(header.get("message", "no such variable"))

    def sleeps(self, header, tensors):
        self.calls.append("sleeps")
        self.release.wait(header["seconds"])
        return {}, []

    def bad_reply(self, header, tensors):
        return {"t": torch.ones(1)}, []  # not JSON


@pytest.fixture
def handlers():
    return Handlers()


@pytest.fixture
def server(handlers):
    server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name=NAME)
    server.start()
    yield server
    handlers.release.set()
    server.stop(grace=0)


@pytest.fixture
def client(server):
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name=NAME, timeout=10)
    yield client
    client.close()


def test_a_call_carries_a_header_and_tensors_both_ways(client):
    values = [torch.arange(6.0).view(2, 3), torch.tensor(7, dtype=torch.int64), torch.zeros(0)]
    header, tensors = client.call("echo", {"a": [1, "x"]}, values)
    assert header == {"got": {"a": [1, "x"]}}
    assert [t.tolist() for t in tensors] == [(v * 2).tolist() for v in values]


def test_a_call_without_header_or_tensors(client):
    assert client.call("echo") == ({"got": {}}, [])


def test_a_large_message_passes_grpcs_default_4mb_limit(client):
    value = torch.randn(3 * 1024 * 1024)  # 12 MB each way
    _, (back,) = client.call("echo", {}, [value])
    assert torch.equal(back, value * 2)


def test_concurrent_calls_from_threads_on_one_client(client, handlers):
    results: dict[tuple[int, int], float] = {}
    errors: list[BaseException] = []

    def many(i):
        try:
            for j in range(25):
                _, (t,) = client.call("echo", {"i": i}, [torch.tensor([float(i * 100 + j)])])
                results[i, j] = t.item()
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=many, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert results == {(i, j): 2.0 * (i * 100 + j) for i in range(8) for j in range(25)}
    assert len(handlers.calls) == 200


def test_a_client_with_another_token_is_refused_in_the_handshake(server, handlers):
    intruder = RpcClient(f"127.0.0.1:{server.port}", "another-secret-0123456789", name=NAME)
    with pytest.raises(PeerAuthenticationError, match=r"ps:0 \(test\) did not prove .* TLS handshake"):
        intruder.call("echo", {}, [torch.ones(1)])
    with pytest.raises(PeerAuthenticationError):  # not "no such method": authentication comes first
        intruder.call("no_such_method")
    intruder.close()
    assert handlers.calls == []


def test_a_plaintext_client_is_refused_by_a_tls_server(server, handlers):
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    call = channel.unary_unary("/phalanx.Task/echo")
    for metadata in ((), (("phalanx-token", TOKEN),)):  # even with the right token in clear
        with pytest.raises(grpc.RpcError) as info:
            call(wire.pack({}, [torch.ones(1)]), timeout=5, metadata=metadata)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    channel.close()
    assert handlers.calls == []


@pytest.mark.parametrize("token", ["guess-0123456789abc", "test-secret-0123456789-but-longer"])
def test_plaintext_mode_refuses_a_wrong_token_before_the_handler_runs(handlers, token, caplog, monkeypatch):
    monkeypatch.setenv(INSECURE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name=NAME)
        server.start()
        intruder = RpcClient(f"127.0.0.1:{server.port}", token, name=NAME)
        with pytest.raises(AuthenticationError, match=r"ps:0 \(test\) refused .* same PHALANX_CLUSTER_TOKEN"):
            intruder.call("echo", {}, [torch.ones(1)])
        with pytest.raises(AuthenticationError):  # not "no such method": the token comes first
            intruder.call("no_such_method")
    intruder.close()
    server.stop(grace=0)
    assert handlers.calls == []
    assert "wrong or missing cluster token" in caplog.text
    assert f"ps:0 (test) uses PLAINTEXT gRPC ({INSECURE_ENV}=1)" in caplog.text


def test_plaintext_mode_refuses_a_call_without_a_token(handlers, monkeypatch):
    monkeypatch.setenv(INSECURE_ENV, "1")
    server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name=NAME)
    server.start()
    anonymous = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name=NAME)
    monkeypatch.setattr(anonymous, "_metadata", ())
    with pytest.raises(AuthenticationError, match="PHALANX_CLUSTER_TOKEN"):
        anonymous.call("echo")
    right = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name=NAME)
    assert right.call("echo", {"a": 1})[0] == {"got": {"a": 1}}
    anonymous.close()
    right.close()
    server.stop(grace=0)
    assert handlers.calls == ["echo"]


def test_a_tls_client_is_refused_by_a_plaintext_server(handlers, monkeypatch):
    monkeypatch.setenv(INSECURE_ENV, "1")
    server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name=NAME)
    server.start()
    monkeypatch.delenv(INSECURE_ENV)
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name=NAME)
    with pytest.raises(PeerAuthenticationError, match="TLS handshake"):
        client.call("echo")
    client.close()
    server.stop(grace=0)
    assert handlers.calls == []


@pytest.mark.parametrize("value", ["2", "yes please", "on"])
def test_a_malformed_insecure_setting_is_refused(value, monkeypatch):
    monkeypatch.setenv(INSECURE_ENV, value)
    with pytest.raises(ValueError, match=rf"{INSECURE_ENV} must be 1 .* Received: {INSECURE_ENV}="):
        RpcClient("127.0.0.1:1", TOKEN, name="x")


def test_the_server_certificate_must_name_the_address_dialled(handlers):
    server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name=NAME, names=["localhost"])
    server.start()
    by_address = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name=NAME)
    with pytest.raises(PeerAuthenticationError, match="(?i)hostname"):
        by_address.call("echo")
    by_name = RpcClient(f"localhost:{server.port}", TOKEN, name=NAME)
    assert by_name.call("echo", {"n": 1})[0] == {"got": {"n": 1}}
    by_address.close()
    by_name.close()
    server.stop(grace=0)
    assert handlers.calls == ["echo"]


def test_wait_until_ready_names_an_impostor_at_once(handlers):
    impostor = RpcServer("127.0.0.1", 0, "impostor-secret-0123456789", handlers.methods(), name="x")
    impostor.start()
    client = RpcClient(f"127.0.0.1:{impostor.port}", TOKEN, name="ps:1 (impostor)")
    start = time.monotonic()
    with pytest.raises(PeerAuthenticationError, match=r"ps:1 \(impostor\) did not prove") as info:
        client.wait_until_ready(30)
    assert time.monotonic() - start < 20  # at once, not after the 30 s wait
    assert info.value.task == "ps:1 (impostor)"
    client.close()
    impostor.stop(grace=0)
    assert handlers.calls == []


def test_authentication_errors_are_permission_errors():
    assert issubclass(AuthenticationError, PermissionError)
    assert issubclass(PeerAuthenticationError, AuthenticationError)
    assert not issubclass(PeerAuthenticationError, TaskUnavailableError)  # waiting cannot help
    again = pickle.loads(pickle.dumps(PeerAuthenticationError("m", "ps:0")))
    assert (str(again), again.task) == ("m", "ps:0")
    assert issubclass(MessageTooLargeError, ValueError)
    assert issubclass(TaskUnavailableError, RuntimeError)
    assert issubclass(RemoteError, RuntimeError)


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("", "at least 16 characters"),
        ("one-char", "at least 16 characters"),
        ("sécret-0123456789ab", "printable ASCII"),
        ("a\nb-0123456789abcdef", "printable ASCII"),
    ],
)
def test_tokens_too_short_or_not_sendable_are_refused_by_both_sides(token, message):
    with pytest.raises(ValueError, match=f"{message}.*HINT: "):
        RpcClient("127.0.0.1:1", token, name="x")
    with pytest.raises(ValueError, match=message):
        RpcServer("127.0.0.1", 0, token, {}, name="x")


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost:", "::1:2222", "host:port", "", "a b:1"])
def test_an_address_without_a_port_is_refused(address):
    with pytest.raises(ValueError, match=r"must be 'host:port'.*Received: .* for ps:7"):
        RpcClient(address, TOKEN, name="ps:7")


@pytest.mark.parametrize("address", ["localhost:2222", "[::1]:2222", "10.0.0.1:1", "ps-0.svc.cluster:2222"])
def test_host_port_addresses_are_taken(address):
    RpcClient(address, TOKEN, name="x").close()


def test_a_handler_error_comes_back_with_its_type_message_and_traceback(client, handlers):
    with pytest.raises(RemoteError) as info:
        client.call("fails", {"message": "no variable 'w'"})
    error = info.value
    assert str(error) == "fails on ps:0 (test) failed: ValueError: no variable 'w'"
    assert error.remote_type == "ValueError"
    assert "in fails" in error.remote_traceback
    assert "ValueError: no variable 'w'" in error.remote_traceback
    assert handlers.calls == ["fails"]


def test_a_huge_error_message_still_comes_back_shortened(client):
    with pytest.raises(RemoteError, match=r"ValueError: x{100}.*more characters\)") as info:
        client.call("fails", {"message": "x" * 100_000})
    assert info.value.remote_type == "ValueError"
    assert len(str(info.value)) < 5000


def test_a_huge_error_message_of_percent_signs_still_comes_back(client):
    with pytest.raises(RemoteError, match=r"ValueError: %{100}") as info:
        client.call("fails", {"message": "%" * 20_000})
    assert info.value.remote_type == "ValueError"


def test_a_reply_that_cannot_be_packed_is_the_handlers_error(client):
    with pytest.raises(RemoteError, match="bad_reply on ps:0 .* failed: TypeError: .*JSON-serialisable"):
        client.call("bad_reply")


def test_remote_errors_pickle_with_their_remote_type_and_traceback(client):
    with pytest.raises(RemoteError) as info:
        client.call("fails")
    again = pickle.loads(pickle.dumps(info.value))
    assert (str(again), again.remote_type, again.remote_traceback) == (
        str(info.value),
        "ValueError",
        info.value.remote_traceback,
    )


def test_an_unknown_method_names_the_method_the_task_and_what_it_serves(client, handlers):
    with pytest.raises(
        RemoteError, match=r"nothing on ps:0 \(test\) failed: the task has no method 'nothing'"
    ) as info:
        client.call("nothing")
    assert "it serves: bad_reply, echo, fails, sleeps" in str(info.value)
    assert info.value.remote_type == "UNIMPLEMENTED"
    assert handlers.calls == []


def test_a_silent_task_hits_the_deadline(client, handlers):
    start = time.monotonic()
    with pytest.raises(
        TaskUnavailableError, match=r"ps:0 \(test\) did not answer sleeps within the 0.3s deadline"
    ) as info:
        client.call("sleeps", {"seconds": 5.0}, timeout=0.3)
    assert time.monotonic() - start < 4  # the deadline, not the handler, ended the call
    assert "(DEADLINE_EXCEEDED: " in str(info.value)
    assert f"HINT: check that the task is running and reachable at {client.address}" in str(info.value)


def test_the_clients_default_timeout_is_the_deadline(server):
    impatient = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name=NAME, timeout=0.2)
    with pytest.raises(TaskUnavailableError, match="within the 0.2s deadline"):
        impatient.call("sleeps", {"seconds": 5.0})
    impatient.close()


def test_a_stopped_task_is_unreachable_at_once(server, client):
    client.call("echo")  # connected
    server.stop()
    server.stop()  # idempotent
    assert server.wait_for_termination(timeout=5)
    start = time.monotonic()
    with pytest.raises(
        TaskUnavailableError, match=r"ps:0 \(test\) is unreachable: echo failed after"
    ) as info:
        client.call("echo")
    assert time.monotonic() - start < 10  # fails fast, no hang until the 10 s deadline
    assert f"127.0.0.1:{server.port}" in str(info.value)
    assert "HINT: check that the task is running" in str(info.value)


def test_a_task_that_never_started_is_unreachable_at_once():
    (port,) = free_ports(1)
    client = RpcClient(f"127.0.0.1:{port}", TOKEN, name="ps:2 (nowhere)", timeout=30)
    start = time.monotonic()
    with pytest.raises(TaskUnavailableError, match=r"ps:2 \(nowhere\) is unreachable: echo failed"):
        client.call("echo")
    assert time.monotonic() - start < 10
    client.close()


def test_a_call_running_when_the_server_stops_is_unavailable(server, client, handlers):
    failure: list[BaseException] = []

    def call():
        try:
            client.call("sleeps", {"seconds": 5.0})
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    while "sleeps" not in handlers.calls:
        time.sleep(0.01)
    server.stop(grace=0)
    thread.join(timeout=10)
    assert len(failure) == 1
    assert isinstance(failure[0], TaskUnavailableError)


def test_wait_until_ready_names_a_task_nobody_serves():
    (port,) = free_ports(1)
    client = RpcClient(f"127.0.0.1:{port}", TOKEN, name="worker:3 (nowhere)")
    with pytest.raises(
        TaskUnavailableError, match=rf"worker:3 \(nowhere\) was not reachable within 0.2s at 127.0.0.1:{port}"
    ):
        client.wait_until_ready(0.2)
    client.close()


def test_wait_until_ready_returns_for_a_running_task(client):
    client.wait_until_ready(5)


def test_a_closed_client_says_so(client):
    client.close()
    client.close()  # idempotent
    with pytest.raises(
        TaskUnavailableError, match=r"ps:0 \(test\) cannot be called \(echo\): this process closed"
    ):
        client.call("echo")
    with pytest.raises(TaskUnavailableError, match="closed its connection"):
        client.start("echo", timeout=1)
    with pytest.raises(TaskUnavailableError, match="closed its connection"):
        client.wait_until_ready(1)


def test_a_busy_port_cannot_be_served_twice(server):
    with pytest.raises(ValueError, match=rf"ps:1 \(test\) cannot listen at 127.0.0.1:{server.port}.*HINT"):
        RpcServer("127.0.0.1", server.port, TOKEN, {}, name="ps:1 (test)")


def test_a_port_another_program_holds_cannot_be_served():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen at 127.0.0.1:{port}"):
            RpcServer("127.0.0.1", port, TOKEN, {}, name="ps:1 (test)")


def test_a_host_that_is_not_this_machines_cannot_be_served():
    with pytest.raises(ValueError, match=r"cannot listen at 192\.0\.2\.1:0"):  # TEST-NET-1, never local
        RpcServer("192.0.2.1", 0, TOKEN, {}, name="ps:1 (test)")


def test_the_server_listens_only_on_its_host(server):
    # another loopback address (Linux routes all of 127/8 to lo): served only if bound to every interface
    probe = RpcClient(f"127.0.0.2:{server.port}", TOKEN, name=NAME)
    with pytest.raises(TaskUnavailableError):
        probe.call("echo", timeout=5)
    probe.close()


def test_an_ipv6_loopback_server_and_client():
    if not socket.has_ipv6:
        pytest.skip("no IPv6")
    try:
        server = RpcServer("::1", 0, TOKEN, {"echo": Handlers().echo}, name="ps:0 (ipv6)")
    except ValueError:
        pytest.skip("::1 cannot be bound here")
    server.start()
    client = RpcClient(f"[::1]:{server.port}", TOKEN, name="ps:0 (ipv6)")
    assert client.call("echo", {"x": 1})[0] == {"got": {"x": 1}}
    client.close()
    server.stop()


def test_stop_is_idempotent_even_before_start(handlers):
    server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name=NAME)
    server.stop()
    server.stop()
    assert server.wait_for_termination(timeout=1)


def test_wait_for_termination_times_out_while_serving(server):
    assert server.wait_for_termination(timeout=0.05) is False


def test_stop_leaves_no_server_threads(handlers):
    server = RpcServer("127.0.0.1", 0, TOKEN, handlers.methods(), name="ps:9 (threads)")
    server.start()
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:9 (threads)")
    for _ in range(4):
        client.call("echo")
    client.close()
    server.stop()
    deadline = time.monotonic() + 5
    while any("ps:9 (threads)" in t.name for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not [t.name for t in threading.enumerate() if "ps:9 (threads)" in t.name]


def test_a_pending_call_gives_its_result(client):
    call = client.start("echo", {"k": 1}, [torch.ones(2)], timeout=10)
    header, (t,) = call.result(timeout=10)
    assert header == {"got": {"k": 1}}
    assert t.tolist() == [2.0, 2.0]


def test_a_pending_call_still_running_times_out_and_can_be_cancelled(client):
    call = client.start("sleeps", {"seconds": 5.0}, timeout=30)
    with pytest.raises(TimeoutError, match=r"sleeps on ps:0 \(test\) is still running"):
        call.result(timeout=0.1)
    call.cancel()
    with pytest.raises(TaskUnavailableError, match="was cancelled"):
        call.result(timeout=5)


def test_a_pending_call_maps_errors_like_call(client):
    with pytest.raises(RemoteError, match="ValueError: no such variable"):
        client.start("fails", timeout=10).result(timeout=10)
    with pytest.raises(TaskUnavailableError, match="within the 0.2s deadline"):
        client.start("sleeps", {"seconds": 5.0}, timeout=0.2).result(timeout=10)


def test_the_public_names():
    assert sorted(transport.__all__) == [
        "AuthenticationError",
        "Handler",
        "MessageTooLargeError",
        "PeerAuthenticationError",
        "PendingCall",
        "RemoteError",
        "RpcClient",
        "RpcServer",
        "TaskUnavailableError",
    ]
