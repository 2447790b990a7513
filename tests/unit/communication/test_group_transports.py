"""`group_transports._group_nonce`: the shared-memory segments of each group get a name of their
own, the same on every worker of the group (an elastic job's groups share the store's port and
often the chief's pid, which name the segments too)."""

from __future__ import annotations

import threading

import torch.distributed as dist

from phalanx.communication.group.transports import _group_nonce, open_transports


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


def test_a_group_of_one_worker_opens_no_shared_memory(monkeypatch):
    """An elastic job's group may be one worker (the others lost, ``--min-workers 1``): shared
    memory, which needs two, is not opened (it raised, and the last worker crashed)."""
    monkeypatch.setenv("PHALANX_SHARED_MEMORY", "1")
    monkeypatch.delenv("PHALANX_CLUSTER_TOKEN", raising=False)
    opened = open_transports(
        dist.HashStore(), 0, 1, ("127.0.0.1", 1), None, lambda r: f"worker:{r}", lambda: None, 10.0, 10.0, id
    )
    assert opened.shm is None
    assert opened.ring is None
