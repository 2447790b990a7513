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


class _Watch:
    """The stall inspector's side, off: no signature, nothing recorded."""

    def issue(self, kind, tensors, what):
        return None

    def attach(self, work, signature):
        return work

    def begin_wait_at_issue(self, signature, what):
        pass

    def end_wait(self):
        pass


class _Check:
    def sign(self, kind, tensor, what, signature=None):
        return UNCHECKED


class _Group(GroupCollectives):
    """A group's collectives over a recording transport (nothing leaves the process)."""

    def __init__(self, transport):
        self._transport, self._watch, self._check = transport, _Watch(), _Check()

    def _check_usable(self, what):
        pass

    def _watched_wait(self, work, what, timeout, where_issued):
        pass


class _Recording:
    """A transport that says which of its entry points each all-reduce took."""

    def __init__(self) -> None:
        self.took: list[str] = []

    def all_reduce_async(self, tensor, op, signed):
        self.took.append("queued")
        return QueuedWork("all_reduce")


class _RunsHere(_Recording):
    def all_reduce_may_block_async(self, tensor, op, signed):
        self.took.append("here")
        return QueuedWork("all_reduce")


def test_a_group_runs_a_call_that_may_block_on_the_caller_where_its_transport_can():
    here, elsewhere = _RunsHere(), _Recording()
    for transport in (here, elsewhere):
        group = _Group(transport)
        group.all_reduce_async(torch.ones(4), may_block=True, what="the gradient buckets")
        group.all_reduce_async(torch.ones(4))  # may not block: the transport's own thread
    assert here.took == ["here", "queued"]
    assert elsewhere.took == ["queued", "queued"]  # a transport without the method is unchanged
