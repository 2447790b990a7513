"""Finding the interface that holds a task's address, and pointing gloo at it."""

from __future__ import annotations

import os
import socket

import pytest

from phalanx.communication.transports import interfaces
from phalanx.communication.transports.interfaces import (
    GLOO_INTERFACE_ENV,
    bind_gloo_to,
    interface_addresses,
    interface_holding,
    strip_brackets,
)


def _has_ipv6_loopback() -> bool:
    return ("lo", "::1") in interface_addresses()


def test_every_interface_address_is_listed_loopback_included():
    found = interface_addresses()
    assert ("lo", "127.0.0.1") in found
    assert all(socket.inet_pton(socket.AF_INET6 if ":" in a else socket.AF_INET, a) for _, a in found)


def test_the_loopback_address_is_on_lo_in_every_spelling():
    assert interface_holding("127.0.0.1") == "lo"
    assert interface_holding("localhost") == "lo"  # names are resolved
    if _has_ipv6_loopback():
        assert interface_holding("[::1]") == "lo"
        assert interface_holding("::1") == "lo"


def test_an_address_of_no_interface_here_has_none(monkeypatch):
    assert interface_holding("192.0.2.1") is None  # TEST-NET-1: never assigned
    monkeypatch.setattr(socket, "getaddrinfo", pytest.fail)  # reserved names are not even looked up
    assert interface_holding("rank-1.torchrun.invalid") is None


def test_a_name_that_does_not_resolve_has_none(monkeypatch):
    def unresolvable(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", unresolvable)
    assert interface_holding("node-17") is None


def test_gloo_is_pointed_at_the_interface_of_the_tasks_address(monkeypatch):
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    assert bind_gloo_to("127.0.0.1") == "lo"
    assert interface_holding("127.0.0.1") == "lo"
    assert os.environ[GLOO_INTERFACE_ENV] == "lo"


def test_the_users_interface_wins(monkeypatch):
    monkeypatch.setenv(GLOO_INTERFACE_ENV, "eth7")
    monkeypatch.setattr(interfaces, "interface_holding", pytest.fail)
    assert bind_gloo_to("127.0.0.1") == "eth7"


@pytest.mark.parametrize("host", [None, "192.0.2.1"])
def test_without_a_local_address_gloo_keeps_its_default(monkeypatch, host):
    monkeypatch.delenv(GLOO_INTERFACE_ENV, raising=False)
    assert bind_gloo_to(host) is None
    assert GLOO_INTERFACE_ENV not in os.environ


def test_brackets_are_stripped_from_ipv6_hosts_only():
    assert strip_brackets("[fd00::1]") == "fd00::1"
    assert strip_brackets("10.0.0.1") == "10.0.0.1"
