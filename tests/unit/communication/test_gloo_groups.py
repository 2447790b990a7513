"""The gloo groups under phalanx's process groups: each interface's device twice (two
connections between each pair of workers), or as many times as PHALANX_GLOO_CONNECTIONS says."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from phalanx.communication.transports.gloo.groups import (
    GLOO_CONNECTIONS,
    GLOO_CONNECTIONS_ENV,
    gloo_connections,
    make_gloo_group,
)


def _group() -> dist.ProcessGroupGloo:
    return make_gloo_group(dist.HashStore(), 0, 1, timedelta(seconds=30))


def test_each_pair_gets_two_connections_and_torchs_two_threads_by_default(monkeypatch):
    monkeypatch.delenv(GLOO_CONNECTIONS_ENV, raising=False)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    group = _group()
    assert GLOO_CONNECTIONS == 2
    assert len(group.options._devices) == 2
    assert group.options._threads == 2
    tensor = torch.arange(4.0)
    group.allreduce([tensor]).wait()
    assert torch.equal(tensor, torch.arange(4.0))


def test_the_count_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(GLOO_CONNECTIONS_ENV, "1")
    assert len(_group().options._devices) == 1  # torch's own layout
    monkeypatch.setenv(GLOO_CONNECTIONS_ENV, " 3 ")
    assert gloo_connections() == 3


def test_every_interface_of_gloo_socket_ifname_gets_the_connections(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    monkeypatch.setenv(GLOO_CONNECTIONS_ENV, "2")
    group = _group()
    assert len(group.options._devices) == 4
    assert group.options._threads == 4  # torch gives two threads per interface


@pytest.mark.parametrize("raw", ["0", "9", "two", "-1", "1.5"])
def test_a_count_outside_1_to_8_is_refused_with_the_fix(monkeypatch, raw):
    monkeypatch.setenv(GLOO_CONNECTIONS_ENV, raw)
    with pytest.raises(ValueError, match="GLOO_CONNECTIONS must be a whole number from 1 to 8") as err:
        gloo_connections()
    assert repr(raw) in str(err.value)
    assert "HINT" in str(err.value)
