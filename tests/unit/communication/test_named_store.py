"""The elastic membership's store calls fail with an error naming the store, the task and the
call (`NamedStore`), not torch's bare store error, when the store stops answering or was never
there. Real TCPStores in this process."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from phalanx.cluster._ports import free_ports
from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.membership import membership as membership_module
from support.membership import membership


def test_a_store_that_went_away_is_named_with_the_call_that_failed(monkeypatch):
    monkeypatch.setenv("PHALANX_CLUSTER_TOKEN", "m" * 32)
    (port,) = free_ports(1, "127.0.0.1")
    server = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
    member = membership(port, 1)
    store = member.connect()
    store.set("alive/1", "0:0")
    assert store.check(["alive/1"])
    del server  # the launcher that served it ended

    def check_until_it_fails() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # a first call may still find the connection open
            store.check(["alive/1"])
            time.sleep(0.01)

    with pytest.raises(PeerUnavailableError) as raised:
        check_until_it_fails()
    message = str(raised.value)
    assert f"worker:1's elastic store at 127.0.0.1:{port} failed a check (" in message
    assert "a call waits at most 30s for an answer" in message
    assert "HINT: the launcher (`phalanx launch`, torchrun's agent) or PHALANX_ELASTIC_STORE" in message
    assert isinstance(raised.value.__cause__, dist.DistError)


def test_a_store_that_never_answers_is_named_when_connecting(monkeypatch):
    monkeypatch.setenv("PHALANX_CLUSTER_TOKEN", "m" * 32)
    monkeypatch.setattr(membership_module, "STORE_CALL_SECONDS", 1.0)
    (port,) = free_ports(1, "127.0.0.1")  # nobody listens there
    with pytest.raises(
        PeerUnavailableError,
        match=rf"worker:0's elastic store at 127.0.0.1:{port} failed a connect \(.*a call waits at most 1s",
    ):
        membership(port, 0, timeout=0.5)
