"""The Chief: the interface between ParameterServerStrategy and ClusterCoordinator, one method
at a time, over real ps tasks (in-process gRPC; no coordinator threads unless named)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx.coordinator import ClusterCoordinator
from phalanx.ps.coordinator.chief import Chief

SRC = Path(phalanx.__file__).parent


def _scoped_layer(strategy):
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, bias=False)
    return layer, Chief.of(strategy).handle_of(layer.weight)


def _on_ps(chief, handle):
    (value,) = chief.ps.read([handle])
    return value


def test_the_coordinator_finds_a_ps_strategys_chief_and_no_other_strategys(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    chief = Chief.of(strategy)
    assert chief is not None
    assert chief.strategy is strategy
    assert Chief.of(phalanx.OneDeviceStrategy("cpu")) is None


def test_connect_workers_gives_one_connection_per_worker_task(ps_2workers_1ps):
    workers = Chief.of(ps_2workers_1ps.strategy()).connect_workers()
    addresses = ps_2workers_1ps.spec["worker"]
    assert [w.index for w in workers] == [0, 1]
    assert [w.name for w in workers] == [f"worker:{i} ({a})" for i, a in enumerate(addresses)]
    assert all(w.ping(10.0) for w in workers)
    for worker in workers:
        worker.close()


def test_attach_takes_one_coordinator(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    coordinator = ClusterCoordinator(strategy)
    chief = Chief.of(strategy)
    assert chief.coordinator is coordinator
    assert strategy.cluster_coordinator is coordinator
    with pytest.raises(ValueError, match="already has a ClusterCoordinator.*HINT"):
        chief.attach(object(), lambda: 0)


def test_before_schedule_sends_what_the_chief_wrote_into_its_copies(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    chief = Chief.of(strategy)
    layer, handle = _scoped_layer(strategy)
    with torch.no_grad():
        layer.weight.fill_(3.0)
    assert not torch.equal(_on_ps(chief, handle), layer.weight.detach())
    chief.before_schedule()
    torch.testing.assert_close(_on_ps(chief, handle), torch.full((1, 2), 3.0))


def test_refresh_reads_the_ps_tasks_only_after_a_closure_was_scheduled_or_finished(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    chief = Chief.of(strategy)
    layer, handle = _scoped_layer(strategy)
    chief.ps.write("assign", [handle], [torch.full((1, 2), 7.0)])  # as a worker's step would
    chief.refresh()
    assert not torch.equal(layer.weight.detach(), torch.full((1, 2), 7.0))  # nothing said it changed
    chief.after_schedule()
    chief.refresh()
    torch.testing.assert_close(layer.weight.detach(), torch.full((1, 2), 7.0))
    chief.ps.write("assign", [handle], [torch.full((1, 2), 8.0)])
    chief.after_closure()
    chief.refresh()
    torch.testing.assert_close(layer.weight.detach(), torch.full((1, 2), 8.0))


def test_the_copies_stay_stale_while_closures_are_pending(ps_2workers_1ps):
    strategy = ps_2workers_1ps.strategy()
    chief = Chief.of(strategy)
    layer, handle = _scoped_layer(strategy)
    pending = [1]
    chief.attach(object(), lambda: pending[0])
    chief.after_schedule()
    chief.refresh()
    chief.ps.write("assign", [handle], [torch.full((1, 2), 4.0)])
    chief.refresh()  # a closure still runs: read again
    torch.testing.assert_close(layer.weight.detach(), torch.full((1, 2), 4.0))
    pending[0] = 0
    chief.refresh()  # the last read while stale
    chief.ps.write("assign", [handle], [torch.full((1, 2), 5.0)])
    chief.refresh()
    torch.testing.assert_close(layer.weight.detach(), torch.full((1, 2), 4.0))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_ps_package_never_imports_the_strategy_module():
    offenders = [
        str(path.relative_to(SRC))
        for path in sorted((SRC / "ps").rglob("*.py"))
        if "phalanx.strategies.parameter_server" in _imports(path)
    ]
    assert offenders == []
    assert "phalanx.ps.coordinator.chief" in _imports(SRC / "strategies" / "parameter_server.py")
