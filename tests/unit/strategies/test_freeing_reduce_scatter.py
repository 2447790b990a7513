"""FreeingReduceScatter, FSDP2's reduce-scatter comm that FullyShardedStrategy installs on CPUs:
the input's memory goes as soon as a synchronous call returns (a process group of one here;
4 workers train with it in tests/multiprocess/test_big_model_under_a_memory_cap.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from phalanx.strategies.sharding.reduce_scatter import FreeingReduceScatter


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _buffers(comm: FreeingReduceScatter) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = torch.device("cpu")
    source = comm.allocate((6,), dtype=torch.float32, device=cpu)
    source.copy_(torch.arange(6.0))
    return source, comm.allocate((6,), dtype=torch.float32, device=cpu)


def test_the_input_is_freed_once_the_collective_has_returned(group):
    comm = FreeingReduceScatter()
    source, output = _buffers(comm)
    comm(output, source, group, dist.ReduceOp.SUM)
    assert torch.equal(output, torch.arange(6.0))  # a group of one: its part is the whole sum
    assert source.untyped_storage().nbytes() == 0


def test_an_asynchronous_call_keeps_its_input_for_the_collective(group):
    comm = FreeingReduceScatter()
    source, output = _buffers(comm)
    comm(output, source, group, dist.ReduceOp.SUM, async_op=True).wait()
    assert source.untyped_storage().nbytes() == 6 * 4
    assert torch.equal(output, torch.arange(6.0))
