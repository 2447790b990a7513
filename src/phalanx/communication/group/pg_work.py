"""The pieces of the phalanx process group (`phalanx.communication.group.process_group`): the engine it
runs on, its work objects, and how torch's tensor lists are laid out for one collective."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

__all__ = [
    "Channel",
    "Engine",
    "PeerLinks",
    "Work",
    "check_cpu",
    "copy_into",
    "end_to_end",
    "op_of",
    "unflatten_into",
]


class Channel(Protocol):
    """Point-to-point messages of one group over an engine's own links (ranks of the group;
    `phalanx.communication.transports.tls.peers.PeerChannel`)."""

    def send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Starts sending ``tensor`` to rank ``dst``; its work is done once the bytes left."""
        ...

    def recv_async(self, tensor: torch.Tensor, src: int | None, tag: int) -> tuple[Any, Callable[[], int]]:
        """Starts receiving into ``tensor`` from rank ``src`` (None: any): its work, and a
        function that says which rank sent it once done."""
        ...

    def describe(self, doing: str, peer: int | None, tag: int) -> str:
        """``"recv from worker:1 (host:port) with tag 3"``, for messages."""
        ...


class PeerLinks(Protocol):
    """An engine's links between any two workers of the job."""

    def channel(self, group_name: str, members: list[int]) -> Channel:
        """The links as the group ``group_name`` sees them (``members``: each group rank's job rank)."""
        ...


class Engine(Protocol):
    """What the group runs its collectives on (`WorkerGroup`; all workers, same order)."""

    rank: int
    world_size: int

    @property
    def uses_tls(self) -> bool: ...

    @property
    def point_to_point(self) -> PeerLinks | None:
        """What carries ``send``/``recv`` besides the group's gloo (the TLS links), or None."""
        ...

    def all_reduce_async(
        self, tensor: torch.Tensor, op: Any = ..., may_block: bool = ..., what: str = ...
    ) -> Any: ...

    def try_reduce_scatter_async(
        self, tensor: torch.Tensor, output: torch.Tensor, op: Any = ...
    ) -> Any | None: ...

    def try_all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor) -> Any | None: ...

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Any: ...

    def all_gather_async(self, tensor: torch.Tensor) -> tuple[Any, list[torch.Tensor]]: ...

    def wait(self, work: Any, what: str, timeout: float | None = None) -> None: ...

    def subgroup(
        self,
        gloo: Any,
        store: Any,
        rank: int,
        size: int,
        global_ranks: Sequence[int],
        timeout: float | None = None,
        group_name: str = "",
    ) -> Engine:
        """The engine of a ``new_group()`` of its workers (`communication.group.subgroups`)."""
        ...


class Work(dist.Work):
    """A collective of this group: ``wait`` is the engine's watched wait (deadline, health,
    mismatch naming); ``get_future`` completes with the output tensors once the transport
    finished and the results were copied into place (DDP's communication hooks chain on it).
    ``source``: for a receive, which rank of the group sent it (torch's ``_source_rank``)."""

    def __init__(
        self,
        engine: Engine,
        inner: Any,
        what: str,
        finish: Callable[[], list[torch.Tensor]],
        source: Callable[[], int] | None = None,
    ) -> None:
        super().__init__()
        self._engine, self._inner, self._what, self._finish = engine, inner, what, finish
        self._sender = source
        self._source: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
        # What callers see: chained, so that a failure is an error of the C++ future too. A
        # Python ``set_exception`` alone is a value to C++ readers (DDP's reducer takes its
        # first tensor: a crash), while a raising ``then`` callback sets the C++ error.
        self._future: torch.futures.Future[list[torch.Tensor]] = self._source.then(_value_of)
        _on_done(inner, self._complete)

    def _complete(self, error: BaseException | None) -> None:
        if error is None:
            try:
                self._source.set_result(self._finish())
            except Exception as exc:  # a failed copy fails the collective
                self._source.set_exception(exc)  # type: ignore[arg-type]
        else:
            self._source.set_exception(_as_exception(error))  # type: ignore[arg-type]

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

    def _source_rank(self) -> int:
        """The group rank a finished receive got its message from (what ``torch.distributed.recv``
        without ``src`` returns, as a global rank).

        Raises:
            ValueError: The work is not a receive.
        """
        if self._sender is None:
            raise ValueError(f"{self._what} is not a receive: it has no source rank.")
        return self._sender()


def _value_of(future: torch.futures.Future[list[torch.Tensor]]) -> list[torch.Tensor]:
    return future.value()  # raises the collective's error: the chained future's C++ error


def _as_exception(error: BaseException) -> Exception:
    """``error`` as an Exception (what a future can hold); a bare BaseException is wrapped."""
    if isinstance(error, Exception):
        return error
    wrapped = RuntimeError(f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


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
            tensor.detach().copy_(flat[offset : offset + n].view_as(tensor))  # as the transports write
        offset += n
