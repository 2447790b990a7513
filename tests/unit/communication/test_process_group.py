"""The phalanx process group's mapping of torch's collectives onto the engine's three
(`phalanx.communication.group.process_group`), on one worker, and the errors it raises. Two workers
on every transport: tests/multiprocess/test_torch_collectives.py."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from phalanx.communication.checks.call_sites import call_site
from phalanx.communication.checks.health import PeerUnavailableError
from phalanx.communication.group import process_group, transports
from phalanx.communication.group.process_group import PhalanxProcessGroup, _create
from phalanx.communication.group.subgroups import SubgroupEngine
from phalanx.communication.group.work import PeerGoneError, QueuedWork


class _OneWorker:
    """An engine of one worker: every collective is finished when issued (its result is its input)."""

    rank, world_size = 0, 1
    point_to_point = None  # send and recv: the gloo group underneath

    def __init__(self, uses_tls=False):
        self.uses_tls = uses_tls
        self.issued = []

    def _done(self, what):
        self.issued.append(what)
        work = QueuedWork(what)
        work.finish()
        return work

    def all_reduce_async(self, tensor, op=dist.ReduceOp.SUM):
        return self._done("all_reduce")

    def broadcast_async(self, tensor, src):
        return self._done("broadcast")

    def all_gather_async(self, tensor):
        return self._done("all_gather"), [tensor.clone()]

    def try_all_gather_into_async(self, tensor, output):
        return None  # no transport of its own: the group uses all_gather_async

    def try_reduce_scatter_async(self, tensor, output, op=dist.ReduceOp.SUM):
        return None

    def wait(self, work, what, timeout=None):
        work.wait()


class _SharedMemoryLike(_OneWorker):
    """An engine whose transport gathers into the output and reduce-scatters itself (as shared
    memory does)."""

    def try_all_gather_into_async(self, tensor, output):
        output.copy_(tensor.view_as(output))
        return self._done("all_gather_into")

    def try_reduce_scatter_async(self, tensor, output, op=dist.ReduceOp.SUM):
        output.copy_(tensor.view_as(output))
        return self._done(f"reduce_scatter({op})")


def _group(uses_tls=False):
    engine = _OneWorker(uses_tls)
    return PhalanxProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), engine), engine


def test_a_transport_with_its_own_gather_and_reduce_scatter_is_used_for_them():
    engine = _SharedMemoryLike()
    group = PhalanxProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), engine)
    out = torch.empty(3)
    group.all_gather_single(out, torch.tensor([1.0, 2, 3])).wait()
    mine = torch.empty(2)
    options = dist.ReduceScatterOptions()
    options.reduceOp = dist.ReduceOp.AVG  # FSDP2's: a sum, divided by the group's size (1)
    group.reduce_scatter_single(mine, torch.tensor([5.0, 6.0]), options).wait()
    assert out.tolist() == [1, 2, 3]
    assert mine.tolist() == [5, 6]
    assert engine.issued == ["all_gather_into", f"reduce_scatter({dist.ReduceOp.SUM})"]
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        group.reduce_scatter_single(
            torch.empty(2, dtype=torch.int64), torch.ones(2, dtype=torch.int64), options
        )


def test_every_collective_torch_calls_runs_on_the_engine():
    group, engine = _group()
    t = torch.arange(6.0).view(2, 3).t()  # not contiguous: staged and copied back
    work = group.allreduce([t])
    assert work.wait()
    assert work.is_success()
    assert work.get_future().wait()[0] is t
    assert torch.equal(t, torch.arange(6.0).view(2, 3).t())
    out = torch.empty(4)
    group.all_gather_single(out, torch.tensor([1.0, 2, 3, 4])).wait()
    assert out.tolist() == [1, 2, 3, 4]
    mine = torch.empty(2)
    options = dist.ReduceScatterOptions()
    group.reduce_scatter_single(mine, torch.tensor([5.0, 6.0]), options).wait()
    assert mine.tolist() == [5, 6]
    outs = [[torch.empty(2)]]
    group.allgather(outs, [torch.tensor([7.0, 8.0])]).wait()
    assert outs[0][0].tolist() == [7, 8]
    group.broadcast([torch.ones(2)]).wait()
    group.barrier().wait()
    assert engine.issued == [
        "all_reduce",
        "all_gather",
        "all_reduce",
        "all_gather",
        "broadcast",
        "all_reduce",
    ]
    assert group.name() == "phalanx"


def test_a_tensor_off_the_cpu_is_refused_saying_what_to_do():
    group, _ = _group()
    with pytest.raises(ValueError, match="carries CPU tensors.*HINT: on GPUs"):
        group.allreduce([torch.empty(2, device="meta")])


def test_under_tls_an_engine_without_point_to_point_links_refuses_send_and_recv():
    group, _ = _group(uses_tls=True)  # the job's engine under TLS has links (below)
    for call in (
        lambda: group.send([torch.zeros(1)], 0, 0),
        lambda: group.recv([torch.zeros(1)], 0, 0),
    ):
        with pytest.raises(RuntimeError, match="plaintext between machines"):
            call()
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        group._get_backend(torch.device("cpu"))  # torch's C++ paths find no gloo behind it


def test_under_tls_all_to_all_is_carried_by_all_gathers_on_the_engine():
    group, engine = _group(uses_tls=True)
    out = torch.zeros(2)
    group.alltoall([out], [torch.tensor([1.0, 2.0])]).wait()
    single = torch.zeros(3)
    group.alltoall_base(single, torch.tensor([4.0, 5.0, 6.0]), [], []).wait()
    assert out.tolist() == [1, 2]
    assert single.tolist() == [4, 5, 6]
    assert engine.issued == ["all_gather"] * 4  # the sizes, then the parts, each time
    with pytest.raises(ValueError, match="worker 0 sends 2 elements to worker 0, which expects 3"):
        group.alltoall_base(torch.zeros(3), torch.zeros(2), [], [])


class _TwoWorkers(_OneWorker):
    """Worker 0 of two: the peer's part of every all-gather is this worker's plus 100."""

    world_size = 2

    def all_gather_async(self, tensor):
        peer = tensor + 100 if tensor.dtype != torch.uint8 else tensor.clone()
        return self._done("all_gather"), [tensor.clone(), peer]


def _pair():
    engine = _TwoWorkers(uses_tls=True)  # no gloo device backend to register beneath it
    return PhalanxProcessGroup(dist.HashStore(), 0, 2, timedelta(seconds=10), engine, gloo=object())


def test_all_gather_coalesced_fills_torchs_rank_major_lists():
    group = _pair()
    for count in (2, 3):  # as many inputs as workers (a transposed result looks alike), and more
        lists = [[torch.zeros(1) for _ in range(count)] for _ in range(2)]
        group.allgather_coalesced(lists, [torch.tensor([float(i)]) for i in range(count)]).wait()
        assert [[t.item() for t in row] for row in lists] == [
            [float(i) for i in range(count)],
            [100.0 + i for i in range(count)],
        ]  # lists[rank][i]: worker rank's input i
    with pytest.raises(ValueError, match=r"one list of 1 output tensors per worker \(2\)"):
        group.allgather_coalesced([[torch.zeros(1)]], [torch.zeros(1)])


def test_a_sparse_all_reduce_sums_the_workers_entries_and_refuses_other_ops():
    group = _pair()  # the peer's entries: the same bytes (a uint8 payload is passed as is)
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, 5.0], (3,))
    group.allreduce([sparse]).wait()
    assert sparse.to_dense().tolist() == [2.0, 0.0, 10.0]
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    with pytest.raises(ValueError, match="sums a sparse tensor with all_reduce.*HINT"):
        group.allreduce([sparse], options)
    with pytest.raises(ValueError, match="Received: all_reduce_coalesced of 2 tensor"):
        group.allreduce_coalesced([sparse, torch.zeros(1)])


def test_a_failed_collective_fails_the_future_torchs_cpp_callers_read():
    group, engine = _group()
    failed = QueuedWork("all_reduce")
    engine.all_reduce_async = lambda tensor, op=None: failed
    work = group.allreduce([torch.zeros(2)])
    failed.finish(RuntimeError("peer gone"))
    chained = work.get_future().then(lambda f: f.value())  # what DDP's reducer chains on
    with pytest.raises(RuntimeError, match="peer gone"):
        chained.wait()
    assert not work.is_success()


def test_a_tensor_that_requires_grad_is_reduced_through_a_detached_view():
    group, _ = _group()
    grad = torch.ones(3, requires_grad=True) * 2  # DDP's bucket under backward(create_graph=True)
    work = group.allreduce([grad])
    work.wait()
    assert work.get_future().wait()[0] is grad


class _Opts:
    """What torch passes to a backend's factory (one worker)."""

    def __init__(self):
        self.store, self.group_rank, self.group_size, self.timeout = (
            dist.HashStore(),
            0,
            1,
            timedelta(seconds=5),
        )


