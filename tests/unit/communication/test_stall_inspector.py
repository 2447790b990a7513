"""The stall inspector, one heartbeat round at a time, on an in-process store with a fake clock.

Two workers' `HealthCheck`s carry their `StallInspector` states through a real `HashStore`;
the trackers are driven as `WorkerGroup` drives them when collectives are issued and waited for.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict

import pytest
import torch
import torch.distributed as dist

from phalanx import CommunicationOptions
from phalanx.communication.checks.call_sites import call_site
from phalanx.communication.checks.collective_watch import CollectiveWatch
from phalanx.communication.checks.health import HealthCheck
from phalanx.communication.checks.signatures import Signature, WorkerState, shapes_of
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError, StallSettings

SETTINGS = StallSettings(timeout=30.0, warning=10.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _name(rank: int) -> str:
    return f"worker:{rank} (host{rank}:2222)"


class Pair:
    """Two workers' watches and health checks on one store."""

    def __init__(self, settings: StallSettings = SETTINGS) -> None:
        self.store, self.clock = dist.HashStore(), Clock()
        self.watches = [CollectiveWatch(r, 2, _name, settings, self.clock) for r in range(2)]
        for rank, watch in enumerate(self.watches):  # as the rendezvous' check-in does
            watch.publish_initial(self.store)
            self.store.add(HealthCheck.key(rank), 1)
        self.checks = [
            HealthCheck(lambda: self.store, r, 2, _name, clock=self.clock, gossip=w.inspector)
            for r, w in enumerate(self.watches)
        ]

    def rounds(self, seconds: float) -> list[str | None]:
        """Heartbeat rounds every second for ``seconds``; the verdicts after the last one."""
        for _ in range(int(seconds)):
            self.clock.now += 1.0
            for check in self.checks:
                check.beat(self.store)
        return [w.verdict for w in self.watches]

    def wait_in(self, rank: int, kind: str, what: str, shape: tuple[int, ...] = (4,)) -> None:
        """Worker ``rank`` issues a collective and waits in it."""
        work = object()
        signature = self.watches[rank].issue(kind, [torch.zeros(shape)], what)
        self.watches[rank].attach(work, signature)
        self.watches[rank].begin_wait(work, what)


def test_workers_in_different_collectives_are_named_on_both_after_the_bound():
    pair = Pair()
    pair.wait_in(0, "all_reduce(SUM)", "the gradient all-reduce", (182,))
    pair.wait_in(1, "broadcast(from 0)", "the broadcast of initial values from the chief")
    assert pair.rounds(29) == [None, None]
    for message in pair.rounds(2):  # each worker names the longest waiter it sees
        assert message is not None
        assert message.startswith(
            "Every worker must call the same collectives in the same order, but worker:"
        )
        for part in (
            "the workers took different paths. Received: ",
            "worker:0 (host0:2222) waits in the gradient all-reduce #1 (test_stall_inspector.py:",
            "[all_reduce(SUM) of float32[182]]",
            "worker:1 (host1:2222) waits in the broadcast of initial values from the chief #1",
            "[broadcast(from 0) of float32[4]]",
            "HINT: every worker must call the same collectives in the same order",
        ):
            assert part in message, message
    assert isinstance(pair.watches[1].error(), CollectiveMismatchError)


def test_the_chief_warns_naming_the_laggard_at_the_warning_bound(caplog):
    pair = Pair()
    pair.wait_in(0, "all_reduce(SUM)", "all_reduce")
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        pair.rounds(12)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per stall
    assert warnings[0].startswith("Stalled collective: worker:0 (host0:2222) has waited")
    assert "for ['worker:1 (host1:2222)'], which are not in the same collective" in warnings[0]
    assert "worker:1 (host1:2222) is not in a collective (it computes, or took another path)" in warnings[0]
    assert pair.rounds(20)[0] is not None


def test_workers_waiting_in_the_same_collective_are_never_a_mismatch():
    pair = Pair()
    pair.wait_in(0, "all_reduce(SUM)", "all_reduce")
    pair.wait_in(1, "all_reduce(SUM)", "all_reduce")
    assert pair.rounds(100) == [None, None]  # a slow or dead peer is the health check's business


def test_a_worker_that_already_finished_the_collective_is_not_a_laggard():
    pair = Pair()
    pair.wait_in(0, "all_reduce(SUM)", "all_reduce")
    pair.wait_in(1, "all_reduce(SUM)", "all_reduce")
    pair.watches[1].end_wait()  # gloo finished it on worker:1 first; it computes on
    assert pair.rounds(60) == [None, None]


def test_a_closing_worker_is_named_and_sees_the_mismatch_at_once():
    pair = Pair()
    pair.wait_in(0, "all_reduce(SUM)", "all_reduce")
    pair.watches[1].begin_closing()
    pair.rounds(1)
    suspicion = pair.watches[1].suspicion()  # what close() raises if worker:0 exits first
    assert suspicion is not None
    assert "worker:1 (host1:2222) is closing its strategy (test_stall_inspector.py:" in suspicion
    assert pair.watches[1].explains(suspicion)
    assert "is closing its strategy" in pair.rounds(31)[0]


