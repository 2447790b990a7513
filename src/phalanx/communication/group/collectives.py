"""The collectives of a worker group, on whichever transport carries them (all workers).

`WorkerGroup` (the job's group) and `phalanx.communication.group.subgroups.SubgroupEngine` (a group
made with ``torch.distributed.new_group``) share them: each collective is signed for the stall
inspector and the signature check (`phalanx.communication.checks.collective_check`), issued on the
group's transport (same-host shared memory, the TLS ring, else the signed gloo transport) and
waited on with the group's deadline and health check.
"""

from __future__ import annotations

import abc
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx import timeline
from phalanx.communication.checks.collective_check import CollectiveCheck, Signed
from phalanx.communication.checks.collective_watch import CollectiveWatch
from phalanx.communication.transports.base import Transport
from phalanx.communication.transports.gloo.transport import DataFlag, GlooTransport, announced_tail
from phalanx.status.counters import COUNTERS

__all__ = ["GroupCollectives"]


def _op_name(op: Any) -> str:
    """``"SUM"`` for ``ReduceOp.SUM`` (whose str is ``"RedOpType.SUM"``)."""
    return str(op).rpartition(".")[2]


def _all_reduce_kind(op: Any) -> str:
    if not isinstance(op, dist.ReduceOp.RedOpType):  # an op object: keyed by identity, not cached
        return f"all_reduce({_op_name(op)})"
    return _op_kind(op)


@functools.lru_cache(maxsize=32)
def _op_kind(op: Any) -> str:
    return f"all_reduce({_op_name(op)})"  # (str of an op is slow: every all-reduce asks)


