"""phalanx's transports as a torch.distributed backend: the ``"phalanx"`` process group.

Under MultiWorkerMirroredStrategy on CPUs the default process group is a `PhalanxProcessGroup`
(``torch.distributed.get_backend() == "phalanx"``): a user's own ``torch.distributed`` calls,
DDP, torchmetrics' state sync, ``torch.distributed.checkpoint`` and FSDP2 run on the job's
transport (same-host shared memory, the mutual-TLS ring between machines, else gloo) with the
same deadlines, the same signature check and the same stall-inspector naming as phalanx's
own collectives (`phalanx.communication.group.worker_group.WorkerGroup` is the engine underneath:
every collective here is one of its all-reduces, broadcasts or all-gathers). A group made with
``torch.distributed.new_group()`` without ``backend=`` is a `PhalanxProcessGroup` too, on an
engine of its own that signs its collectives the same way (`phalanx.communication.group.subgroups`);
under TLS its collectives go over a ring of its members of its own.

How each torch collective is carried (W workers, r this one):

* ``allreduce``, ``allreduce_coalesced``: one all-reduce of the tensors laid end to end; a
  sparse tensor (SUM only): all-gathers of its entries, summed (`group.sparse_all_reduce`).
* ``broadcast``; ``allgather`` (all its forms), ``gather``: all-gathers (gather keeps the root's).
* ``reduce_scatter_tensor`` and one-output ``reduce_scatter`` (FSDP2's): on shared memory a
  true reduce-scatter (each worker sums only its part of every peer's slot); elsewhere, and
  for the coalesced forms and ``reduce``, an all-reduce of the input of which this worker
  keeps its part (W times the bytes of a true reduce-scatter).
* ``scatter``: a broadcast from the root of every part; ``barrier``: an all-reduce of one number.
* ``alltoall`` (both forms): the gloo group underneath (no signature check); under TLS two
  all-gathers over the ring (`group.all_to_all`), never plaintext gloo.
* ``send``, ``recv`` (and ``isend``, ``irecv``, ``batch_isend_irecv``, a receive from any
  source): the gloo group underneath; under TLS the job's point-to-point TLS links between
  any two workers (`phalanx.communication.transports.tls.peers`), matched by group, sender
  and tag as gloo matches them, never plaintext gloo.

Ops that torch's C++ code sends to the group's registered device backend without asking the
Python object reach that gloo group too; under TLS no gloo is registered, so such a path
fails with torch's "No backend type associated with device type cpu" instead of leaving the
machine in plaintext (FSDP2, DTensor's ``full_tensor`` and DCP take the Python methods:
tests/multiprocess/test_torch_collectives.py). ``AVG`` (FSDP2's reduce-scatter) is a sum
divided here.

Why our own Python backend: no upstream transport does same-host shared memory and TLS between
machines (docs/architecture.md). NCCL stays NCCL on GPUs: this group is made for ``gloo`` jobs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from phalanx.communication.group import point_to_point
from phalanx.communication.group.all_to_all import all_to_all_by_gather
from phalanx.communication.group.pg_work import (
    Channel,
    Engine,
    Work,
    check_cpu,
    copy_into,
    end_to_end,
    op_of,
    unflatten_into,
)
from phalanx.communication.group.sparse_all_reduce import check_sparse, sparse_all_reduce
from phalanx.communication.transports.gloo.groups import make_gloo_group

__all__ = ["BACKEND", "PhalanxProcessGroup", "register_backend"]

BACKEND = "phalanx"
_UNSUPPORTED_HINT = (
    "HINT: unset PHALANX_COLLECTIVES=tls only on a network where every host is trusted, or express "
    "the exchange with all_reduce/all_gather/broadcast (docs/security.md)."
)


class PhalanxProcessGroup(dist.ProcessGroup):
    """The job's process group on phalanx's transports (see the module doc).

    Made by ``torch.distributed.init_process_group("phalanx", pg_options=engine)`` inside
    `WorkerGroup`; users never make one themselves.

    Args:
        store, rank, world_size, timeout: What torch passes to every backend.
        engine: The worker group whose transports carry the collectives.
        gloo: The gloo group underneath, when the engine was made with it (a subgroup's);
            default: a new one on ``store``.
        group_name: torch's name of the group (its messages' channel on point-to-point links).
        members: Each group rank's rank in the job (default: the same ranks).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: timedelta,
        engine: Engine,
        gloo: Any = None,
        group_name: str = "",
        members: Sequence[int] | None = None,
    ) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]  # the Python subclass form
        self._engine = engine
        links = engine.point_to_point
        # send and recv: the engine's own links where it has them (TLS), else the gloo below
        self._channel: Channel | None = (
            None if links is None else links.channel(group_name, list(members or range(world_size)))
        )
        # the group underneath: the engine's fallback (plain gloo), and the device backend
        # torch's C++ code finds for CPU tensors (not under TLS: plaintext between machines)
        self.gloo = gloo if gloo is not None else _gloo_under(store, rank, world_size, timeout)
        if not engine.uses_tls:
            self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, self.gloo)

    @property
    def engine(self) -> Engine:
        """The worker group (or subgroup engine) whose transports carry this group's collectives."""
        return self._engine

    def getBackendName(self) -> str:  # noqa: N802 (torch's C++ name)
        return BACKEND

    def name(self) -> str:
        return BACKEND

    # ---------------------------------------------------------------- helpers
    def _all_reduce(
        self, tensors: Sequence[torch.Tensor], op: Any, what: str, keep: Callable[[torch.Tensor], None]
    ) -> Work:
        check_cpu(tensors, what)
        # the transports write with out= and in place, which autograd refuses on a tensor that
        # requires grad (DDP's buckets under backward(create_graph=True)): the same memory, detached
        flat = end_to_end([t.detach() for t in tensors])
        mean = op == dist.ReduceOp.AVG  # FSDP2's reduce-scatter: a sum, divided here
        if mean and not flat.is_floating_point():
            raise ValueError(f"AVG needs a floating-point tensor. Received: {what} of {flat.dtype}.")
        inner = self._engine.all_reduce_async(flat, dist.ReduceOp.SUM if mean else op)

        def finish() -> list[torch.Tensor]:
            if mean:
                flat.div_(self.size())
            keep(flat)
            return list(tensors)

        return Work(self._engine, inner, what, finish)

    def _all_gather(
        self, tensor: torch.Tensor, what: str, keep: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    ) -> Work:
        check_cpu([tensor], what)
        inner, parts = self._engine.all_gather_async(tensor.contiguous())
        return Work(self._engine, inner, what, lambda: keep(parts))

    def _gloo_only(self, what: str) -> Any:
        """The gloo group underneath, for point-to-point where the engine has no links of its
        own; refused under TLS, where it would carry the bytes in plaintext (an engine made
        without the job's TLS transport, never the job's own group)."""
        if self._engine.uses_tls:
            raise RuntimeError(
                f"The phalanx process group cannot carry {what} without the job's point-to-point TLS links, "
                f"and gloo would send it in plaintext between machines. Received: torch.distributed.{what} "
                "under TLS on a group whose engine has no such links. " + _UNSUPPORTED_HINT
            )
        return self.gloo

    # ---------------------------------------------------------------- all-reduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        op = op_of(opts)
        if check_sparse(tensors, op, "all_reduce"):
            check_cpu(tensors, "all_reduce")
            return sparse_all_reduce(self._engine, tensors[0])
        return self._all_reduce(tensors, op, "all_reduce", lambda flat: unflatten_into(flat, tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:
        op = op_of(opts)
        check_sparse(tensors, op, "all_reduce_coalesced")
        return self._all_reduce(
            tensors, op, "all_reduce_coalesced", lambda flat: unflatten_into(flat, tensors)
        )

    def barrier(self, opts: Any = None) -> Work:
        return self._all_reduce([torch.zeros(1)], dist.ReduceOp.SUM, "barrier", lambda flat: None)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        staged = [t.clone() for t in tensors]

        def keep(flat: torch.Tensor) -> None:
            if self.rank() == opts.rootRank:
                unflatten_into(flat, tensors)

        return self._all_reduce(staged, op_of(opts), "reduce", keep)

    # ---------------------------------------------------------------- reduce-scatter
    def _reduce_scatter_one(self, output: torch.Tensor, stacked: torch.Tensor, op: Any, what: str) -> Work:
        """Reduce-scatters ``stacked`` (W parts laid end to end) into ``output``: the transport's
        own reduce-scatter where it has one (shared memory), else an all-reduce of a copy of
        which this worker keeps its part."""
        check_cpu([output, stacked], what)
        mean = op == dist.ReduceOp.AVG
        if mean and not stacked.is_floating_point():
            raise ValueError(f"AVG needs a floating-point tensor. Received: {what} of {stacked.dtype}.")
        flat = stacked.reshape(-1)
        inner = self._engine.try_reduce_scatter_async(flat, output, dist.ReduceOp.SUM if mean else op)
        if inner is not None:

            def finish() -> list[torch.Tensor]:
                if mean:
                    output.div_(self.size())
                return [output]

            return Work(self._engine, inner, what, finish)
        staged = flat.clone()
        n = output.numel()
        me = self.rank()
        return self._all_reduce(
            [staged], op, what, lambda flat: copy_into(output, flat[me * n : (me + 1) * n])
        )

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any = None
    ) -> Work:
        op = op_of(opts)
        if len(outputs) != 1:
            return self.reduce_scatter_tensor_coalesced(outputs, [end_to_end(i) for i in inputs], opts)
        return self._reduce_scatter_one(outputs[0], end_to_end(inputs[0]), op, "reduce_scatter")

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        op = op_of(opts)
        return self._reduce_scatter_one(output, input, op, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        op = op_of(opts)
        staged = [i.reshape(self.size(), -1) for i in inputs]  # (W, numel / W) each
        flat = torch.cat(staged, dim=1).reshape(-1)
        widths = [s.shape[1] for s in staged]
        me = self.rank()

        def keep(reduced: torch.Tensor) -> None:
            mine = reduced.view(self.size(), -1)[me]
            for output, part in zip(outputs, mine.split(widths), strict=True):
                output.copy_(part.view_as(output))

        return self._all_reduce([flat], op, "reduce_scatter_coalesced", keep)

    # ---------------------------------------------------------------- broadcast, all-gather
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Work:  # type: ignore[override]
        root = 0 if opts is None else opts.rootRank
        check_cpu(tensors, "broadcast")
        flat = end_to_end([t.detach() for t in tensors])  # a view of a lone contiguous tensor, else a copy
        inner = self._engine.broadcast_async(flat, root)

        def finish() -> list[torch.Tensor]:
            unflatten_into(flat, tensors)
            return list(tensors)

        return Work(self._engine, inner, "broadcast", finish)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        if len(inputs) != 1:  # torch's per-device form: outputs[i][rank] for input i
            by_rank = [list(row) for row in zip(*outputs, strict=True)]
            return self._all_gather_lists(by_rank, inputs, "all_gather")
        targets = outputs[0]

        def keep(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            for target, part in zip(targets, parts, strict=True):
                target.copy_(part.view_as(target))
            return targets

        return self._all_gather(inputs[0], "all_gather", keep)

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        """``all_gather_coalesced``: ``outputs[rank][i]`` receives worker ``rank``'s ``inputs[i]``."""
        return self._all_gather_lists(outputs, inputs, "all_gather_coalesced")

    def _all_gather_lists(
        self, by_rank: list[list[torch.Tensor]], inputs: list[torch.Tensor], what: str
    ) -> Work:
        """One all-gather of ``inputs`` laid end to end; ``by_rank[rank][i]`` gets worker
        ``rank``'s ``inputs[i]`` (W lists of ``len(inputs)`` tensors)."""
        if len(by_rank) != self.size() or any(len(row) != len(inputs) for row in by_rank):
            raise ValueError(
                f"{what} needs one list of {len(inputs)} output tensors per worker ({self.size()}), as "
                f"output_tensor_lists[rank][i]. Received: {[len(row) for row in by_rank]} tensors per "
                "list. HINT: pass [[torch.empty_like(t) for t in inputs] for _ in range(world_size)]."
            )
        sizes = [t.numel() for t in inputs]

        def keep(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            for row, part in zip(by_rank, parts, strict=True):  # part: (sum(sizes),) of one worker
                for target, piece in zip(row, part.split(sizes), strict=True):
                    target.copy_(piece.view_as(target))
            return [t for row in by_rank for t in row]

        return self._all_gather(end_to_end(inputs), what, keep)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Work:  # noqa: A002
        check_cpu([input, output], "all_gather_into_tensor")
        inner = self._engine.try_all_gather_into_async(input, output)
        if inner is not None:  # straight into output (shared memory)
            return Work(self._engine, inner, "all_gather_into_tensor", lambda: [output])

        def keep(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            torch.cat([p.reshape(-1) for p in parts], out=output.view(-1))
            return [output]

        return self._all_gather(input, "all_gather_into_tensor", keep)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Work:
        sizes = [t.numel() for t in inputs]

        def keep(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            for output, pieces in zip(
                outputs, zip(*(p.split(sizes) for p in parts), strict=True), strict=True
            ):
                torch.cat(list(pieces), out=output.view(-1))
            return outputs

        return self._all_gather(end_to_end(inputs), "all_gather_into_tensor_coalesced", keep)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Work:  # type: ignore[override]
        root = opts.rootRank

        def keep(parts: list[torch.Tensor]) -> list[torch.Tensor]:
            if self.rank() != root:
                return []
            for target, part in zip(outputs[0], parts, strict=True):
                target.copy_(part.view_as(target))
            return outputs[0]

        return self._all_gather(inputs[0], "gather", keep)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> Work:  # type: ignore[override]
        root, me, output = opts.rootRank, self.rank(), outputs[0]
        n = output.numel()
        if me == root:
            flat = torch.cat([t.reshape(-1) for t in inputs[0]])
        else:
            flat = torch.empty(n * self.size(), dtype=output.dtype)
        check_cpu([output], "scatter")
        inner = self._engine.broadcast_async(flat, root)

        def finish() -> list[torch.Tensor]:
            output.copy_(flat[me * n : (me + 1) * n].view_as(output))
            return [output]

        return Work(self._engine, inner, "scatter", finish)

    # ---------------------------------------------------------------- all-to-all
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        if self._engine.uses_tls:  # no plaintext gloo: all-gathers over the ring
            check_cpu([*outputs, *inputs], "all_to_all")
            return all_to_all_by_gather(self._engine, [t.detach() for t in inputs], outputs, "all_to_all")
        return self.gloo.alltoall(outputs, inputs)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,  # noqa: A002
        out_splits: list[int],
        in_splits: list[int],
        opts: Any = None,
    ) -> Any:
        if not self._engine.uses_tls:
            return self.gloo.alltoall_base(output, input, out_splits, in_splits)
        check_cpu([output, input], "all_to_all_single")
        world = self.size()
        sends = list(input.detach().split(list(in_splits) or input.shape[0] // world))
        receives = list(output.split(list(out_splits) or output.shape[0] // world))
        return all_to_all_by_gather(self._engine, sends, receives, "all_to_all_single")

    def all_to_all_single(self, *args: Any) -> Any:
        """torch's other name of `alltoall_base`."""
        return self.alltoall_base(*args)

    # ---------------------------------------------------------------- point-to-point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        """Sends ``tensors[0]`` to the group's rank ``dst`` (torch's ``send``/``isend``)."""
        if self._channel is None:
            return self._gloo_only("send").send(tensors, dst, tag)
        return point_to_point.send(self._engine, self._channel, tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        """Receives into ``tensors[0]`` from the group's rank ``src`` (torch's ``recv``/``irecv``)."""
        if self._channel is None:
            return self._gloo_only("recv").recv(tensors, src, tag)
        return point_to_point.receive(self._engine, self._channel, tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """Receives into ``tensors[0]`` from whichever member sends first with ``tag``
        (torch's ``recv`` without ``src``; the work's ``_source_rank`` says who)."""
        if self._channel is None:
            return self._gloo_only("recv").recv_anysource(tensors, tag)
        return point_to_point.receive(self._engine, self._channel, tensors, None, tag)


class _TlsProcessGroup(PhalanxProcessGroup):
    """The group under TLS: no device backend is registered (see the module doc), so it keeps
    the name torch gives it itself (torch stores a group's name in its backends)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._names = {"name": "", "desc": ""}

    def setGroupName(self, name: str) -> None:  # noqa: N802 (torch's C++ name)
        self._names["name"] = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._names["name"]

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._names["desc"] = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._names["desc"]


def _gloo_under(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """The plain gloo group under a phalanx group (its own keys in the group's store)."""
    return make_gloo_group(dist.PrefixStore("gloo/", store), rank, size, timeout)


def _default_group() -> Any:
    return dist.group.WORLD if dist.is_initialized() else None


def _create(options: Any, engine: Engine | None) -> Any:
    """torch's factory for ``"phalanx"`` groups (extended API: ``pg_options`` is the engine).

    The job's group is made with its engine (`WorkerGroup`); a ``new_group()`` without
    ``backend=`` is made without one, and gets a subgroup engine of the job's
    (`phalanx.communication.group.subgroups`): its collectives are signed as the job's are,
    and under TLS they go over a ring of its members.
    """
    store, rank, size, timeout = options.store, options.group_rank, options.group_size, options.timeout
    name = str(getattr(options, "group_id", "") or "")
    members = list(getattr(options, "global_ranks_in_group", None) or range(size))
    if engine is not None:
        kind = _TlsProcessGroup if engine.uses_tls else PhalanxProcessGroup
        return kind(store, rank, size, timeout, engine, group_name=name, members=members)
    default = _default_group()
    if not isinstance(default, PhalanxProcessGroup):  # no job of phalanx's: plain gloo, as torch's
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    gloo = _gloo_under(store, rank, size, timeout)
    sub = default.engine.subgroup(gloo, store, rank, size, members, timeout.total_seconds(), name)
    kind = _TlsProcessGroup if sub.uses_tls else PhalanxProcessGroup
    return kind(store, rank, size, timeout, sub, gloo, group_name=name, members=members)


def register_backend() -> None:
    """Registers ``"phalanx"`` with torch.distributed (idempotent; CPU tensors)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])