def test_an_inspector_that_is_off_signs_nothing():
    watch = CollectiveWatch(0, 2, _name, StallSettings(enabled=False))
    assert watch.issue("all_reduce(SUM)", [torch.zeros(2)], "all_reduce") is None
    watch.begin_closing()
    assert watch.suspicion() is None
    assert watch.error() is None


def test_detail_names_the_first_collective_whose_shapes_differ():
    pair = Pair(StallSettings(timeout=30.0, warning=10.0, debug=True))
    theirs = Signature(1, "all_reduce(SUM)", "all_reduce", "strategy.reduce at train.py:9", "float32[]")
    pair.store.set("detail/1/1", json.dumps(asdict(theirs)))
    with pytest.raises(CollectiveMismatchError) as caught:
        pair.watches[0].issue("all_reduce(SUM)", [torch.zeros(182)], "all_reduce")
    message = str(caught.value)
    assert "(PHALANX_DISTRIBUTED_DEBUG=DETAIL), but collective #1 differs" in message
    assert "worker:0 (host0:2222) issued all_reduce #1 (test_stall_inspector.py:" in message
    assert "[all_reduce(SUM) of float32[182]]" in message
    assert "worker:1 (host1:2222) issued all_reduce #1 (strategy.reduce at train.py:9)" in message


def test_detail_names_a_worker_that_issued_no_matching_collective():
    pair = Pair(StallSettings(timeout=0.2, warning=0.1, debug=True))
    with pytest.raises(
        CollectiveMismatchError, match=r"but \['worker:1 \(host1:2222\)'\] issued no collective #1"
    ):
        pair.watches[0].issue("broadcast(from 0)", [torch.zeros(3)], "broadcast")


def test_detail_passes_matching_collectives():
    pair = Pair(StallSettings(timeout=30.0, warning=10.0, debug=True))
    theirs = Signature(1, "broadcast(from 0)", "broadcast", "Model.fit at b.py:3", "float32[3]")
    pair.store.set("detail/1/1", json.dumps(asdict(theirs)))
    assert pair.watches[0].issue("broadcast(from 0)", [torch.zeros(3)], "broadcast") is not None


def test_worker_states_travel_as_bytes():
    shapes = shapes_of([torch.zeros(2, 3), torch.zeros(1, dtype=torch.int64)])
    pair = Pair()
    pair.wait_in(0, "all_gather", "all_gather", (2, 3))
    state = pair.watches[0].tracker.state()
    assert WorkerState.from_bytes(state.to_bytes()) == state
    assert shapes == "float32[2,3]+int64[1]"
    assert WorkerState().describe() == (
        "is not in a collective (it computes, or took another path); it issued no collective yet"
    )


def test_call_site_names_the_first_frame_outside_the_libraries():
    def helper() -> str:
        return call_site()  # its caller's caller: this test

    assert helper().startswith("test_stall_inspector.py:")


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"PHALANX_STALL_TIMEOUT_SECONDS": "0"}, "PHALANX_STALL_TIMEOUT_SECONDS must be a positive number"),
        ({"PHALANX_STALL_TIMEOUT_SECONDS": "soon"}, "Received: PHALANX_STALL_TIMEOUT_SECONDS='soon'"),
        ({"PHALANX_STALL_WARNING_SECONDS": "40"}, "The stall warning must come before the stall error"),
        ({"PHALANX_STALL_INSPECTOR": "maybe"}, "PHALANX_STALL_INSPECTOR must be 1 or 0"),
        ({"PHALANX_DISTRIBUTED_DEBUG": "LOUD"}, "PHALANX_DISTRIBUTED_DEBUG must be OFF, INFO or DETAIL"),
    ],
)
def test_bad_settings_are_refused(monkeypatch, env, error):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=error):
        StallSettings.from_env()


def test_settings_from_the_environment_and_the_options(monkeypatch):
    assert StallSettings.from_env() == StallSettings(True, 30.0, 10.0, False)
    monkeypatch.setenv("PHALANX_STALL_TIMEOUT_SECONDS", "3")
    monkeypatch.setenv("PHALANX_DISTRIBUTED_DEBUG", "detail")
    assert StallSettings.from_env() == StallSettings(True, 3.0, 1.0, True)
    assert StallSettings.from_env(timeout=60.0).timeout == 60.0  # CommunicationOptions wins
    monkeypatch.setenv("PHALANX_STALL_INSPECTOR", "off")
    assert StallSettings.from_env() == StallSettings(False, 3.0, 1.0, False)


def test_communication_options_refuse_a_stall_bound_that_is_not_positive():
    assert CommunicationOptions(stall_timeout_seconds=5).stall_timeout_seconds == 5
    with pytest.raises(ValueError, match="stall_timeout_seconds must be positive or None. Received: 0"):
        CommunicationOptions(stall_timeout_seconds=0)