def test_a_subgroup_is_plain_gloo_without_a_job_of_phalanxs(monkeypatch):
    assert isinstance(_create(_Opts(), None), dist.ProcessGroupGloo)  # no phalanx default group


class _Job(_OneWorker):
    """A job's engine that makes real subgroup engines (what `WorkerGroup.subgroup` does)."""

    def __init__(self):
        super().__init__()
        self.waited, self.checks = [], []

    def subgroup(self, gloo, store, rank, size, global_ranks, timeout=None, group_name=""):
        names = [f"worker:{r}" for r in (global_ranks or range(size))]
        self.made = (list(global_ranks), timeout, group_name)
        engine = SubgroupEngine(
            gloo, store, rank, size, names, True, lambda w: w, self.usable, self.wait, timeout=timeout
        )
        self.checks.append(engine.check)
        return engine

    def usable(self, what):
        self.issued.append(f"usable {what}")

    def wait(self, work, what, timeout=None):
        self.waited.append((what, timeout))
        work.wait()


def test_a_subgroup_of_the_job_gets_a_signed_engine_of_its_own(monkeypatch):
    job = _Job()
    default = PhalanxProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), job)
    monkeypatch.setattr(process_group, "_default_group", lambda: default)
    options = _Opts()
    options.global_ranks_in_group, options.group_id = [0], "5"
    sub = _create(options, None)
    assert isinstance(sub, PhalanxProcessGroup)
    engine = sub.engine
    assert isinstance(engine, SubgroupEngine)
    assert job.made == ([0], 5.0, "5")  # its members, its own deadline, torch's name of it
    assert not engine.uses_tls  # the job has no TLS transport: its gloo carries it
    assert engine._gloo.group is sub.gloo  # one gloo group under it, carrying the signed calls
    value = torch.tensor([1.0, 2.0])
    sub.allreduce([value]).wait()
    sub.broadcast([value], dist.BroadcastOptions()).wait()
    assert value.tolist() == [1.0, 2.0]
    assert job.issued == ["usable all_reduce", "usable broadcast"]  # the job's failure state
    assert job.waited == [("all_reduce", None), ("broadcast", None)]  # the job's wait (gloo's timeout: 5 s)
    signed = engine.check.sign("all_reduce(SUM)", value, "all_reduce")
    assert signed.seq == 3  # its own numbering: the job's check saw none of them
    assert job.checks == [engine.check]  # its reports fail the job's group


