"""Shared fixtures: named strategies and per-test hygiene (docs/testing.md)."""

from __future__ import annotations

import gc
import threading
import time

import pytest

import phalanx
from phalanx import context

STRATEGY_FACTORIES = {
    "default": lambda: phalanx.get_strategy(),
    "one_device": lambda: phalanx.OneDeviceStrategy("cpu"),
    "mirrored_2cpu": lambda: phalanx.MirroredStrategy(["cpu:0", "cpu:1"]),
    "central_storage_2cpu": lambda: phalanx.CentralStorageStrategy(["cpu:0", "cpu:1"]),
}


def _made(name):
    strategy = STRATEGY_FACTORIES[name]()
    yield strategy
    if not strategy._is_default:
        strategy._threads.close()  # pytest holds fixture values past teardown


@pytest.fixture(params=list(STRATEGY_FACTORIES))
def any_strategy(request):
    """Every in-process strategy, by name."""
    yield from _made(request.param)


@pytest.fixture
def one_device():
    yield from _made("one_device")


@pytest.fixture
def mirrored_2cpu():
    yield from _made("mirrored_2cpu")


@pytest.fixture
def central_storage_2cpu():
    yield from _made("central_storage_2cpu")


def _replica_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "-replica-" in t.name]


@pytest.fixture(autouse=True)
def _hygiene():
    """Each test leaves no open scope and, once its strategies are gone, no replica threads."""
    yield
    stack = list(context._state.stack)
    context._state.stack.clear()
    context._state.replica = None
    context._state.set_strategy_scope = None
    assert not stack, f"test left strategy scopes open: {stack}"
    deadline = time.monotonic() + 5
    leaked = _replica_threads()
    while leaked:  # collect only when threads are alive: a full collection per test is slow
        gc.collect()
        leaked = _replica_threads()
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not leaked, f"replica threads outlived their strategy: {[t.name for t in leaked]}"
