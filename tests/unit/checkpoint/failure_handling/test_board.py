"""The board between workers, over a real TCPStore in this process: messages posted by one
worker reach the others by name, values without the cluster token's MAC are not read."""

import pytest
import torch.distributed as dist

from phalanx.checkpoint.failure_handling.board import ClusterBoard
from phalanx.cluster._ports import free_ports
from phalanx.communication.membership.rendezvous import Rendezvous
from phalanx.security.token import TOKEN_ENV

PREFIX = "phalanx-preemption/0/0/"


def _name(rank):
    return f"worker:{rank} (127.0.0.1:{2000 + rank})"


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, "board-test-secret-0123456789")
    (port,) = free_ports(1)
    served = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
    yield served, port
    del served


def _boards(port):
    return [
        ClusterBoard(Rendezvous("127.0.0.1", port, r, 2, _name, PREFIX, False), _name(r)) for r in range(2)
    ]


def test_a_posted_error_reaches_the_other_worker_by_name(store):
    _, port = store
    boards = _boards(port)
    try:
        assert boards[0].peer_error(0) is None
        boards[1].post("error", "ValueError: bad batch 40")
        boards[1].post("notice", "received SIGTERM")
        peer = boards[0].peer_error(10)
        assert peer is not None
        assert (peer.task, peer.text) == (_name(1), "ValueError: bad batch 40")
        assert boards[0].wait_for(lambda: len(boards[0].messages("notice")) == 1, 10)
        assert boards[1].wait_for(lambda: len(boards[1].messages("error")) == 1, 10)
        assert boards[1].peer_error(0) is None  # its own error is not a peer's
    finally:
        for board in boards:
            board.close()


def test_a_value_without_the_tokens_mac_is_not_read(store):
    served, port = store
    boards = _boards(port)
    try:
        served.set(PREFIX + "events", "1")
        served.set(PREFIX + "event/1", '{"kind": "error", "task": "worker:1", "text": "forged"}')
        assert boards[0].peer_error(1.0) is None
    finally:
        for board in boards:
            board.close()


def test_posting_after_the_store_is_gone_is_logged_not_raised(monkeypatch, caplog):
    monkeypatch.setenv(TOKEN_ENV, "board-test-secret-0123456789")
    (port,) = free_ports(1)
    served = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
    board = ClusterBoard(Rendezvous("127.0.0.1", port, 1, 2, _name, PREFIX, False), _name(1))
    del served  # the chief exited
    board.post("error", "ValueError: late")
    board.close()
    assert "Could not tell the other workers that worker:1" in caplog.text
