"""The MultiWorkerMirrored rendezvous store: what an outsider who reaches its port can do.

torch's TCPStore authenticates nobody, so `AuthenticatedStore` MACs every value with a key
derived from the cluster token: an outsider's values are refused by name (it can neither
check in as a worker, nor move a heartbeat, nor give gloo an address), a valid value moved
to another key is refused, and counters stay atomic with many writers. Real TCPStores on
127.0.0.1; the last tests run real two-worker jobs.
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from phalanx.communication.checks.health import HealthCheck
from phalanx.communication.membership import rendezvous
from phalanx.communication.membership.rendezvous import AuthenticatedStore, StoreAuthenticationError
from security.helpers import SCRIPTS
from support.cluster import run_cluster

TOKEN = "the-cluster-secret-0123456789ab"
TIMEOUT = datetime.timedelta(seconds=10)


@pytest.fixture
def tcp_store():
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=TIMEOUT, wait_for_workers=False)


def _connect(tcp_store):
    return dist.TCPStore("127.0.0.1", tcp_store.port, None, False, timeout=TIMEOUT)


def test_values_round_trip_and_are_sealed_on_the_wire(tcp_store):
    store = AuthenticatedStore(_connect(tcp_store), TOKEN, "phalanx/0/")
    store.set("machine/0", '{"host": "a"}')
    assert store.get("machine/0") == b'{"host": "a"}'
    assert store.multi_get(["machine/0"]) == [b'{"host": "a"}']
    assert tcp_store.get("machine/0") != b'{"host": "a"}'  # raw: magic, nonce, MAC, value
    assert tcp_store.get("machine/0").endswith(b'{"host": "a"}')  # authenticated, not secret


@pytest.mark.parametrize("key", [HealthCheck.key(1), "pg/0//cpu//0/1", "left/1"])
def test_an_outsiders_value_is_refused_by_name(tcp_store, key, caplog):
    outsider = _connect(tcp_store)  # reaches the port, lacks the token
    outsider.set(key, "1")
    store = AuthenticatedStore(_connect(tcp_store), TOKEN)
    with pytest.raises(StoreAuthenticationError, match=rf"key '{key}' holds a value that no task .* MAC"):
        store.get(key)
    with pytest.raises(StoreAuthenticationError):
        store.multi_get([key])
    with pytest.raises(StoreAuthenticationError):  # a forged counter is not counted on
        store.add(key, 1)
    assert not store.check([key])  # a forged check-in or "left" mark counts as absent...
    assert not store.check([key])
    assert caplog.text.count(f"key '{key}' holds a value") == 1  # ...and is logged once


def test_a_task_with_another_token_is_refused(tcp_store):
    AuthenticatedStore(_connect(tcp_store), "another-secret-0123456789").add(HealthCheck.key(1), 1)
    with pytest.raises(StoreAuthenticationError):
        AuthenticatedStore(_connect(tcp_store), TOKEN).get(HealthCheck.key(1))


def test_a_valid_value_moved_to_another_key_or_job_is_refused(tcp_store):
    store = AuthenticatedStore(_connect(tcp_store), TOKEN, "phalanx/0/")
    store.add(HealthCheck.key(0), 5)
    tcp_store.set(HealthCheck.key(1), tcp_store.get(HealthCheck.key(0)))  # replay worker 0's beat
    with pytest.raises(StoreAuthenticationError):
        store.get(HealthCheck.key(1))
    with pytest.raises(StoreAuthenticationError):  # a value of another job (torchrun restart)
        AuthenticatedStore(_connect(tcp_store), TOKEN, "phalanx/1/").get(HealthCheck.key(0))


def test_counters_stay_atomic_with_many_writers(tcp_store):
    def count():
        store = AuthenticatedStore(_connect(tcp_store), TOKEN)
        for _ in range(50):
            store.add("counter", 1)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert AuthenticatedStore(_connect(tcp_store), TOKEN).get("counter") == b"200"


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_job_with_one_token_all_reduces_over_the_authenticated_store(tmp_path):
    run = run_cluster(SCRIPTS / "mwms_with_token.py", "same", workers=2, timeout=180).check()
    assert "[worker-0] sum 3.0" in run.output
    assert "[worker-1] sum 3.0" in run.output


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_a_worker_without_the_token_cannot_join(tmp_path):
    env = {"PHALANX_JOIN_TIMEOUT_SECONDS": "15"}
    run = run_cluster(SCRIPTS / "mwms_with_token.py", "other", workers=2, timeout=180, env=env)
    assert run.returncodes == {"worker-0": 3, "worker-1": 3}, run.output  # both ended: nothing hung
    assert "sum" not in run.output  # no collective ran with the outsider
    assert "[worker-0] error PeerUnavailableError: Gave up after 15s waiting for ['worker:1" in run.output
    assert "[worker-0] The rendezvous store's key 'heartbeat/1' holds a value that no task" in run.output


def test_a_short_token_is_refused_before_the_store_is_used(tcp_store):
    with pytest.raises(ValueError, match="PHALANX_CLUSTER_TOKEN must be at least 16 characters"):
        AuthenticatedStore(_connect(tcp_store), "short-token")


def test_without_a_token_the_store_is_used_as_it_is_and_that_is_logged(tcp_store, monkeypatch, caplog):
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    monkeypatch.setattr(rendezvous, "_warned_unauthenticated", False)
    connection = _connect(tcp_store)
    assert rendezvous._authenticated(connection, "phalanx/0/") is connection
    assert "The rendezvous store is not authenticated: PHALANX_CLUSTER_TOKEN is unset" in caplog.text
    monkeypatch.setenv("PHALANX_CLUSTER_TOKEN", TOKEN)
    assert isinstance(rendezvous._authenticated(connection, "phalanx/0/"), AuthenticatedStore)
