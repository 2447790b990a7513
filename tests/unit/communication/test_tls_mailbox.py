"""How point-to-point messages meet their receives (`phalanx.communication.transports.tls.mailbox`):
by channel, sender and tag, in order, whichever comes first; no sockets (the links:
tests/security/test_point_to_point_links.py)."""

from __future__ import annotations

import pytest

from phalanx.communication.group.work import PeerGoneError, QueuedWork
from phalanx.communication.transports.tls.mailbox import Mailbox, Receive


def _name(rank):
    return f"worker:{rank} (127.0.0.1:{2220 + rank})"


def _receive(source, tag, nbytes=2, channel=7):
    return Receive(
        channel, source, tag, memoryview(bytearray(nbytes)), QueuedWork("recv"), f"recv from {source}"
    )


def _message(box, source, tag, payload, channel=7):
    """What a link's reader does with one frame: the header, the payload, done."""
    buffer, arrival = box.arrive(channel, source, tag, len(payload))
    buffer[:] = payload
    if arrival is not None:
        box.filled(arrival)


def test_a_message_waits_for_its_receive_and_a_receive_for_its_message():
    box = Mailbox(_name)
    _message(box, 1, 5, b"ab")  # sent before anyone receives
    early = _receive(1, 5)
    box.post(early)
    assert early.work.is_completed()
    assert bytes(early.into) == b"ab"
    late = _receive(1, 5)
    box.post(late)  # received before anything is sent
    assert not late.work.is_completed()
    _message(box, 1, 5, b"cd")
    assert late.work.is_completed()
    assert bytes(late.into) == b"cd"
    assert late.sender == 1


def test_tags_senders_and_groups_are_matched_apart_and_in_order_within_each():
    box = Mailbox(_name)
    for source, tag, channel, payload in [
        (1, 1, 7, b"a1"),
        (1, 2, 7, b"a2"),
        (2, 1, 7, b"b1"),
        (1, 1, 8, b"g1"),  # another group: the same tag never meets group 7's receive
        (1, 1, 7, b"a3"),
    ]:
        _message(box, source, tag, payload, channel)
    got = []
    for source, tag, channel in [(1, 2, 7), (1, 1, 7), (1, 1, 7), (2, 1, 7), (1, 1, 8)]:
        receive = _receive(source, tag, channel=channel)
        box.post(receive)
        assert receive.work.is_completed()
        got.append(bytes(receive.into))
    assert got == [b"a2", b"a1", b"a3", b"b1", b"g1"]


def test_a_receive_from_any_sender_takes_the_first_message_with_its_tag_and_says_who():
    box = Mailbox(_name)
    anyone = _receive(None, 3)
    box.post(anyone)
    _message(box, 2, 4, b"xx")  # another tag
    assert not anyone.work.is_completed()
    _message(box, 1, 3, b"yy")
    assert anyone.work.is_completed()
    assert bytes(anyone.into) == b"yy"
    assert anyone.sender == 1


def test_a_message_whose_payload_is_still_read_goes_to_a_receive_posted_meanwhile():
    box = Mailbox(_name)
    buffer, arrival = box.arrive(7, 1, 0, 2)  # the header is in, the payload not yet
    receive = _receive(1, 0)
    box.post(receive)
    assert not receive.work.is_completed()
    buffer[:] = b"ok"
    box.filled(arrival)
    assert receive.work.is_completed()
    assert bytes(receive.into) == b"ok"


def test_a_message_of_another_size_fails_its_receive_naming_the_sender():
    box = Mailbox(_name)
    posted = _receive(1, 0, nbytes=4)
    box.post(posted)
    _message(box, 1, 0, b"ab")
    with pytest.raises(
        ValueError, match=r"worker:1 \(127.0.0.1:2221\) sent 2 bytes where this worker receives 4"
    ):
        posted.work.wait()
    _message(box, 1, 0, b"abc")  # arrived first, then received with another size
    later = _receive(1, 0, nbytes=4)
    box.post(later)
    with pytest.raises(ValueError, match="sent 3 bytes where this worker receives 4.*HINT"):
        later.work.wait()


def test_a_sender_that_is_gone_fails_its_receives_now_and_later_but_not_others():
    box = Mailbox(_name)
    _message(box, 1, 0, b"in")  # sent before it went: still delivered
    waiting, other = _receive(1, 9), _receive(2, 9)
    box.post(waiting)
    box.post(other)
    box.sender_gone(1, PeerGoneError("worker:1 closed its point-to-point link"))
    with pytest.raises(PeerGoneError, match="worker:1 closed"):
        waiting.work.wait()
    assert not other.work.is_completed()
    kept = _receive(1, 0)
    box.post(kept)
    assert bytes(kept.into) == b"in"
    later = _receive(1, 0)
    box.post(later)
    with pytest.raises(PeerGoneError, match="worker:1 closed"):
        later.work.wait()
    buffer, arrival = box.arrive(7, 2, 9, 2)
    box.filled(arrival, PeerGoneError("worker:2 closed its point-to-point link mid-message"))
    with pytest.raises(PeerGoneError, match="mid-message"):
        other.work.wait()
    box.close(PeerGoneError("the point-to-point links were closed"))
    last = _receive(2, 1)
    box.post(last)
    with pytest.raises(PeerGoneError, match="were closed"):
        last.work.wait()
