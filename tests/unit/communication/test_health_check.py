"""The heartbeat health check, one round at a time, on an in-process store with a fake clock."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from phalanx.communication.group.worker_group import HealthCheck, seconds_from_env


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _name(rank: int) -> str:
    return f"worker:{rank} (host{rank}:2222)"


def _check(store, clock, rank=0, world=3):
    return HealthCheck(lambda: store, rank, world, _name, timeout=10.0, interval=1.0, clock=clock)


def _peers_beat(store, ranks):
    for r in ranks:
        store.add(HealthCheck.key(r), 1)


def test_beating_peers_are_healthy_and_a_silent_one_is_named_after_the_timeout():
    store, clock = dist.HashStore(), Clock()
    check = _check(store, clock)
    _peers_beat(store, [1, 2])
    assert check.beat(store) is None
    for _ in range(10):  # worker 2 goes silent; worker 1 keeps beating
        clock.now += 1.0
        _peers_beat(store, [1])
        assert check.beat(store) is None
    clock.now += 0.5
    failure = check.beat(store)
    assert failure == "worker:2 (host2:2222) stopped sending heartbeats 10.5s ago"
    assert check.dead_peer() == failure
    assert int(store.get(HealthCheck.key(0))) == 12  # this worker beat every round


def test_a_peer_that_left_is_reported_as_leaving():
    store, clock = dist.HashStore(), Clock()
    check = _check(store, clock, world=2)
    _peers_beat(store, [1])
    check.beat(store)
    store.set("left/1", "1")
    clock.now += 11
    assert check.beat(store) == "worker:1 (host1:2222) left the cluster (closed its strategy) 11.0s ago"


class BrokenStore:
    def add(self, key: str, value: int) -> int:
        raise RuntimeError("Connection reset by peer")


def test_an_unreachable_store_means_the_chief_is_gone():
    check = _check(BrokenStore(), Clock(), rank=1)
    assert (
        check.beat(BrokenStore())
        == "the chief worker:0 (host0:2222) is unreachable (Connection reset by peer)"
    )


def test_the_thread_reports_a_store_it_cannot_reach():
    def connect():
        raise RuntimeError("connection refused")

    check = HealthCheck(connect, 1, 2, _name, timeout=10.0, interval=0.01)
    check.start()
    check.stop()
    assert check.failure == "the chief worker:0 (host0:2222) is unreachable (connection refused)"


def test_the_thread_beats_until_stopped():
    store = dist.HashStore()
    _peers_beat(store, [1])
    check = HealthCheck(lambda: store, 0, 2, _name, timeout=10.0, interval=0.01)
    check.start()
    deadline = time.monotonic() + 10
    # add(key, 0) reads without blocking: HashStore.get waits for a missing key holding the GIL,
    # so the heartbeat thread could never create it
    while store.add(HealthCheck.key(0), 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    check.stop()
    assert store.add(HealthCheck.key(0), 0) >= 3
    assert check.failure is None


def test_seconds_from_env(monkeypatch):
    monkeypatch.delenv("PHALANX_CLOSURE_TIMEOUT_SECONDS", raising=False)
    assert seconds_from_env("PHALANX_CLOSURE_TIMEOUT_SECONDS", 7.0) == 7.0
    monkeypatch.setenv("PHALANX_CLOSURE_TIMEOUT_SECONDS", " 2.5 ")
    assert seconds_from_env("PHALANX_CLOSURE_TIMEOUT_SECONDS", 7.0) == 2.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("PHALANX_CLOSURE_TIMEOUT_SECONDS", bad)
        name = "PHALANX_CLOSURE_TIMEOUT_SECONDS"
        message = rf"{name} must be a positive number of seconds. Received: \w+='{bad}'"
        with pytest.raises(ValueError, match=message):
            seconds_from_env("PHALANX_CLOSURE_TIMEOUT_SECONDS", 7.0)


def test_a_round_that_never_finishes_loses_the_chief_after_the_timeout():
    clock, released = Clock(), threading.Event()

    def stalled_connect():  # a store across a partition: its calls do not fail, they block
        released.wait(30)
        raise RuntimeError("released")

    check = HealthCheck(stalled_connect, 1, 2, _name, timeout=10.0, interval=0.01, clock=clock)
    check.start()
    try:
        clock.now += 10.0
        assert check.dead_peer() is None
        clock.now += 0.5
        assert check.dead_peer() == (
            "lost contact with the cluster: the chief worker:0 (host0:2222)'s store has not answered a "
            "heartbeat for 10.5s (a network partition, or the chief stopped)"
        )
    finally:
        released.set()
        check.stop()


def test_the_chief_reports_its_own_store_stalling():
    store, clock = dist.HashStore(), Clock()
    check = _check(store, clock, rank=0, world=2)
    _peers_beat(store, [1])
    assert check.beat(store) is None
    clock.now += 12.0  # no round since (the heartbeat thread is stuck)
    assert "its own rendezvous store has not answered a heartbeat for 12.0s" in check.dead_peer()


def test_finished_rounds_keep_a_slow_store_healthy():
    store, clock = dist.HashStore(), Clock()
    check = _check(store, clock, rank=1, world=2)
    for _ in range(5):
        _peers_beat(store, [0])
        clock.now += 9.0  # each round takes 9 s: slow, but every one finishes
        assert check.beat(store) is None
        assert check.dead_peer() is None
