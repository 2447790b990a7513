"""Misuse errors, failing replicas, skipped collectives and the rendezvous they meet at."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from torch import nn

import phalanx
from phalanx.communication.checks.stall_inspector import CollectiveMismatchError
from phalanx.devices import canonical_name
from phalanx.strategies.replicas.rendezvous import ReplicaAbortedError, ReplicaRendezvous, ReplicaTimeoutError
from phalanx.variables import set_aggregation


def _rid():
    return phalanx.get_replica_context().replica_id_in_sync_group


def _replica_threads():
    return [t for t in threading.enumerate() if "-replica-" in t.name]


@pytest.fixture
def short_timeout():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=0.5)
    yield strategy
    strategy._threads.close()


@pytest.fixture
def long_timeout():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], timeout_seconds=60)
    yield strategy
    strategy._threads.close()


# ---------------------------------------------------------------------------------------- misuse


def test_cross_replica_only_calls_inside_run_raise(mirrored_2cpu):
    with pytest.raises(RuntimeError, match=r"strategy\.reduce must be called in cross-replica context.*HINT"):
        mirrored_2cpu.run(lambda: mirrored_2cpu.reduce("sum", torch.ones(1)))
    with pytest.raises(RuntimeError, match=r"strategy\.gather must be called in cross-replica.*all_gather"):
        mirrored_2cpu.run(lambda: mirrored_2cpu.gather(torch.ones(1), axis=0))
    with pytest.raises(RuntimeError, match="inside a replica context"):
        mirrored_2cpu.run(lambda: mirrored_2cpu.run(lambda: None))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.run(lambda x: x, args=torch.ones(1)), TypeError, r"takes args as a tuple or list.*HINT"),
        (lambda s: s.run(lambda: None, args={"a": 1}), TypeError, "Received: dict"),
        (lambda s: s.run(lambda: None, kwargs=[1]), TypeError, "kwargs must be a dict. Received: list"),
        (lambda s: s.run(3), TypeError, "needs a callable. Received: int"),
        (lambda s: s.reduce("max", torch.ones(1)), ValueError, "reduce op must be.*Received: 'max'"),
        (lambda s: s.reduce(3, torch.ones(1)), ValueError, "reduce op must be"),
        (lambda s: s.reduce_to("prod", torch.ones(1), "cpu"), ValueError, "reduce op must be"),
        (
            lambda s: s.run(lambda: phalanx.get_replica_context().all_reduce("min", 1.0)),
            ValueError,
            "reduce op",
        ),
    ],
    ids=[
        "args_tensor",
        "args_dict",
        "kwargs_list",
        "fn",
        "reduce_op",
        "reduce_op_int",
        "reduce_to_op",
        "all_reduce_op",
    ],
)
def test_bad_arguments_raise_clear_errors(any_strategy, call, error, match):
    with pytest.raises(error, match=match):
        call(any_strategy)


def test_reduce_op_accepts_names_in_any_case():
    assert phalanx.ReduceOp.coerce("sum") is phalanx.ReduceOp.SUM
    assert phalanx.ReduceOp.coerce("Mean") is phalanx.ReduceOp.MEAN
    assert phalanx.ReduceOp.coerce(phalanx.ReduceOp.SUM) is phalanx.ReduceOp.SUM


@pytest.mark.parametrize("device", ["tpu:0", "gpu0", "cpu:x", "/job:worker/task:0/device:TPU:0", ""])
def test_unknown_device_names_are_rejected(device):
    with pytest.raises(ValueError, match="Unknown device"):
        phalanx.MirroredStrategy(["cpu:0", device])


def test_device_lists_are_validated():
    with pytest.raises(ValueError, match=r"Devices must be distinct\. Received: \['cpu:0', '/cpu:0'\]"):
        phalanx.MirroredStrategy(["cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="Devices must be distinct"):
        phalanx.CentralStorageStrategy(["cpu", "CPU:0"])
    with pytest.raises(ValueError, match="at least one device"):
        phalanx.MirroredStrategy([])
    with pytest.raises(ValueError, match="Only CPU and CUDA devices"):
        phalanx.MirroredStrategy([torch.device("meta")])
    with pytest.raises(ValueError, match="Unknown device"):
        phalanx.OneDeviceStrategy("npu")
    # the spellings users write
    assert [
        canonical_name(d) for d in ["cpu", "/CPU:1", "/gpu:0", "/job:worker/replica:0/task:0/device:GPU:1"]
    ] == [
        "cpu:0",
        "cpu:1",
        "cuda:0",
        "cuda:1",
    ]
    assert canonical_name(torch.device("cpu")) == "cpu:0"
    assert phalanx.MirroredStrategy(["cpu:0", "/cpu:1"]).worker_devices == ("cpu:0", "cpu:1")


@pytest.mark.parametrize("count", [1, 2])
def test_cuda_devices_that_do_not_exist_are_rejected_up_front(count):
    first = torch.cuda.device_count()  # never a valid index
    with pytest.raises(ValueError, match=f"cuda:{first}"):
        phalanx.MirroredStrategy([f"cuda:{first + i}" for i in range(count)])


@pytest.mark.parametrize("ops_cls", [phalanx.NcclAllReduce, phalanx.HierarchicalCopyAllReduce])
def test_gpu_cross_device_ops_on_cpu_devices_raise_clear_errors(ops_cls):
    value = phalanx.PerReplica([torch.ones(1), torch.ones(1)])
    with pytest.raises(ValueError, match=f"{ops_cls.__name__} works across CUDA devices only.*HINT"):
        ops_cls().reduce("sum", value, "cpu")
    with pytest.raises(ValueError, match="num_packs must be >= 1. Received: 0"):
        ops_cls(num_packs=0)
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops_cls())
    try:
        with pytest.raises(ValueError, match="works across CUDA devices only"):
            strategy.run(lambda: phalanx.get_replica_context().all_reduce("sum", torch.ones(1)))
        with strategy.scope():
            layer = nn.Linear(1, 1)
            optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

        def step():
            layer(torch.ones(1, 1)).sum().backward()
            optimizer.step()

        with pytest.raises(ValueError, match="works across CUDA devices only"):
            strategy.run(step)
    finally:
        strategy._threads.close()


def test_distributed_values_need_components():
    with pytest.raises(ValueError, match="at least one component"):
        phalanx.PerReplica([])
    with pytest.raises(ValueError, match="at least one component"):
        phalanx.Mirrored(())


# ---------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_replica_that_raises_fails_run_promptly_with_its_error(long_timeout, failing):
    class ReplicaBroke(Exception):
        pass

    def fn():
        if _rid() == failing:
            raise ReplicaBroke(f"replica {failing} broke")
        return phalanx.get_replica_context().all_reduce("sum", torch.ones(1))  # the others wait here

    threads_before = len(_replica_threads())
    for _ in range(2):  # repeatedly: no thread is lost or added
        start = time.monotonic()
        with pytest.raises(ReplicaBroke, match=f"replica {failing} broke"):
            long_timeout.run(fn)
        assert time.monotonic() - start < 5  # the waiters were woken, not timed out (60 s)
        assert len(_replica_threads()) == max(threads_before, 2)
    out = long_timeout.run(lambda: phalanx.get_replica_context().all_reduce("sum", torch.ones(1)))
    assert [t.item() for t in long_timeout.experimental_local_results(out)] == [3.0] * 3


def test_a_replica_that_raises_while_others_wait_in_optimizer_step_or_backward(long_timeout):
    with long_timeout.scope():
        layer = nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def fn(where):
        x = phalanx.get_replica_context().all_reduce("sum", layer(torch.ones(1, 2)))
        if _rid() == 1 and where == "before_backward":
            raise ArithmeticError("before backward")
        x.sum().backward()  # the all-reduce's backward is a collective too
        if _rid() == 1 and where == "before_step":
            raise ArithmeticError("before step")
        optimizer.step()
        optimizer.zero_grad()

    before = layer.weight.detach().clone()
    for where in ("before_backward", "before_step"):
        start = time.monotonic()
        with pytest.raises(ArithmeticError, match=where.replace("_", " ")):
            long_timeout.run(fn, args=(where,))
        assert time.monotonic() - start < 5
        optimizer.zero_grad()
    torch.testing.assert_close(layer.weight.detach(), before)  # the failed steps changed nothing
    long_timeout.run(fn, args=("nowhere",))  # usable again
    assert not torch.equal(layer.weight.detach(), before)
    components = layer.weight.components
    torch.testing.assert_close(components[2], components[0])


def test_replica_threads_stop_when_the_strategy_is_closed_or_collected():
    strategy = phalanx.MirroredStrategy(["cpu:0", "cpu:1"])
    strategy.run(lambda: None)
    names = {t.name for t in _replica_threads()}
    assert "MirroredStrategy-replica-1" in names
    del strategy
    gc.collect()
    deadline = time.monotonic() + 5
    while _replica_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _replica_threads()


@pytest.mark.parametrize("collective", ["all_reduce", "merge_call", "optimizer.step()"])
def test_a_skipped_collective_names_the_missing_replica_at_once(short_timeout, collective):
    with short_timeout.scope():
        layer = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def fn():
        if _rid() == 1:
            return  # a replica-dependent branch: replica 1 never arrives
        ctx = phalanx.get_replica_context()
        if collective == "all_reduce":
            ctx.all_reduce("sum", torch.ones(1))
        elif collective == "merge_call":
            ctx.merge_call(lambda s: None)
        else:
            layer(torch.ones(1, 1)).sum().backward()
            optimizer.step()

    # replica 1 returned while replica 0 waits: the stall inspector names it without waiting
    # for the timeout (tests/faults/test_stall_replicas.py; PHALANX_STALL_INSPECTOR=0: the timeout)
    with pytest.raises(CollectiveMismatchError, match=r"replicas \[1\] did not join meeting #1") as info:
        short_timeout.run(fn)
    # replicas meet at the end of backward() now (the gradient sum), before optimizer.step()
    meeting = "the gradient sum at the end of backward()" if collective == "optimizer.step()" else collective
    assert f"replica 0 waits in {meeting} #1" in str(info.value)
    assert "HINT: every replica must make the same calls in the same order" in str(info.value)
    out = short_timeout.run(lambda: phalanx.get_replica_context().all_reduce("sum", torch.ones(1)))
    assert [t.item() for t in short_timeout.experimental_local_results(out)] == [2.0, 2.0]


def test_an_error_inside_a_one_replica_optimizer_step_leaves_no_state_behind():
    one = phalanx.MirroredStrategy(["cpu:0"])
    with one.scope():
        layer = nn.Linear(1, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)

    def failing_step():
        layer(torch.ones(1, 1)).sum().backward()
        optimizer.step(lambda: 1 / 0)  # the closure raises inside the step

    with pytest.raises(ZeroDivisionError):
        one.run(failing_step)
    two = phalanx.MirroredStrategy(["cpu:0", "cpu:1"], timeout_seconds=1)
    try:
        with two.scope():
            holder = nn.Module()
            holder.w = set_aggregation(nn.Parameter(torch.zeros(1)), "mean")

        def write():
            with torch.no_grad():
                holder.w.add_(1.0)

        two.run(write)
        assert [c.item() for c in holder.w.components] == [1.0, 1.0]
    finally:
        two._threads.close()


# ---------------------------------------------------------------------------------------- rendezvous


def _in_threads(n, target):
    """Runs target(i) on n threads; returns each one's result or exception."""
    results = [None] * n

    def wrap(i):
        try:
            results[i] = target(i)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_rendezvous_exchanges_and_leads_once_per_generation():
    r = ReplicaRendezvous(3, 5.0)
    leads = []

    def target(i):
        out = []
        for generation in range(3):
            out.append(r.exchange(i, i + 10 * generation, lambda v: leads.append(v) or sum(v)))
        out.append(r.exchange(i, i))  # no leader: everyone gets every value
        return out

    results = _in_threads(3, target)
    assert results == [[3, 33, 63, [0, 1, 2]]] * 3
    assert leads == [[0, 1, 2], [10, 11, 12], [20, 21, 22]]
    single = ReplicaRendezvous(1, 1.0)
    assert single.exchange(0, 5) == [5]
    assert single.exchange(0, 5, lambda v: v[0] + 1) == 6