def test_avg_is_a_sum_divided_and_needs_floating_point():
    group, engine = _group()
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.AVG
    value = torch.tensor([3.0, 5.0])
    group.allreduce([value], options).wait()
    assert value.tolist() == [3.0, 5.0]  # one worker: the mean of one
    with pytest.raises(ValueError, match="AVG needs a floating-point tensor"):
        group.allreduce([torch.tensor([3])], options)


def test_under_tls_the_group_keeps_the_name_torch_gives_it():
    group = _create(_Opts(), _OneWorker(uses_tls=True))
    group._set_group_name("7")
    assert group.group_name == "7"


def test_a_users_all_reduce_is_named_by_torchs_entry_point_not_its_logging_decorator():
    class Recording(_OneWorker):
        def all_reduce_async(self, tensor, op=dist.ReduceOp.SUM):
            self.issued.append(call_site())
            return self._done("all_reduce")

    engine = Recording()
    group = PhalanxProcessGroup(dist.HashStore(), 0, 1, timedelta(seconds=10), engine)
    dist.all_reduce(torch.ones(2), group=group)  # through torch's _exception_logger decorator
    assert engine.issued[0].startswith("all_reduce at test_process_group.py:"), engine.issued


class _Loopback:
    """A group's point-to-point channel whose messages come back to this worker, as if sent
    by rank 1 (what `PeerChannel` gives the group under TLS)."""

    def __init__(self, name, members):
        self.name, self.members, self.sent = name, members, []

    def send_async(self, tensor, dst, tag):
        self.sent.append((tensor.clone(), dst, tag))
        work = QueuedWork("send")
        work.finish()
        return work

    def recv_async(self, tensor, src, tag):
        assert tensor.is_contiguous()
        message, _, _ = next(m for m in self.sent if m[2] == tag)
        tensor.copy_(message.view_as(tensor))
        work = QueuedWork("recv")
        work.finish()
        return work, lambda: 1

    def describe(self, doing, peer, tag):
        return f"{doing} rank {peer} with tag {tag}"


