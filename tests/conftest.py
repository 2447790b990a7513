"""Shared fixtures: named strategies (support/strategies.py) and per-test hygiene (docs/testing.md)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from phalanx import context

# support.membership: the membership unit tests' store; pytester: tests of the hygiene itself
pytest_plugins = ["support.strategies", "support.membership", "pytester"]


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


@pytest.fixture(autouse=True)
def _restored_environment():
    """Every test ends with the environment variables it started with (set by it or by phalanx)."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def _no_child_processes(request):
    """A multiprocess test leaves no child process alive: fail naming them (then kill them).

    Only tests marked ``multiprocess`` are checked: scanning /proc costs ~20 ms here.
    """
    if request.node.get_closest_marker("multiprocess") is None:
        yield
        return
    before = set(_children())
    yield
    deadline = time.monotonic() + 2  # a child killed by the test may still be on its way out
    while (left := {p: c for p, c in _children().items() if p not in before}) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"child processes outlived the test: {left}"


def _children() -> dict[int, str]:
    """This process's live (non-zombie) children: pid -> command line."""
    me, found = os.getpid(), {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] != "Z" and int(stat[1]) == me:
                found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue  # it ended meanwhile
    return found
