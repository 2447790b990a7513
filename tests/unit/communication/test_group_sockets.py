"""`GroupSockets`: the connections a gloo group opened, shut down so that a collective in flight
on them fails at once (torch's abort() leaves it waiting for the peer or the 600 s timeout).
Two gloo ranks on threads of this process, on a real TCPStore."""

from __future__ import annotations

import socket
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from phalanx.cluster._ports import free_ports
from phalanx.communication.group.recent_works import RecentWorks
from phalanx.communication.group.worker_group import WorkerGroup
from phalanx.communication.transports.gloo.sockets import GroupSockets, open_sockets

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@pytest.fixture
def store():
    (port,) = free_ports(1, "127.0.0.1")
    server = dist.TCPStore("127.0.0.1", port, None, is_master=True, wait_for_workers=False)
    yield server, port
    del server


def _two_ranks(port: int) -> list:
    groups: list = [None, None]

    def make(rank: int) -> None:  # each rank its own store connection, as in two processes
        client = dist.TCPStore("127.0.0.1", port, None, is_master=False)
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g/", client), rank, 2, timedelta(seconds=60))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(g is not None for g in groups)
    return groups


def test_a_collective_in_flight_fails_at_once_when_its_connections_are_shut_down(store):
    _, port = store
    sockets = GroupSockets(("127.0.0.1", port))
    groups = sockets.record(lambda: _two_ranks(port))
    assert len(sockets.connections) >= 2  # each rank's end of their connection
    work = groups[0].allreduce([torch.ones(4)])  # rank 1 never makes it: it waits
    time.sleep(0.2)
    assert not work.is_completed()
    assert sockets.shut_down() >= 1  # the other end may be closed by gloo first, on its error
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="[Cc]onnection"):
        work.wait(timedelta(seconds=20))
    assert time.monotonic() - started < 10  # not the group's 60 s timeout
    assert sockets.connections == []  # nothing is shut down twice


def test_store_connections_and_listening_sockets_are_not_the_groups(store):
    _, port = store
    sockets = GroupSockets(("127.0.0.1", port))
    listener = socket.create_server(("127.0.0.1", 0))
    client = sockets.record(lambda: dist.TCPStore("127.0.0.1", port, None, is_master=False))
    sockets.add(fd for fd in open_sockets() if fd == listener.fileno())
    assert sockets.connections == []
    client.set("still", "usable")
    listener.close()


def test_a_descriptor_closed_and_reused_since_is_left_alone(store):
    _, port = store
    other = socket.create_server(("127.0.0.1", 0))
    first = socket.create_connection(other.getsockname())
    sockets = GroupSockets(("127.0.0.1", port))
    sockets.add([first.fileno()])
    assert len(sockets.connections) == 1
    first.close()
    other.accept()[0].close()
    second = socket.create_connection(other.getsockname())  # may take the same descriptor
    accepted, _ = other.accept()
    assert sockets.shut_down() == 0
    second.sendall(b"ok")
    assert accepted.recv(2) == b"ok"  # the new socket was not shut down
    for s in (second, accepted, other):
        s.close()


class _Work:
    def __init__(self, done: bool) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


def test_a_groups_in_flight_works_are_those_not_completed():
    """`WorkerGroup.in_flight`: what dropping a group waits for (`ElasticGroups.drop`)."""
    group = WorkerGroup.__new__(WorkerGroup)  # no process group: only its held works matter
    group._works, group._subgroup_works = RecentWorks(), [RecentWorks(keep_count=2)]
    assert group.in_flight() == []
    done, waiting, on_subgroup = _Work(True), _Work(False), _Work(False)
    group._works.add(done)
    group._works.add(waiting)
    group._subgroup_works[0].add(on_subgroup)  # a new_group()'s collective: the job's too
    assert group.in_flight() == [waiting, on_subgroup]
    waiting.done = on_subgroup.done = True
    assert group.in_flight() == []
