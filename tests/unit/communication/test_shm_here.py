"""Where the shared-memory transport runs a gradient bucket's all-reduce: on the calling thread
when the machine has no core to spare for its own thread, else queued to that thread; and a
group hands such a call to its transport only where that transport can run it there."""

from __future__ import annotations

import torch
import torch.distributed as dist

from phalanx.communication.checks.collective_check import UNCHECKED
from phalanx.communication.group.collectives import GroupCollectives
from phalanx.communication.group.work import QueuedWork
from phalanx.communication.transports.shm.shared_memory import SharedMemoryAllReduce


class _Lane:
    """Records where each call was asked to run (``here``) instead of running it."""

    def __init__(self) -> None:
        self.here: list[bool] = []

    def submit(self, what, run, here=False):
        self.here.append(here)
        return QueuedWork(what)


def _transport(cores: int) -> tuple[SharedMemoryAllReduce, _Lane]:
    transport = SharedMemoryAllReduce(
        "test", 0, 2, [1, 2], group=None, failure=lambda: None, name=str, timeout=1.0
    )
    transport._lane.close()
    lane = transport._lane = _Lane()
    transport._cores = cores
    return transport, lane


def test_a_bucket_that_may_block_runs_here_when_the_workers_threads_fill_the_cores():
    threads = torch.get_num_threads()
    transport, lane = _transport(cores=2 * threads)  # 2 workers x this many threads: no core spare
    transport.all_reduce_async(torch.ones(4), dist.ReduceOp.SUM, UNCHECKED, may_block=True)
    transport.all_reduce_async(torch.ones(4), dist.ReduceOp.SUM, UNCHECKED)  # may not block: queued
    assert lane.here == [True, False]


def test_with_a_core_to_spare_every_call_goes_to_the_transports_thread():
    threads = torch.get_num_threads()
    transport, lane = _transport(cores=2 * threads + 1)
    transport.all_reduce_async(torch.ones(4), dist.ReduceOp.SUM, UNCHECKED, may_block=True)
    assert lane.here == [False]


def test_a_tensor_the_segments_do_not_take_is_never_run_here():
    transport, lane = _transport(cores=1)
    strided = torch.ones(4, 2).t()  # not contiguous: carried by gloo after a meeting, on the thread
    transport.all_reduce_async(strided, dist.ReduceOp.SUM, UNCHECKED, may_block=True)
    assert lane.here == [False]


class _Group(GroupCollectives):
    """The collectives' transport choice alone (nothing is issued)."""

    def _check_usable(self, what):
        pass

    def _watched_wait(self, work, what, timeout, where_issued):
        pass


class _RunsHere:
    def all_reduce_may_block_async(self, tensor, op, signed):
        raise AssertionError("not called here")


def test_a_group_runs_a_call_on_the_caller_only_where_its_current_transport_can():
    group, here, elsewhere = _Group(), _RunsHere(), object()
    assert group._on_caller(here) is here
    assert group._on_caller(here) is here  # the answer kept for the same transport
    assert group._on_caller(elsewhere) is None  # a new transport (a re-formed group) is asked again
    assert group._on_caller(here) is here