class _Linked(_OneWorker):
    """An engine with point-to-point links of its own (the job's under TLS)."""

    def __init__(self):
        super().__init__(uses_tls=True)
        self.waited, self.channels = [], []
        self.point_to_point = self

    def channel(self, name, members):
        self.channels.append(_Loopback(name, members))
        return self.channels[-1]

    def wait(self, work, what, timeout=None):
        self.waited.append(what)
        work.wait()


def test_under_tls_send_and_recv_go_over_the_engines_links_on_the_groups_channel():
    engine = _Linked()
    options = _Opts()
    options.group_id, options.global_ranks_in_group = "3", []
    group = _create(options, engine)
    (channel,) = engine.channels
    assert (channel.name, channel.members) == ("3", [0])  # torch's name of the group, its ranks
    group.send([torch.tensor([[1.0, 2.0], [3.0, 4.0]])], 1, 6).wait()
    into = torch.zeros(2, 2).t()  # not contiguous: received into a copy, then copied back
    work = group.recv_anysource([into], 6)
    work.wait()
    assert into.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert work._source_rank() == 1  # what dist.recv(src=None) reads
    assert engine.waited == ["send to rank 1 with tag 6", "recv from rank None with tag 6"]
    with pytest.raises(ValueError, match="is not a receive"):
        group.send([torch.zeros(1)], 1, 0)._source_rank()
    with pytest.raises(ValueError, match="send takes exactly one tensor. Received: 2 tensors"):
        group.send([torch.zeros(1), torch.zeros(1)], 1, 0)
    with pytest.raises(ValueError, match="carries CPU tensors"):
        group.recv([torch.empty(1, device="meta")], 1, 0)


class _RingLike:
    """A transport that opens a ring per subgroup (as the TLS transport does), or fails to."""

    name = "tls"

    def __init__(self, error=None):
        self.error, self.opened = error, []

    def subgroup(self, store, rank, size, task_name, group_name, mismatch):
        if self.error is not None:
            raise self.error
        self.opened.append((rank, size, task_name(0), group_name, mismatch))
        return self

    def all_reduce_async(self, tensor, op, signed):
        work = QueuedWork("ring all_reduce")
        work.finish()
        return work


def test_a_subgroup_of_a_tls_job_opens_a_ring_of_its_members_and_keeps_its_own_deadline():
    ring, waited = _RingLike(), []
    engine = SubgroupEngine(
        object(),
        dist.HashStore(),
        0,
        2,
        ["worker:0", "worker:2"],
        True,
        lambda w: w,
        lambda what: None,
        lambda work, what, timeout: waited.append((what, timeout)),
        transport=lambda mismatch: transports.subgroup_transport(
            ring, dist.HashStore(), 0, 2, ["worker:0", "worker:2"].__getitem__, "4", mismatch
        ),
        timeout=3.0,
    )
    assert engine.uses_tls
    assert ring.opened == [(0, 2, "worker:0", "4", engine.check.mismatch)]  # its own numbering
    engine.all_reduce(torch.ones(2))
    assert waited == [("all_reduce on a group with a timeout of 3s", 3.0)]  # the ring has none of its own
    assert transports.subgroup_transport(None, None, 0, 2, str, "4", None) is None  # gloo carries it


def test_a_member_that_does_not_join_a_subgroups_ring_is_named():
    failing = _RingLike(
        PeerGoneError("worker:2 (h:2) did not open its TLS connection to this worker within 5s")
    )
    with pytest.raises(
        PeerUnavailableError, match=r"new_group could not connect worker:0 .*worker:2 \(h:2\) did not"
    ):
        transports.subgroup_transport(failing, None, 0, 2, ["worker:0", "worker:2"].__getitem__, "4", None)