class GroupCollectives(abc.ABC):
    """The collectives of a group (all workers of it, same order; same shape and dtype on
    every worker unless said otherwise). A subclass provides the transports, the signing and
    the watched wait."""

    rank: int
    world_size: int
    _transport: Transport | None  # the registered transport that opened for the group
    _gloo: GlooTransport  # where none did
    _watch: CollectiveWatch
    _check: CollectiveCheck

    @abc.abstractmethod
    def _check_usable(self, what: str) -> None:
        """Raises if the group can no longer be used (closed, or failed)."""

    @abc.abstractmethod
    def _watched_wait(self, work: Any, what: str, timeout: float | None, where_issued: bool) -> None:
        """Waits for ``work`` with the group's deadline and health check."""

    def _sign(self, kind: str, tensor: torch.Tensor, what: str) -> tuple[Any, Signed]:
        """The collective's stall-inspector signature (None when off) and its checked code."""
        signature = self._watch.issue(kind, (tensor,), what)
        return signature, self._check.sign(kind, tensor, what, signature)

    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        may_block: bool = False,
        what: str = "all_reduce",
    ) -> Any:
        """Starts an in-place all-reduce and returns its work; pass it to `wait` (all workers).

        ``may_block``: the caller issues nothing another worker waits for until this one ends
        (the gradient buckets): a transport that can (`RunsOnCaller`) may run it on this
        thread, and this call then returns once every worker met, counted as this worker
        waiting in ``what`` (the stall inspector, the status page's wait fraction).

        Precondition: same shape and dtype on every worker, same call order.
        """
        self._check_usable("all_reduce")
        signature, signed = self._sign(_all_reduce_kind(op), tensor, "all_reduce")
        transport = self._transport or self._gloo
        # `RunsOnCaller`'s method, looked up: a protocol's isinstance costs ~8 us, every bucket asks
        run_here = getattr(transport, "all_reduce_may_block_async", None) if may_block else None
        if run_here is not None:
            work = self._waiting_at_issue(lambda: run_here(tensor, op, signed), signature, what)
        else:
            work = transport.all_reduce_async(tensor, op, signed)
        return self._watch.attach(work, signature)

    def _waiting_at_issue(self, issue: Callable[[], Any], signature: Any, what: str) -> Any:
        """``issue()``, which may block until every worker met, counted as a watched wait
        counts: the stall inspector sees this worker waiting in ``what`` at the call site, the
        timeline a span, the status page its wait fraction (which names the straggler)."""
        with timeline.span(what, "collective"):
            self._watch.begin_wait_at_issue(signature, what)
            start = time.monotonic()
            try:
                return issue()
            finally:
                self._watch.end_wait()
                COUNTERS.waited(time.monotonic() - start)

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        what: str = "all_reduce",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """In-place all-reduce of a contiguous tensor (all workers; same shape and dtype).

        ``timeout`` overrides the group's collective timeout for this call.
        """
        self._check_usable(what)
        self._watched_wait(self.all_reduce_async(tensor, op), what, timeout, where_issued=True)
        return tensor

    def try_reduce_scatter_async(
        self, tensor: torch.Tensor, output: torch.Tensor, op: Any = dist.ReduceOp.SUM
    ) -> Any | None:
        """Starts a reduce-scatter where the transport has one of its own and
        returns its work: ``tensor`` holds one part per worker, laid end to end, each the size of
        ``output``, which receives this worker's part of the reduction. None where the transport
        has none (the caller all-reduces instead; nothing was issued). All workers.
        """
        transport = self._transport
        if transport is None or not transport.can_reduce_scatter(tensor, output, op):
            return None
        self._check_usable("reduce_scatter")
        signature, signed = self._sign(f"reduce_scatter({_op_name(op)})", tensor, "reduce_scatter")
        return self._watch.attach(transport.reduce_scatter_async(tensor, output, op, signed), signature)

    def try_all_gather_into_async(self, tensor: torch.Tensor, output: torch.Tensor) -> Any | None:
        """Starts gathering every worker's ``tensor`` straight into ``output`` (the workers'
        tensors laid end to end, in rank order) where the transport can and
        returns its work; None elsewhere (the caller uses `all_gather_async`; nothing was
        issued). All workers.
        """
        transport = self._transport
        if transport is None or not transport.can_all_gather_into(tensor, output):
            return None
        self._check_usable("all_gather")
        signature, signed = self._sign("all_gather", tensor, "all_gather")
        return self._watch.attach(transport.all_gather_into_async(tensor, output, signed), signature)

    @property
    def announced_tail(self) -> int:
        """How many final elements of the last announced all-reduce `announce_all_reduces`
        may use (give it as ``tail``): the break mark, the next pass's announcement and the
        end-of-data flag (`phalanx.communication.transports.gloo.transport.announced_tail`) over gloo;
        elsewhere, where nothing is announced, the one element it has always left."""
        if self._transport is not None:
            return 1
        return announced_tail(self.world_size)

    def announce_all_reduces(
        self, specs: Sequence[tuple[int, torch.dtype]], what: str = "the gradient all-reduces", tail: int = 1
    ) -> None:
        """Announces this worker's next ``len(specs)`` collectives: SUM all-reduces of these
        element counts and dtypes, the last of which leaves its final ``tail`` elements to
        the check (all workers, at the same point). Over gloo with the collective check on,
        when some do not fit in a first message, they then go as one gloo call each
        (`phalanx.communication.transports.gloo.transport`); with ``tail`` of `announced_tail`, the last
        one announces the next pass too, which then needs no announcement. Elsewhere a no-op.
        Empty ``specs``: the next pass's all-reduces differ from this one's (all workers)."""
        if self._transport is not None:
            return
        if not specs:
            self._gloo.forget_pre_announced()
            return
        if not self._gloo.worth_announcing(specs) or self._gloo.pre_announced(specs):
            return
        self._check_usable(what)
        codes = self._check.upcoming_codes("all_reduce(SUM)", list(specs))
        shapes = tuple(torch.empty(n, dtype=d, device="meta") for n, d in specs)  # for the report
        signature = self._watch.issue("announce(all_reduce(SUM))", shapes, what)
        # the code covers every announced size (the report shows them as shapes)
        sizes = ", ".join(f"{str(d).removeprefix('torch.')}[{n}]" for n, d in specs)
        signed = self._check.sign(f"announce(all_reduce(SUM) of {sizes})", shapes[0], what, signature)
        self._gloo.announce(signed, [(n, d, c) for (n, d), c in zip(specs, codes, strict=True)], tail)

    def carry_data_flag(self, has_data: bool) -> DataFlag | None:
        """Sends whether this worker has input for the next step with the next pass's last
        gradient all-reduce, where that can carry it (gloo, announced passes): the flag's
        ``agreed`` says, after that pass, whether any worker has (None: ask with an
        all-reduce). None where nothing carries it. All workers, at the same point."""
        if self._transport is not None or not self._gloo.announces:
            return None
        flag = DataFlag(has_data)
        self._gloo.carry(flag)
        return flag

    def broadcast_async(self, tensor: torch.Tensor, src: int) -> Any:
        """Starts an in-place broadcast of a contiguous tensor from worker ``src`` and returns its
        work; pass it to `wait` (all workers; same shape and dtype)."""
        self._check_usable("broadcast")
        signature, signed = self._sign(f"broadcast(from {src})", tensor, "broadcast")
        transport = self._transport or self._gloo  # all-reduces' order: a mismatch is met
        return self._watch.attach(transport.broadcast_async(tensor, src, signed), signature)

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, what: str = "broadcast", timeout: float | None = None
    ) -> torch.Tensor:
        """In-place broadcast from worker ``src`` (all workers; same shape and dtype)."""
        self._check_usable(what)
        self._watched_wait(self.broadcast_async(tensor, src), what, timeout, where_issued=True)
        return tensor

    def all_gather_async(self, tensor: torch.Tensor) -> tuple[Any, list[torch.Tensor]]:
        """Starts gathering every worker's contiguous tensor: its work (pass it to `wait`) and
        the list, in rank order, it fills (all workers; same shape and dtype everywhere)."""
        self._check_usable("all_gather")
        signature, signed = self._sign("all_gather", tensor, "all_gather")
        transport = self._transport or self._gloo
        work, out = transport.all_gather_async(tensor, signed)
        return self._watch.attach(work, signature), out

    def all_gather(
        self, tensor: torch.Tensor, what: str = "all_gather", timeout: float | None = None
    ) -> list[torch.Tensor]:
        """Every worker's tensor, in rank order (all workers; same shape and dtype everywhere)."""
        self._check_usable(what)
        work, out = self.all_gather_async(tensor.contiguous())
        self._watched_wait(work, what, timeout, where_issued=True)
        return out
