"""The per-thread stack of strategy and replica contexts (docs/architecture.md, "Contexts").

The bottom layer: it imports no strategy. `strategy.scope()` pushes a cross-replica frame;
`strategy.run` pushes a replica frame in each replica's thread; `merge_call` pushes a
cross-replica frame again. Outside any frame the default strategy is current: which one that
is, and the public `get_strategy` / `get_replica_context` / `experimental_set_strategy`, live
with it in `phalanx.strategies.current`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = [
    "NOT_PUSHED",
    "Frame",
    "current_frame",
    "current_replica",
    "current_replica_context",
    "experimental_set_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "pop_replica_frame",
    "push_frame",
    "push_replica_frame",
    "push_replica_frame_at_top",
    "write_guard",
]


@dataclass(frozen=True)
class Frame:
    """One entry of a thread's context stack."""

    strategy: DistributionStrategy
    replica_context: Any  # the `phalanx.ReplicaContext`; None: cross-replica context


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.stack: list[Frame] = []
        # Fast path for distributed variables: (strategy, local replica index) or None.
        self.replica: tuple[Any, int] | None = None
        self.set_strategy_scope: Any = None
        # phalanx.nn._module_tensors.ReplicaWriteGuard of the replica frame running here
        self.write_guard: Any = None


_state = _ThreadState()


def current_replica() -> tuple[Any, int] | None:
    """(strategy, local replica index) of this thread's replica context, or None."""
    return _state.replica


def current_frame() -> Frame | None:
    """This thread's innermost frame (strategy and replica context), or None outside any."""
    stack = _state.stack
    return stack[-1] if stack else None


def write_guard() -> Any:
    """The write guard of the replica frame running on this thread, or None."""
    return _state.write_guard


def current_replica_context() -> Any:
    """The replica context of this thread's innermost frame; None in cross-replica context
    and outside any frame (unlike `phalanx.get_replica_context`, no default strategy's)."""
    frame = current_frame()
    return None if frame is None else frame.replica_context


@contextmanager
def push_frame(
    strategy: DistributionStrategy, replica_context: Any, write_guard: Callable[[], Any] | None = None
) -> Iterator[None]:
    """Makes ``strategy`` current on this thread, in replica or cross-replica context.

    Args:
        strategy: The strategy.
        replica_context: Its replica context, or None for cross-replica context.
        write_guard: Makes the guard of in-place writes for an outermost replica frame (one
            with no guard active on this thread yet); its ``check()`` runs when the frame ends
            without an error.
    """
    frame = Frame(strategy, replica_context)
    previous = _state.replica
    _state.stack.append(frame)
    _state.replica = None if replica_context is None else (strategy, replica_context.local_replica_index)
    guard = None
    if write_guard is not None and _state.write_guard is None:
        guard = _state.write_guard = write_guard()
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


def push_replica_frame(frame: Frame, index: int) -> tuple[Any, int] | None:
    """Pushes a prepared replica ``frame`` of local replica ``index`` (the fast path of a
    strategy with one local replica; no guard). Returns what `pop_replica_frame` restores."""
    previous = _state.replica
    _state.stack.append(frame)
    _state.replica = (frame.strategy, index)
    return previous


NOT_PUSHED: Any = object()  # `push_replica_frame_at_top`'s answer when it pushed nothing


def push_replica_frame_at_top(frame: Frame, index: int) -> Any:
    """`push_replica_frame` when this thread is outside any frame or in ``frame.strategy``'s
    cross-replica context (the usual place of a one-replica `run`: one look at the stack,
    one call); else pushes nothing and returns `NOT_PUSHED` (the caller checks the stack
    the long way and raises what it must)."""
    stack = _state.stack
    if stack:
        top = stack[-1]
        if top.strategy is not frame.strategy or top.replica_context is not None:
            return NOT_PUSHED
    previous = _state.replica
    stack.append(frame)
    _state.replica = (frame.strategy, index)
    return previous


def pop_replica_frame(previous: tuple[Any, int] | None) -> None:
    """Pops the frame `push_replica_frame` pushed."""
    _state.stack.pop()
    _state.replica = previous


def has_strategy() -> bool:
    """True when a non-default strategy is current on this thread."""
    top = current_frame()
    return top is not None and not top.strategy.is_default


def in_cross_replica_context() -> bool:
    """True inside a non-default strategy's scope but outside its `run` (or inside merge_call)."""
    top = current_frame()
    return top is not None and not top.strategy.is_default and top.replica_context is None


def experimental_set_strategy(strategy: DistributionStrategy | None) -> None:
    """Makes ``strategy`` current on this thread as if its scope were entered; None undoes it.

    Raises:
        RuntimeError: A scope is open on top of the one this call set, so it cannot be left,
            or the call is inside a ``with strategy.scope():`` block.
    """
    old = _state.set_strategy_scope
    if old is not None:
        if current_frame() is not old[1]:
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
        _state.set_strategy_scope = (scope, current_frame())
