"""The elastic membership protocol on a real TCPStore in this process: the first formation,
re-forming without a lost member, the minimum, admitting a joiner, and the watcher that turns
a lost member into a failure of the group (`phalanx.communication.membership.membership`)."""

from __future__ import annotations

import threading
import time

import pytest

from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.membership.membership import (
    BelowMinimumWorkersError,
    ElasticSettings,
    Member,
    Membership,
)
from support.membership import membership, run_together


def _mark_dead(membership: Membership, task: int) -> None:
    membership.connect().set(f"alive/{task}", "dead")  # what the launcher writes at an exit


def test_settings_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("PHALANX_MIN_WORKERS", raising=False)
    assert ElasticSettings.from_env() is None  # not elastic: today's behaviour
    monkeypatch.setenv("PHALANX_MIN_WORKERS", "2")
    monkeypatch.setenv("PHALANX_ELASTIC_STORE", "127.0.0.1:1234")
    monkeypatch.setenv("PHALANX_ELASTIC_INCARNATION", "3")
    assert ElasticSettings.from_env() == ElasticSettings(("127.0.0.1", 1234), 2, 3, 3.0)


@pytest.mark.parametrize(
    ("minimum", "store"), [("two", "127.0.0.1:1"), ("0", "127.0.0.1:1"), ("2", ""), ("2", "h:x")]
)
def test_malformed_settings_are_refused(monkeypatch, minimum, store):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setenv("PHALANX_MIN_WORKERS", minimum)
    monkeypatch.setenv("PHALANX_ELASTIC_STORE", store)
    with pytest.raises(ValueError, match="outlives every worker"):
        ElasticSettings.from_env()


def test_torchruns_agent_store_serves_when_no_store_is_named(monkeypatch):
    monkeypatch.setenv("PHALANX_MIN_WORKERS", "1")
    monkeypatch.delenv("PHALANX_ELASTIC_STORE", raising=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "true")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    settings = ElasticSettings.from_env()
    assert settings is not None
    assert settings.store == ("10.0.0.1", 29500)


def test_survivors_re_form_without_the_lost_member_and_the_lowest_task_is_rank_0(membership_store):
    port = membership_store
    members = [membership(port, t) for t in range(3)]
    run_together(*(m.start for m in members))
    assert [m.epoch for m in members] == [0, 0, 0]
    assert members[2].members == [Member(0, 0), Member(1, 0), Member(2, 0)]
    assert members[2].rank == 2
    _mark_dead(members[0], 0)  # the chief is lost
    members[0].stop()
    run_together(members[1].reform, members[2].reform)
    assert members[1].epoch == members[2].epoch == 1
    assert members[1].members == [Member(1, 0), Member(2, 0)]
    assert (members[1].rank, members[2].rank, members[1].task_name(0)) == (0, 1, "worker:1")
    for m in members[1:]:
        m.stop()


def test_a_member_whose_beacon_stops_is_a_failure_of_the_group(membership_store):
    port = membership_store
    members = [membership(port, t, tasks=2, minimum=1) for t in range(2)]
    run_together(*(m.start for m in members))
    assert members[0].failure() is None
    members[1].stop()  # silent from now on: no beacon, no exit mark
    deadline = time.monotonic() + 30
    while members[0].failure() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "worker:1 sent no beacon for 1s" in str(members[0].failure())
    members[0].stop()


def test_below_the_minimum_every_survivor_raises_by_name(membership_store):
    port = membership_store
    members = [membership(port, t, tasks=2, minimum=2) for t in range(2)]
    run_together(*(m.start for m in members))
    _mark_dead(members[0], 1)
    members[1].stop()
    with pytest.raises(
        BelowMinimumWorkersError, match=r"Only 1 workers are left \(\['worker:0'\]\).*minimum of 2"
    ):
        members[0].reform()
    members[0].stop()


