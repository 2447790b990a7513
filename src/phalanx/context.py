"""The per-thread stack of strategy and replica contexts (docs/architecture.md, "Contexts").

Outside any scope a thread sees the default strategy in its default replica context.
`strategy.scope()` pushes a cross-replica frame; `strategy.run` pushes a replica frame in
each replica's thread; `merge_call` pushes a cross-replica frame again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.strategies.strategy import ReplicaContext, Strategy

__all__ = [
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


@dataclass(frozen=True)
class _Frame:
    strategy: Strategy
    replica_context: ReplicaContext | None  # None: cross-replica context


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        # Fast path for distributed variables: (strategy, local replica index) or None.
        self.replica: tuple[Any, int] | None = None
        self.set_strategy_scope: Any = None
        # phalanx.nn._module_tensors.ReplicaWriteGuard of the replica frame running here
        self.write_guard: Any = None


_state = _ThreadState()


def _top() -> _Frame | None:
    stack = _state.stack
    return stack[-1] if stack else None


def current_replica() -> tuple[Any, int] | None:
    """(strategy, local replica index) of this thread's replica context, or None."""
    return _state.replica


def current_frame() -> _Frame | None:
    """This thread's innermost frame (strategy and replica context), or None outside any."""
    stack = _state.stack
    return stack[-1] if stack else None


def write_guard() -> Any:
    """The write guard of the replica frame running on this thread, or None."""
    return _state.write_guard


@contextmanager
def push_frame(strategy: Strategy, replica_context: ReplicaContext | None) -> Iterator[None]:
    """Makes ``strategy`` current on this thread, in replica or cross-replica context."""
    frame = _Frame(strategy, replica_context)
    previous = _state.replica
    _state.stack.append(frame)
    _state.replica = None if replica_context is None else (strategy, replica_context.local_replica_index)
    guard = _start_write_guard(strategy, replica_context)
    try:
        yield
        if guard is not None:
            guard.check()
    finally:
        if guard is not None:
            _state.write_guard = None
        popped = _state.stack.pop()
        _state.replica = previous
        if popped is not frame:  # pragma: no cover - would be a bug in phalanx
            raise RuntimeError("phalanx context stack corrupted: frames popped out of order.")


def _start_write_guard(strategy: Strategy, replica_context: ReplicaContext | None) -> Any:
    """A write guard for the outermost replica frame of a strategy with several local
    replicas and distributed variables (whose modules hand replicas plain components)."""
    if (
        replica_context is None
        or _state.write_guard is not None
        or strategy.num_local_replicas < 2
        or not strategy.variable_policy.has_variables
    ):
        return None
    from phalanx.nn._module_tensors import ReplicaWriteGuard

    guard = ReplicaWriteGuard(strategy, replica_context.local_replica_index)
    _state.write_guard = guard
    return guard


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope (or replica context) is active, else the default."""
    top = _top()
    if top is not None:
        return top.strategy
    from phalanx.strategies.default import default_strategy

    return default_strategy()


def has_strategy() -> bool:
    """True when a non-default strategy is current on this thread."""
    top = _top()
    return top is not None and not top.strategy._is_default


def in_cross_replica_context() -> bool:
    """True inside a non-default strategy's scope but outside its `run` (or inside merge_call)."""
    top = _top()
    return top is not None and not top.strategy._is_default and top.replica_context is None


def get_replica_context() -> ReplicaContext | None:
    """The current replica context, or None in cross-replica context.

    Outside any scope this is the default strategy's replica context, so library code can
    call ``get_replica_context().all_reduce(...)`` unconditionally.
    """
    top = _top()
    if top is None:
        from phalanx.strategies.default import default_strategy

        return default_strategy().replica_context(0)
    if top.strategy._is_default and top.replica_context is None:
        return top.strategy.replica_context(0)
    return top.replica_context


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Makes ``strategy`` current on this thread as if its scope were entered; None undoes it.

    Raises:
        RuntimeError: A scope is open on top of the one this call set, so it cannot be left,
            or the call is inside a ``with strategy.scope():`` block.
    """
    old = _state.set_strategy_scope
    if old is not None:
        if _top() is not old[1]:
            raise RuntimeError(
                "experimental_set_strategy cannot replace a strategy while another scope is "
                "open on top of it. HINT: leave that `with strategy.scope():` block first."
            )
        old[0].__exit__(None, None, None)
        _state.set_strategy_scope = None
    if _state.stack:
        raise RuntimeError(
            "experimental_set_strategy must not be called inside a `with strategy.scope():` block "
            "(it would be left when that block ends). HINT: call it before entering the scope, or "
            "use the scope alone."
        )
    if strategy is not None:
        scope = strategy.scope()
        scope.__enter__()
        _state.set_strategy_scope = (scope, _top())
