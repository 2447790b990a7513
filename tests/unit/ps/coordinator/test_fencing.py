"""Fences: a ps task refuses the calls of a function run the coordinator gave up on (a worker
lost to a partition whose writes arrive late), and only those."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import phalanx
from phalanx.ps.coordinator.chief import Chief
from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator
from phalanx.ps.coordinator.fencing import FENCE_KEY, FencedRunError, Fences, TaggedRpcClient
from phalanx.ps.transport import RemoteError
from phalanx.security.token import cluster_token


def test_a_fenced_run_and_the_earlier_runs_of_that_worker_are_refused_and_nothing_else():
    fences = Fences("ps:0 (10.0.0.5:2222)")
    fences.fence("s1", worker=1, run=5)
    for tag in (["s1", 1, 5], ["s1", 1, 4]):
        with pytest.raises(FencedRunError) as raised:
            fences.check(tag, "assign_add")
    assert str(raised.value).startswith(
        "ps:0 (10.0.0.5:2222) refused assign_add from worker:1 for run 4: the coordinator counted that "
        "worker lost and runs the function on another worker. Received: a call of an abandoned run"
    )
    assert "HINT:" in str(raised.value)
    fences.check(["s1", 1, 6], "assign_add")  # a later run on that worker
    fences.check(["s1", 0, 5], "assign_add")  # another worker
    fences.check(["s2", 1, 5], "assign_add")  # another coordinator
    fences.fence("s1", worker=1, run=2)  # an older fence does not lower the bar
    with pytest.raises(FencedRunError):
        fences.check(["s1", 1, 5], "read")


def test_guarded_handlers_drop_the_tag_refuse_fenced_calls_and_serve_untagged_ones():
    seen = []
    fences = Fences("ps:0")
    handlers = fences.guard({"assign": lambda h, t: (seen.append(dict(h)) or {}, [])})
    assert sorted(handlers) == ["assign", "fence"]
    handlers["assign"]({"names": ["w"], FENCE_KEY: ["s", 0, 1]}, [])
    handlers["assign"]({"names": ["w"]}, [])  # the chief's own calls carry no tag
    assert seen == [{"names": ["w"]}, {"names": ["w"]}]
    handlers["fence"]({"session": "s", "worker": 0, "run": 1}, [])
    with pytest.raises(FencedRunError):
        handlers["assign"]({"names": ["w"], FENCE_KEY: ["s", 0, 1]}, [])
    assert len(seen) == 2


def test_a_worker_s_tagged_calls_are_refused_by_a_real_ps_task_once_the_chief_fenced_the_run(ps_2workers_1ps):
    chief = Chief.of(ps_2workers_1ps.strategy())
    tag = ["session", 0, 3]
    address = ps_2workers_1ps.spec["ps"][0]
    client = TaggedRpcClient(address, cluster_token(), name=f"ps:0 ({address})", tag=lambda: tag)
    try:
        client.call("version", timeout=10)
        chief.fence("session", 0, 3)
        with pytest.raises(RemoteError, match=r"refused version from worker:0 for run 3") as raised:
            client.call("version", timeout=10)
        assert raised.value.remote_type == "FencedRunError"
        tag[2] = 4  # the worker's next run
        client.call("version", timeout=10)
    finally:
        client.close()


# ---------------------------------------------------------------------- a late write of a lost worker
_started, _go = threading.Event(), threading.Event()
_runs: list[tuple[int, str]] = []  # (worker, what its optimizer step did)


def _step_that_waits_on_its_first_run(strategy, model, optimizer):
    first = not _started.is_set()
    _started.set()
    if first:
        _runs.append((strategy.worker_index, "started"))
        _go.wait(30)  # meanwhile the test stops this worker's server: the coordinator counts it lost
    optimizer.zero_grad()
    model.weight.sum().backward()
    try:
        optimizer.step()  # the gradient goes to the ps task
    except Exception as exc:
        _runs.append((strategy.worker_index, getattr(exc, "remote_type", type(exc).__name__)))
        raise
    _runs.append((strategy.worker_index, "applied"))


def test_the_write_of_a_run_given_up_on_is_refused_so_the_step_applies_once(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        model = torch.nn.Linear(1, 1, bias=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = float(model.weight.detach())
    _started.clear(), _go.clear(), _runs.clear()
    coordinator.schedule(_step_that_waits_on_its_first_run, args=(strategy, model, optimizer))
    assert _started.wait(30)
    lost = _runs[0][0]
    ps_2workers_1ps.servers[("worker", lost)].stop()  # its run call ends: lost, fenced, run again
    coordinator.join()  # the function ran on the other worker
    _go.set()  # the first run goes on and sends its gradient late
    deadline = time.monotonic() + 30
    while len(_runs) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _runs == [(lost, "started"), (1 - lost, "applied"), (lost, "FencedRunError")]
    coordinator.fetch(coordinator.schedule(lambda: None))  # reads the ps value into the copies
    coordinator.join()
    assert float(model.weight.detach()) == before - 1.0  # one step, not two


_abandoned_once: list[int] = []


def _abandoned_on_its_first_run():
    from phalanx.ps.worker.running import ClosureAbandonedError

    if not _abandoned_once:
        _abandoned_once.append(1)
        raise ClosureAbandonedError("Function 1 stopped before pushing its gradients to the ps tasks")
    return 7


def test_a_function_its_worker_abandoned_runs_again(ps_2workers_1ps):
    coordinator = ClusterCoordinator(ps_2workers_1ps.strategy())
    _abandoned_once.clear()
    value = coordinator.schedule(_abandoned_on_its_first_run)
    assert value.fetch(timeout=30) == 7  # not the error: the worker gave up on it, not the function
    assert _abandoned_once == [1]


# ------------------------------------------------------------- a reply lost after the function returned
_replying, _release = threading.Event(), threading.Event()
_counted_on: list[int] = []  # the worker of each run


class _ReplyHeldOnTheFirstRun:
    """A result whose pickling, on the function's first run, waits until the test has stopped
    that worker's server: the function returned, its reply has not left (the window a network
    partition can fall into)."""

    def __reduce__(self):
        if len(_counted_on) == 1:
            _replying.set()
            _release.wait(30)
        return (int, (7,))


def _count_four_examples(strategy, metric):
    _counted_on.append(strategy.worker_index)
    metric.update_state(torch.ones(4))  # a module buffer: the count of examples
    return _ReplyHeldOnTheFirstRun()


def test_a_metric_counts_the_examples_of_a_function_rerun_after_its_reply_was_lost_once(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    with strategy.scope():
        metric = phalanx.metrics.Mean()
    _replying.clear(), _release.clear(), _counted_on.clear()
    value = coordinator.schedule(_count_four_examples, args=(strategy, metric))
    assert _replying.wait(30)
    ps_2workers_1ps.servers[("worker", _counted_on[0])].stop()  # the reply never arrives: run again
    assert value.fetch(timeout=60) == 7
    _release.set()  # the first run's reply goes nowhere
    assert _counted_on == [_counted_on[0], 1 - _counted_on[0]]
    coordinator.join()
    time.sleep(0.5)  # a late write of the first run would have landed by now
    coordinator.fetch(coordinator.schedule(lambda: None))
    coordinator.join()
    assert int(metric.count) == 4  # the first run's count was never added: once, not twice