def test_a_restarted_task_asks_to_join_and_is_admitted_at_the_next_re_form(membership_store):
    port = membership_store
    members = [membership(port, t) for t in range(3)]
    run_together(*(m.start for m in members))
    _mark_dead(members[0], 2)
    members[2].stop()
    run_together(members[0].reform, members[1].reform)
    joiner = membership(port, 2, incarnation=1)
    joining = threading.Thread(target=joiner.start)
    joining.start()
    deadline = time.monotonic() + 30
    while not (members[0].join_pending and members[1].join_pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert members[0].join_pending
    assert members[1].join_pending
    run_together(members[0].reform, members[1].reform)
    joining.join(timeout=30)
    assert joiner.epoch == members[0].epoch == 2
    assert joiner.members == [Member(0, 0), Member(1, 0), Member(2, 1)]
    assert joiner.rank == 2
    for m in (*members[:2], joiner):
        m.stop()


def test_a_restarted_chief_joins_after_the_members_that_stayed(membership_store):
    """Rank 0 hands every member its state: a restarted task 0 must not be rank 0."""
    port = membership_store
    members = [membership(port, t) for t in range(3)]
    run_together(*(m.start for m in members))
    _mark_dead(members[0], 0)
    members[0].stop()
    run_together(members[1].reform, members[2].reform)
    joiner = membership(port, 0, incarnation=1)
    joining = threading.Thread(target=joiner.start)
    joining.start()
    deadline = time.monotonic() + 30
    while not (members[1].join_pending and members[2].join_pending) and time.monotonic() < deadline:
        time.sleep(0.05)
    run_together(members[1].reform, members[2].reform)
    joining.join(timeout=30)
    assert joiner.members == members[1].members == [Member(1, 0), Member(2, 0), Member(0, 1)]
    assert (members[1].rank, members[2].rank, joiner.rank) == (0, 1, 2)
    for m in (*members[1:], joiner):
        m.stop()


def test_a_task_left_out_of_an_epoch_is_told_so(membership_store):
    port = membership_store
    member = membership(port, 1, tasks=2, minimum=1)
    member.members, member.epoch = [Member(0, 0), Member(1, 0)], 0
    keys = member.connect()
    keys.set("e/1/members", "0:0")  # the others decided without it
    keys.add("e/1/decider/0", 1)
    with pytest.raises(PeerUnavailableError, match="worker:1 was left out of membership epoch 1"):
        member.reform()


def test_a_joiner_that_is_never_admitted_gives_up_by_name(membership_store):
    settings = ElasticSettings(("127.0.0.1", membership_store), 1, incarnation=1, dead_after=1.0)
    joiner = Membership(settings, 1, 2, lambda t: f"worker:{t}", timeout=0.5)
    with pytest.raises(
        PeerUnavailableError, match="worker:1 was not admitted to the running job within 0.5s"
    ):
        joiner.start()
    assert not _watchers()


def test_a_decision_that_never_comes_is_named(membership_store):
    settings = ElasticSettings(("127.0.0.1", membership_store), 1)
    member = Membership(settings, 0, 2, lambda t: f"worker:{t}", timeout=0.3)
    member.members, member.epoch = [Member(0, 0), Member(1, 0)], 0
    member.connect().add("e/1/decider/0", 1)  # another member took the decision (and never says who)
    with pytest.raises(
        PeerUnavailableError, match="worker:0 gave up after 5.3s waiting for the members of epoch 1"
    ):
        member.reform()


def test_a_decider_lost_before_it_decides_is_replaced(membership_store):
    members = [membership(membership_store, t) for t in range(3)]
    run_together(*(m.start for m in members))
    keys = members[2].connect()
    keys.add("e/1/decider/0", 1)  # worker:2 takes the decision of epoch 1 ...
    keys.set("e/1/decider/0/task", "2:0")
    _mark_dead(members[2], 2)  # ... and is killed before it writes the members
    members[2].stop()
    run_together(members[0].reform, members[1].reform)
    assert members[0].epoch == members[1].epoch == 1
    assert members[0].members == [Member(0, 0), Member(1, 0)]
    for m in members[:2]:
        m.stop()


def test_a_joiner_is_told_when_the_job_finished_first(membership_store):
    member = membership(membership_store, 0, tasks=2, minimum=1)
    member.connect().set("finished", "1")  # what a member's close() writes
    joiner = membership(membership_store, 1, tasks=2, minimum=1, incarnation=1)
    with pytest.raises(
        PeerUnavailableError, match="worker:1 was restarted to join the job, but the job finished"
    ):
        joiner.start()
    # its watcher stopped with the error: a daemon thread left inside a store call when the
    # interpreter finalizes aborts the process (SIGABRT instead of this error)
    assert not _watchers()


def _watchers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "phalanx-membership"]


def test_the_watcher_is_stopped_at_exit_however_the_program_ends(membership_store, monkeypatch):
    registered = []
    monkeypatch.setattr("atexit.register", registered.append)
    monkeypatch.setattr("atexit.unregister", lambda f: None)
    member = membership(membership_store, 0, tasks=1, minimum=1)
    member.start()
    assert registered == [member.stop]
    assert _watchers()
    registered[0]()  # what the interpreter runs at exit, before it finalizes
    assert not _watchers()
