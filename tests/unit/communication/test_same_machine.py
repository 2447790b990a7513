"""The shared-memory decision: workers share memory only if they see each other's /dev/shm probes."""

from __future__ import annotations

import json
import os
import secrets

import pytest
import torch.distributed as dist

from phalanx.communication.transports.shm import shared_memory
from phalanx.communication.transports.shm.shared_memory import same_machine_pids, shared_memory_supported

pytestmark = pytest.mark.skipif(not shared_memory_supported(), reason="needs /dev/shm on x86-64 Linux")


def _peer(store, probe, content, pidns, pid=4242, verdict="1"):
    """Worker 1's side of the exchange, published before worker 0 runs."""
    store.set(
        "machine/1", json.dumps({"ok": True, "probe": probe, "content": content, "pidns": pidns, "pid": pid})
    )
    store.set("machine-shared/1", verdict)


@pytest.fixture
def probe_file():
    path = f"/dev/shm/phalanx-test-probe-{secrets.token_hex(4)}"
    with open(path, "w") as f:
        f.write("peer-content")
    yield path
    os.unlink(path)


def test_workers_that_see_each_others_probe_share_memory(probe_file):
    store = dist.HashStore()
    _peer(store, probe_file, "peer-content", shared_memory._pid_namespace())
    assert same_machine_pids(store, 0, 2, "job") == [os.getpid(), 4242]
    assert store.get("machine-shared/0") == b"1"
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("phalanx-probe-job-")]  # cleaned up


def test_a_probe_this_worker_cannot_see_means_another_machine():
    store = dist.HashStore()  # e.g. another network namespace with the same host name and boot id
    _peer(store, "/dev/shm/phalanx-probe-on-another-host", "peer-content", shared_memory._pid_namespace())
    assert same_machine_pids(store, 0, 2, "job") is None
    assert store.get("machine-shared/0") == b"0"


def test_another_pid_namespace_means_no_shared_memory(probe_file):
    store = dist.HashStore()  # the same /dev/shm, but peers cannot be watched by PID
    _peer(store, probe_file, "peer-content", "pid:[1]")
    assert same_machine_pids(store, 0, 2, "job") is None


def test_one_workers_no_is_everyones_no(probe_file):
    store = dist.HashStore()
    _peer(store, probe_file, "peer-content", shared_memory._pid_namespace(), verdict="0")
    assert same_machine_pids(store, 0, 2, "job") is None


def test_a_worker_with_the_transport_switched_off_shares_nothing(probe_file, monkeypatch):
    monkeypatch.setenv(shared_memory.SHARED_MEMORY_ENV, "0")
    store = dist.HashStore()
    _peer(store, probe_file, "peer-content", shared_memory._pid_namespace())
    assert same_machine_pids(store, 0, 2, "job") is None
    assert json.loads(store.get("machine/0"))["allowed"] is False
    assert store.get("machine-shared/0") == b"1"  # still the same machine: no TLS needed


def test_two_shot_is_chosen_only_with_a_core_per_worker_unless_forced(monkeypatch):
    from phalanx.communication.transports.shm.shared_memory import TWO_SHOT_ENV, _wants_two_shot

    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(TWO_SHOT_ENV, raising=False)
    assert not _wants_two_shot(2)  # two workers: one meeting is always cheaper
    assert _wants_two_shot(3) is (cores >= 3)
    assert not _wants_two_shot(cores + 1)
    monkeypatch.setenv(TWO_SHOT_ENV, "1")
    assert _wants_two_shot(cores + 1)
    monkeypatch.setenv(TWO_SHOT_ENV, "0")
    assert not _wants_two_shot(3)


@pytest.mark.parametrize("workers", [2, 3, 4, 8])
def test_the_slots_of_parts_keep_one_set_within_set_elements_whatever_the_workers(workers):
    part = shared_memory.part_elements(workers)
    assert part & (part - 1) == 0  # a power of two: the segment's capacity
    assert workers * part <= shared_memory.SET_ELEMENTS < 2 * workers * part
    assert shared_memory.part_elements(1 << 30) == shared_memory.MIN_CAPACITY