def test_rendezvous_timeout_names_every_missing_replica():
    r = ReplicaRendezvous(4, 0.2)
    results = _in_threads(2, lambda i: r.exchange(i * 2, i, what="the test point"))  # replicas 0 and 2
    assert any(isinstance(e, ReplicaTimeoutError) for e in results)
    timeout = next(e for e in results if isinstance(e, ReplicaTimeoutError))
    assert "at the test point for replicas [1, 3], which never arrived" in str(timeout)
    # the first to time out aborts the meeting, so the other is woken rather than left waiting
    assert all(isinstance(e, (ReplicaTimeoutError, ReplicaAbortedError)) for e in results)


def test_rendezvous_abort_wakes_waiters_and_reset_clears_it():
    r = ReplicaRendezvous(2, 30.0)
    started = time.monotonic()
    waiter = threading.Thread(target=lambda: results.append(_catch(lambda: r.exchange(0, "x"))))
    results = []
    waiter.start()
    time.sleep(0.05)
    r.abort(KeyError("the cause"))
    waiter.join(5)
    assert time.monotonic() - started < 5
    assert isinstance(results[0], ReplicaAbortedError)
    assert "another replica failed: KeyError('the cause')" in str(results[0])
    with pytest.raises(ReplicaAbortedError):  # stays aborted until reset
        r.exchange(1, "y")
    r.reset()
    assert _in_threads(2, lambda i: r.exchange(i, i)) == [[0, 1], [0, 1]]


def _catch(fn):
    try:
        return fn()
    except BaseException as exc:
        return exc


def test_rendezvous_leader_exceptions_reach_every_replica(mirrored_2cpu):
    r = ReplicaRendezvous(3, 5.0)
    results = _in_threads(3, lambda i: r.exchange(i, i, lambda v: 1 / 0))
    assert all(isinstance(e, ZeroDivisionError) for e in results)
    assert _in_threads(3, lambda i: r.exchange(i, i, sum)) == [3, 3, 3]  # the next meeting works

    with pytest.raises(ZeroDivisionError):
        mirrored_2cpu.run(lambda: phalanx.get_replica_context().merge_call(lambda s: 1 / 0))
    assert mirrored_2cpu.run(lambda: phalanx.get_replica_context().merge_call(lambda s: 7)) == 7
