"""The transport seam: the registry asks openers in order, the first that opens carries a
group's collectives; shared memory names each group's segments apart; a group of one worker
opens nothing."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from phalanx.communication.group.transports import open_transport
from phalanx.communication.transports import registry
from phalanx.communication.transports.base import OpenRequest
from phalanx.communication.transports.shm.opener import _group_nonce


def _open_one_worker():
    return open_transport(
        dist.HashStore(), 0, 1, ("127.0.0.1", 1), None, lambda r: f"worker:{r}", lambda: None, 10.0, 10.0, id
    )


def test_every_worker_of_a_group_gets_rank_0s_nonce_and_the_next_group_another():
    store = dist.HashStore()
    names: dict[str, list[str]] = {}
    for group in ("phalanx/elastic/g0/", "phalanx/elastic/g1/"):  # two membership epochs
        keys = dist.PrefixStore(group, store)
        found: list[str] = ["", ""]
        late = threading.Thread(target=lambda k=keys, f=found: f.__setitem__(1, _group_nonce(k, 1)))
        late.start()  # a worker that asks before rank 0 drew it waits for it
        found[0] = _group_nonce(keys, 0)
        late.join(timeout=30)
        names[group] = found
    first, second = names.values()
    assert first[0] == first[1]
    assert second[0] == second[1]
    assert len(first[0]) == 8
    assert first[0] != second[0]


def test_a_group_of_one_worker_opens_no_transport(monkeypatch):
    """An elastic job's group may be one worker (the others lost, ``--min-workers 1``): shared
    memory, which needs two, is not opened (it raised, and the last worker crashed)."""
    monkeypatch.setenv("PHALANX_SHARED_MEMORY", "1")
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    assert _open_one_worker() is None


class _Marker:
    name = "marker"


def test_the_first_opener_that_opens_carries_the_group(monkeypatch):
    asked: list[str] = []

    def declines(request: OpenRequest):
        asked.append("declines")

    def opens(request: OpenRequest):
        asked.append(f"opens for rank {request.rank} of {request.world_size}")
        return _Marker()

    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    registry.register("declines", declines, first=True)
    registry.register("opens", opens, first=True)
    try:
        assert registry.registered()[:2] == ["opens", "declines"]
        assert isinstance(_open_one_worker(), _Marker)
        assert asked == ["opens for rank 0 of 1"]  # the next ones are not asked
    finally:
        registry.unregister("opens")
        registry.unregister("declines")
    assert registry.registered() == ["shm", "tls"]


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="A transport named 'shm' is registered already"):
        registry.register("shm", lambda request: None)
    registry.unregister("no such transport")  # no error
    assert registry.registered() == ["shm", "tls"]
