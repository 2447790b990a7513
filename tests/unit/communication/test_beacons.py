"""The elastic membership's waits and beacons (`phalanx.communication.membership.beacons`) do not count
the time in which nobody could act: torch's TCPStore resolves each new client's address on its
server's one event loop, so a resolver that drops a query stalls every call of every client for
5 s (CI saw a first group fail so). A fake clock, moved by the test, and a real TCPStore in this process."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.communication.membership import beacons as beacons_module
from phalanx.communication.membership.beacons import STORE_CALL_SECONDS, Beacons, Member, Wait
from support.membership import membership


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class _StallingStore:
    """The store, whose next ``get`` takes ``stall`` seconds of the fake clock (then none)."""

    def __init__(self, store: Any, clock: _Clock) -> None:
        self._store, self._clock, self.stall = store, clock, 0.0

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))

    def get(self, key: str) -> bytes:
        self._clock.now += self.stall
        self.stall = 0.0
        return bytes(self._store.get(key))


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(beacons_module, "time", fake)
    return fake


def test_a_round_stuck_longer_than_a_second_does_not_count_against_a_wait(clock):
    wait = Wait(1.0)
    for now, over in [(0.5, False), (5.5, False), (5.9, False), (6.2, True)]:  # 0.5 -> 5.5: stuck
        clock.now = now
        assert wait.over() is over, now


def test_a_wait_leaves_out_at_most_a_store_calls_bound(clock):
    """A store that stays slow (every round 2 s) still ends the wait."""
    wait = Wait(1.0)
    rounds = int(STORE_CALL_SECONDS // 2)
    for _ in range(rounds):
        clock.now += 2.0
        assert not wait.over()
    clock.now += 2.0
    assert wait.over()


def test_a_beacon_that_could_not_move_while_the_store_stalled_is_not_lost(membership_store, clock):
    store = membership(membership_store, 0).connect()
    store.set("alive/1", "0:7")
    stalling = _StallingStore(store, clock)
    beacons = Beacons(stalling, lambda t: f"worker:{t}", dead_after=1.0)
    member = Member(1, 0)
    assert beacons.lost_reason(member) is None  # first seen at 0
    clock.now = 0.5
    assert beacons.lost_reason(member) is None
    stalling.stall = 5.0  # the read waits 5 s behind the server's DNS lookup
    assert beacons.lost_reason(member) is None  # at 5.5, unmoved: it could not have moved
    clock.now = 6.0
    assert beacons.lost_reason(member) is None
    clock.now = 6.7
    assert beacons.lost_reason(member) == "worker:1 sent no beacon for 1s"


def test_a_reader_back_from_idle_gives_an_unmoved_beacon_its_full_time(membership_store, clock):
    store = membership(membership_store, 0).connect()
    store.set("alive/1", "0:7")
    beacons = Beacons(store, lambda t: f"worker:{t}", dead_after=1.0)
    member = Member(1, 0)
    assert beacons.lost_reason(member) is None
    clock.now = 100.0  # a re-form, long after the last: this reader saw nothing meanwhile
    assert beacons.lost_reason(member) is None
    clock.now = 100.6
    assert beacons.lost_reason(member) is None
    clock.now = 101.2
    assert beacons.lost_reason(member) == "worker:1 sent no beacon for 1s"
