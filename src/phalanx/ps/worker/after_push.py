"""Variables a worker pushed gradients for, read again only if the function uses them after.

A push (``optimizer.step()`` in a scheduled function) returns no values: with several
workers, another worker's push nearly always lands before this worker's next function, which
must read the variables again anyway, so values sent back with every push were mostly thrown
away (an MLP's whole weights, every step). The pushed variables are *pending* instead: the
first torch operation of the rest of the function that takes one of them (a forward pass,
``w.sum()``, ``w.clone()``, returning it) reads every pending variable from its ps task
first, as TF reads a variable from its ps after an update in the same function. A function
that only returns its loss after the step reads nothing.

A function that looks rows of a table up (`phalanx.ps.worker.embedding`) defers its first read
the same way: its dense variables are pending from the start, and the first lookup reads them
with the rows, in one RPC per ps task (`WorkerEnvironment.lookup_rows`), unless a torch
operation takes one of them first. Either read comes after every push of this worker, so
neither reads a value older than the sequential program would.

`AfterPush` is a ``TorchFunctionMode`` entered at the first push of a function and left when
the function ends (`WorkerEnvironment.run`); before any push it is not on the stack at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["AfterPush"]

# what reads no values: property access (``p.grad``, ``p.shape``; ``p.data`` excepted) and
# metadata, which the optimizer's own step and ``zero_grad`` touch after every push
_DESCRIPTOR_CALLS = frozenset({"__get__", "__set__", "__delete__"})
_DATA = torch.Tensor.data  # the descriptor (class access)
_METADATA = frozenset(
    {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride, torch.Tensor.is_contiguous}
)


def _reads_values(func: Any) -> bool:
    if getattr(func, "__name__", "") in _DESCRIPTOR_CALLS:
        return getattr(func, "__self__", None) is _DATA
    return func not in _METADATA


def _any_leaf(value: Any, ids: dict[int, str]) -> bool:
    """Whether ``value`` or an item of its lists, tuples and dicts (nested) is in ``ids``: the
    containers torch operations take (pytree's general walk cost more than the operation)."""
    if id(value) in ids:
        return True
    if isinstance(value, list | tuple):
        return any(_any_leaf(item, ids) for item in value)
    if isinstance(value, dict):
        return any(_any_leaf(item, ids) for item in value.values())
    return False


class AfterPush(TorchFunctionMode):
    """Reads pending variables before the first torch operation that takes one.

    Args:
        read: Reads the variables of the given names from their ps tasks into the local
            tensors (`WorkerEnvironment.refresh` of their handles).
    """

    def __init__(self, read: Callable[[Sequence[str]], None]) -> None:
        super().__init__()
        self._read = read
        self._pending: dict[int, str] = {}  # id(local tensor) -> variable name
        self.active = False

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        """Marks ``tensors`` (name -> local tensor) pending; enters the mode on first use."""
        if not tensors:
            return
        self._pending.update((id(t), name) for name, t in tensors.items())
        if not self.active:
            self.__enter__()
            self.active = True

    def finish(self) -> None:
        """Leaves the mode (the function ended) and forgets what is pending: the next function
        reads every variable it uses that changed anyway."""
        self._pending.clear()
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def take(self) -> list[str]:
        """The names pending, which the caller reads now (with a lookup of rows, in the same
        RPC); none is pending afterwards."""
        names = sorted(set(self._pending.values()))
        self._pending.clear()
        self._leave_if_on_top()
        return names

    def _leave_if_on_top(self) -> None:
        """Leaves the mode while nothing is pending, so that the rest of the function's torch
        operations (an embedding step's forward and backward after its lookup) do not go
        through ``__torch_function__``; `add` enters it again. Only when it is the innermost
        mode: inside its own handler (a `flush`) torch has taken it off the stack, and a mode
        the function entered after it stays above it."""
        depth = torch._C._len_torch_function_stack()
        if self.active and depth and torch._C._get_function_stack_at(depth - 1) is self:
            self.active = False
            self.__exit__(None, None, None)

    def flush(self) -> None:
        """Reads every pending variable now."""
        if self._pending:
            self._read(self.take())

    @staticmethod
    def outside() -> contextlib.AbstractContextManager[Any]:
        """A block of phalanx's own reads and pushes that the mode does not watch: they touch
        gradients and the wire's buffers, never a pending variable's values (a read writes
        them), and each of their ~100 torch operations per push would otherwise go through
        ``__torch_function__`` (~1 us each; torch disables modes and subclass handlers alike)."""
        return torch._C.DisableTorchFunction()

    def _takes_pending(self, arguments: Any) -> bool:
        return _any_leaf(arguments, self._pending)

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._pending and _reads_values(func) and self._takes_pending((args, kwargs)):
            self.flush()
        return func(*args, **kwargs)
