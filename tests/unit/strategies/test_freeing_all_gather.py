"""FreeingAllGather, FSDP2's all-gather comm that FullyShardedStrategy installs on CPUs: the
unit's forward pre-hook frees the last buffer it gathered into (a process group of one here;
workers train with it in tests/multiprocess/test_fully_sharded.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from phalanx.strategies.sharding.all_gather import FreeingAllGather


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_the_units_forward_frees_the_buffer_its_parameters_were_copied_from(group):
    comm = FreeingAllGather()
    unit = nn.Linear(2, 3)
    unit.register_forward_pre_hook(comm.release)
    gathered = comm.allocate((6,), dtype=torch.float32, device=torch.device("cpu"))
    comm(gathered, torch.arange(6.0), group)
    assert torch.equal(gathered, torch.arange(6.0))  # a group of one: its own part
    unit(torch.ones(1, 2))
    assert gathered.untyped_storage().nbytes() == 0
    unit(torch.ones(1, 2))  # nothing gathered since: nothing to free


def test_a_buffer_fsdp2_dropped_is_not_kept_alive():
    """In backward FSDP2 drops its buffer right after the copy: holding it until the next
    forward would keep a gathered unit per unit."""
    comm = FreeingAllGather()
    buffer = comm.allocate((1 << 20,), dtype=torch.float32, device=torch.device("cpu"))
    seen = weakref.ref(buffer)
    del buffer
    gc.collect()
    assert seen() is None
    comm.release(nn.Identity(), ())  # nothing left to free: no error


def test_a_buffer_of_another_device_is_left_to_fsdp2():
    """Off the CPU, FSDP2's streams may still read it: only CPU buffers are freed."""
    comm = FreeingAllGather()
    kept = comm.allocate((4,), dtype=torch.float32, device=torch.device("meta"))
    comm.release(nn.Identity(), ())
    assert kept.untyped_storage().nbytes() == 4 * 4
