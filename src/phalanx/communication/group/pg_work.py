"""The pieces of the phalanx process group (`phalanx.communication.group.process_group`): the engine it
runs on, its work objects, and how torch's tensor lists are laid out for one collective."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = ["Engine", "Work", "check_cpu", "copy_into", "end_to_end", "op_of", "unflatten_into"]


class Engine(Protocol):
    """What the group runs its collectives on (`WorkerGroup`; all workers, same order)."""

    rank: int
    world_size: int

    @property
    def uses_tls(self) -> bool: ...

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = ...) -> Any: ...

    def try_reduce_scatter_async(
        self, tensor: torch.Tensor, output: torch.Tensor, op: Any = ...
    ) -> Any | None: ...

    def try_all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor) -> Any | None: ...

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Any: ...

    def all_gather_async(self, tensor: torch.Tensor) -> tuple[Any, list[torch.Tensor]]: ...

    def wait(self, work: Any, what: str, timeout: float | None = None) -> None: ...

    def subgroup(self, gloo: Any, store: Any, rank: int, size: int, global_ranks: Sequence[int]) -> Engine:
        """The engine of a ``new_group()`` of some of its workers (`communication.group.subgroups`)."""
        ...


class Work(dist.Work):
    """A collective of this group: ``wait`` is the engine's watched wait (deadline, health,
    mismatch naming); ``get_future`` completes with the output tensors once the transport
    finished and the results were copied into place (DDP's communication hooks chain on it)."""

    def __init__(
        self, engine: Engine, inner: Any, what: str, finish: Callable[[], list[torch.Tensor]]
    ) -> None:
        super().__init__()
        self._engine, self._inner, self._what, self._finish = engine, inner, what, finish
        self._future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        _on_done(inner, self._complete)

    def _complete(self, error: BaseException | None) -> None:
        if error is None:
            try:
                self._future.set_result(self._finish())
            except BaseException as exc:  # a failed copy fails the collective
                self._future.set_exception(exc)  # type: ignore[arg-type]
        else:
            self._future.set_exception(error)  # type: ignore[arg-type]

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        self._engine.wait(self._inner, self._what, seconds)
        self._future.wait()  # the results are in place (raises the collective's error)
        return True

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> BaseException | None:
        if not self._future.done():
            return None
        try:
            self._future.value()
        except BaseException as exc:
            return exc
        return None

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        return self._future


def _on_done(work: Any, callback: Callable[[BaseException | None], None]) -> None:
    """Calls ``callback(error or None)`` once ``work`` (ours or a gloo work) finished."""
    if hasattr(work, "add_done_callback"):  # QueuedWork of phalanx's own transports
        work.add_done_callback(callback)
        return

    def relay(future: torch.futures.Future[Any]) -> None:
        try:
            future.value()
        except BaseException as exc:
            callback(exc)
        else:
            callback(None)

    work.get_future().add_done_callback(relay)


def op_of(opts: Any) -> Any:
    """The ``ReduceOp.RedOpType`` of reduce options (SUM when none), as the transports key it."""
    op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
    return getattr(op, "op", op)


def check_cpu(tensors: Sequence[torch.Tensor], what: str) -> None:
    for tensor in tensors:
        if tensor.device.type != "cpu":
            raise ValueError(
                f"The phalanx process group carries CPU tensors. Received: {what} of a tensor on "
                f"{tensor.device}. HINT: on GPUs MultiWorkerMirroredStrategy uses NCCL; move the "
                "tensor to the CPU or make a NCCL group of your own."
            )


def end_to_end(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors laid end to end (a copy, except a lone contiguous tensor's own view)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    target.copy_(source.view_as(target))


def unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        n = tensor.numel()
        if flat.data_ptr() != tensor.data_ptr() or n != flat.numel():
            tensor.copy_(flat[offset : offset + n].view_as(tensor))
        offset += n
