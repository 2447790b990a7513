"""Errors between workers, without processes: a peer's error posted on the board interrupts the
step waiting for that peer and becomes a PeerFailedError naming it."""

import threading
import time

import pytest

from phalanx.checkpoint.failure_handling.board import Board, Message
from phalanx.checkpoint.failure_handling.coordination import PeerFailedError, PreemptionCoordinator
from phalanx.checkpoint.failure_handling.termination import TerminationConfig


@pytest.fixture
def coordinator(one_device):
    made = PreemptionCoordinator(one_device, TerminationConfig(termination_watcher_fn=lambda: False), "test")
    yield made
    made.close()


def _peer_error(board: Board) -> None:
    board._record(Message("error", "worker:1 (10.0.0.2:2222)", "ValueError: bad batch 7"))


def test_a_peer_error_interrupts_the_step_that_waits_for_that_peer(coordinator):
    waiting = threading.Event()
    poster = threading.Thread(target=lambda: waiting.wait(10) and _peer_error(coordinator.board))
    poster.start()

    def step():  # waits in a collective the peer will never join, in slices (as phalanx's own
        waiting.set()  # waits do): the interrupt lands at the next slice, not after 30 s
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.05)

    with pytest.raises(PeerFailedError) as failed, coordinator.share_errors():
        step()
    poster.join()
    assert failed.value.task == "worker:1 (10.0.0.2:2222)"
    assert failed.value.error == "ValueError: bad batch 7"
    assert "raised ValueError: bad batch 7 in its training function, so this worker" in str(failed.value)
    assert isinstance(failed.value.__cause__, KeyboardInterrupt)


def test_a_known_peer_error_stops_the_next_step_before_it_starts(coordinator):
    _peer_error(coordinator.board)
    ran = []
    with pytest.raises(PeerFailedError, match="worker:1"), coordinator.share_errors():
        ran.append(1)
    assert not ran


def test_an_own_error_is_posted_and_raised(coordinator):
    with pytest.raises(ZeroDivisionError), coordinator.share_errors():
        _ = 1 / 0
    posted = coordinator.board.messages("error")
    assert [(m.task, m.text) for m in posted] == [("this worker", "ZeroDivisionError: division by zero")]


def test_a_real_ctrl_c_stays_a_keyboard_interrupt(coordinator):
    with pytest.raises(KeyboardInterrupt), coordinator.share_errors():
        raise KeyboardInterrupt
