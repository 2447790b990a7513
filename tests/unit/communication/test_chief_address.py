"""The chief's rendezvous store listens on the chief's address from the cluster spec, and only there."""

from __future__ import annotations

import socket

import pytest

from phalanx.communication.group.worker_group import WorkerGroup
from phalanx.communication.membership.rendezvous import listening_socket
from phalanx.communication.transports.interfaces import interface_addresses


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_listening_socket_is_bound_to_the_given_address_only(host):
    if host == "::1" and ("lo", "::1") not in interface_addresses():
        pytest.skip("no IPv6 loopback address here")
    with socket.socket(fileno=listening_socket(host, 0)) as sock:
        assert sock.getsockname()[0] == host  # never 0.0.0.0 / :: (every interface)
        port = sock.getsockname()[1]
        with socket.create_connection((host, port), timeout=5):
            pass


def test_a_chief_address_of_another_machine_is_a_clear_error():
    expected = (
        r"must serve the rendezvous at port 29999 of its address 192\.0\.2\.1, but it cannot listen there"
    )
    with pytest.raises(ValueError, match=expected):
        WorkerGroup("192.0.2.1", 29999, 0, 2, "gloo", lambda r: f"worker:{r}", join_timeout=1.0)
