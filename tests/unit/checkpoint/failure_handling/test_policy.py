"""The preemption state machine, one step at a time (no processes)."""

import pytest

from phalanx.checkpoint.failure_handling.policy import Decision, Flags, PreemptionPolicy, State


def test_without_grace_period_a_notice_anywhere_saves_and_exits_once():
    policy = PreemptionPolicy(grace_period=0)
    assert policy.decide(Flags()) is Decision.CONTINUE
    assert policy.decide(Flags(notice=True)) is Decision.SAVE_AND_EXIT
    assert policy.state is State.DONE
    assert policy.decide(Flags(notice=True, time_is_up=True)) is Decision.CONTINUE  # after exit_fn returned


def test_with_grace_period_saves_trains_on_then_saves_and_exits_when_time_is_up():
    policy = PreemptionPolicy(grace_period=60)
    assert policy.decide(Flags(notice=True)) is Decision.SAVE
    assert policy.state is State.COUNTDOWN
    assert policy.decide(Flags(notice=True)) is Decision.CONTINUE
    assert policy.decide(Flags(notice=True, time_is_up=True)) is Decision.SAVE_AND_EXIT
    assert policy.state is State.DONE


def test_grace_period_already_spent_saves_once_and_exits():
    policy = PreemptionPolicy(grace_period=5)
    assert policy.decide(Flags(notice=True, time_is_up=True)) is Decision.SAVE_AND_EXIT


def test_local_flags_measure_the_time_left_against_steps_and_saves():
    policy = PreemptionPolicy(grace_period=100)
    assert policy.local_flags(None, now=50, step_seconds=1, save_seconds=1) == Flags()
    # margin = 3 * (2 * 1 + 4) = 18: time is up from 10 + 100 - 18 = 92 on
    assert policy.local_flags(10, now=91.9, step_seconds=1, save_seconds=4) == Flags(notice=True)
    assert policy.local_flags(10, now=92, step_seconds=1, save_seconds=4) == Flags(True, True)


def test_no_flags_once_done():
    policy = PreemptionPolicy(grace_period=0)
    policy.decide(Flags(notice=True))
    assert policy.local_flags(0, now=1, step_seconds=0, save_seconds=0) == Flags()


@pytest.mark.parametrize(
    ("flags", "ints"), [(Flags(), [0, 0]), (Flags(True, False), [1, 0]), (Flags(True, True), [1, 1])]
)
def test_flags_travel_as_integers(flags, ints):
    assert flags.as_ints() == ints
