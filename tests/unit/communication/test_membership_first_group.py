"""The first formation of an elastic job (`Membership.start`, every task of incarnation 0) when a
task is lost before it joins: the first group forms over the tasks that are there, the lost task
(restarted) joins at the first step boundary, and the group's check-in stops waiting for a member
the membership took for lost (`Rendezvous.check_in`). Real TCPStore in this process."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch.distributed as dist

from phalanx.communication.checks.health import HealthCheck, PeerUnavailableError
from phalanx.communication.membership.membership import BelowMinimumWorkersError, Member, Membership
from phalanx.communication.membership.rendezvous import Rendezvous
from support.membership import membership, run_together


def _stop(*members: Membership) -> None:
    for m in members:
        m.stop()


def test_a_task_that_exited_before_joining_is_left_out_of_the_first_group(membership_store, caplog):
    members = [membership(membership_store, t) for t in range(2)]
    members[0].connect().set("alive/2", "dead")  # what the launcher writes when task 2 exits
    with caplog.at_level(logging.WARNING, logger="phalanx"):
        assert run_together(*(m.start for m in members)) == [None, None]
    assert [m.epoch for m in members] == [0, 0]
    assert members[0].members == members[1].members == [Member(0, 0), Member(1, 0)]
    assert not members[0].joined
    formed = "the first group formed with 2 workers ['worker:0', 'worker:1']; missing: ['worker:2']"
    assert formed in caplog.text
    _stop(*members)


def test_a_task_that_never_checks_in_is_left_out_after_the_timeout(membership_store):
    members = [membership(membership_store, t, timeout=1.0) for t in range(2)]  # task 2 never starts
    assert run_together(*(m.start for m in members)) == [None, None]
    assert members[1].members == [Member(0, 0), Member(1, 0)]
    _stop(*members)


def test_a_restarted_task_is_not_in_the_first_group_and_joins_at_the_next_re_form(membership_store):
    """The launcher restarted task 2 before the first group formed: its first incarnation counts
    as lost, and the new one is not admitted into the first group (the members do not hand out
    their state there) but waits, and is admitted at the next re-form (the first step boundary)."""
    members = [membership(membership_store, t) for t in range(2)]
    joiner = membership(membership_store, 2, incarnation=1)
    joining = threading.Thread(target=joiner.start)
    joining.start()
    deadline = time.monotonic() + 30
    while not members[0].connect().check(["join/2"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert run_together(*(m.start for m in members)) == [None, None]
    assert members[0].members == [Member(0, 0), Member(1, 0)]
    while not all(m.join_pending for m in members) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(m.join_pending for m in members)
    run_together(*(m.reform for m in members))
    joining.join(timeout=30)
    assert joiner.joined
    assert joiner.members == members[0].members == [Member(0, 0), Member(1, 0), Member(2, 1)]
    _stop(*members, joiner)


def test_a_first_task_that_comes_after_the_first_group_formed_joins(membership_store):
    members = [membership(membership_store, t, timeout=1.0) for t in range(2)]
    run_together(*(m.start for m in members))
    late = membership(membership_store, 2)  # incarnation 0, but the first group formed without it
    joining = threading.Thread(target=late.start)
    joining.start()
    deadline = time.monotonic() + 30
    while not all(m.join_pending for m in members) and time.monotonic() < deadline:
        time.sleep(0.05)
    run_together(*(m.reform for m in members))
    joining.join(timeout=30)
    assert late.joined  # it takes the chief's state at its first boundary
    assert late.members == [Member(0, 0), Member(1, 0), Member(2, 0)]
    _stop(*members, late)


def test_a_re_form_that_does_not_admit_leaves_the_joiner_waiting(membership_store):
    """``reform(admit=False)``: what the members do when the first group fails while it forms."""
    members = [membership(membership_store, t) for t in range(3)]
    run_together(*(m.start for m in members))
    members[0].connect().set("alive/2", "dead")
    members[2].stop()
    joiner = membership(membership_store, 2, incarnation=1)
    joining = threading.Thread(target=joiner.start)
    joining.start()
    deadline = time.monotonic() + 30
    while not members[0].connect().check(["join/2"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    run_together(*(lambda m=m: m.reform(admit=False) for m in members[:2]))
    assert members[0].members == members[1].members == [Member(0, 0), Member(1, 0)]
    assert joining.is_alive()  # still waiting, and still asking
    run_together(*(m.reform for m in members[:2]))
    joining.join(timeout=30)
    assert joiner.members == [Member(0, 0), Member(1, 0), Member(2, 1)]
    _stop(*members[:2], joiner)


def test_below_the_minimum_at_the_first_formation_names_who_is_missing(membership_store):
    member = membership(membership_store, 0, tasks=2, minimum=2)
    member.connect().set("alive/1", "dead")
    with pytest.raises(
        BelowMinimumWorkersError, match=r"Only 1 workers are left \(\['worker:0'\]\).*missing: \['worker:1'\]"
    ):
        member.start()


def test_the_check_in_stops_at_the_membership_verdict_and_names_who_is_missing(membership_store):
    store = dist.TCPStore("127.0.0.1", membership_store, None, is_master=False)
    name = lambda r: f"worker:{r}"  # noqa: E731
    rendezvous = Rendezvous("127.0.0.1", membership_store, 0, 2, name, "g0/", agent_store=True)
    keys = dist.PrefixStore("g0/", store)
    verdict: list[str] = []
    checking = threading.Thread(target=lambda: verdict.append(str(_check_in(rendezvous, keys, verdict))))
    checking.start()
    time.sleep(0.3)
    assert checking.is_alive()  # it waits for worker:1
    verdict.append("worker:1 exited")
    checking.join(timeout=30)
    assert "Stopped waiting for ['worker:1'] to join the group: worker:1 exited" in verdict[-1]
    assert keys.check([HealthCheck.key(0)])  # it had checked in


def _check_in(rendezvous: Rendezvous, keys, verdict: list[str]) -> BaseException | None:
    try:
        rendezvous.check_in(keys, time.monotonic() + 60, 60, lambda: verdict[0] if verdict else None)
    except PeerUnavailableError as exc:
        return exc
    return None
