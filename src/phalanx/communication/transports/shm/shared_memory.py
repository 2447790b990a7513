"""Same-machine collectives through shared memory: the fast path between workers on one host.

gloo moves every byte through the loopback TCP stack, copying it through the kernel on both
sides. Workers on the same machine can instead write their tensors into a shared-memory
segment (``/dev/shm``) and each sum the others' slots directly, as NCCL's SHM transport does
between the GPUs of one node. On the 2-core CI machine this makes a 7 MB gradient all-reduce
about 8x faster than gloo (``benchmarks/bench_multiworker.py``).

Protocol, for the i-th all-reduce (every worker runs them in the same order, on one thread):

1. copy the tensor into this worker's slot of buffer set ``i % 2`` of the segment for its size;
2. publish ``i + 1`` in this worker's cell of the control block;
3. wait until every worker's cell is >= ``i + 1`` (every slot is written);
4. sum the slots in rank order into the tensor: every worker computes bit-identical sums.

With more than two workers, a core for each, and a chunk of at least `TWO_SHOT_ELEMENTS`,
step 4 is two-shot
(reduce-scatter, then all-gather, as NCCL does for large messages): worker r sums only
segment r (``tensor_split``'s r-th) of every slot, in rank order, into its tensor and its own
slot's segment r, publishes that in its second cell, waits for every worker's second cell,
then copies the other segments from their owners' slots. Each worker reads about 2x the
chunk instead of (workers + 1)x, with the same additions in the same order: the same bits.
The second meeting is cheap only when every worker runs on its own core: with more workers
than cores (4 on 2 cores) it cost more than it saved (4 MiB: 1.4 -> 2.0 ms), so two-shot is
used where every worker's process may run on at least ``workers`` cores (agreed by all);
``PHALANX_SHM_TWO_SHOT=1`` or ``0`` forces it on or off.

Broadcasts, all-gathers and reduce-scatters use the same meeting: the source (broadcast) or
every worker writes its slot, publishes, waits; then a broadcast copies the source's slot, an
all-gather every slot, and a reduce-scatter (each worker's slot holds one part per worker)
sums only this worker's part of every slot, in rank order. FSDP2's per-layer all-gathers and
reduce-scatters on the ``"phalanx"`` process group take this path: no copy through the loopback
stack, and no gloo work holding a gathered layer after it is used.

A worker writes set ``i % 2`` again only at call ``i + 2``, after every worker published
``i + 1``, that is after every worker finished reading set ``i % 2`` in call ``i``: one
meeting per call (two when two-shot; a worker reads its peers' sums only in call ``i`` too).
Tensors larger than a slot go through in chunks: an all-reduce's slot holds up to
`CHUNK_ELEMENTS` (its sum is the chunk), a broadcast's, an all-gather's and a
reduce-scatter's up to `SET_ELEMENTS` / workers, so that their segment (2 sets of every
worker's slot, all of which every worker maps and reads) stays at 2 x 8 MiB of float32
whatever the number of workers (2 workers: all-reduce's 4 MiB slots). FullyShardedStrategy
moves every layer through all-gathers and reduce-scatters each step: with all-reduce's slots
its workers would each map 2 x W x 4 MiB (32 MiB at 4 workers) for what 16 MiB carries in
twice the meetings (docs/big_models.md).

Segments are files in ``/dev/shm`` named after the job, created by every worker with
``posix_fallocate`` (a full ``/dev/shm`` is an error, never a SIGBUS), checked to be shared
(markers every worker must see), agreed on with one gloo all-reduce, then unlinked: nothing is
left behind, even after a crash. A segment that cannot be made on every worker makes that
size go through gloo instead.

Every call runs on the transport's thread, in order; a gradient bucket's all-reduce (its
caller may block: `all_reduce_async`'s ``may_block``) runs on the calling thread instead when
that thread is idle and this machine has no core to spare for it: when the workers on it times
torch's intra-op threads fill its cores. There the thread overlapped nothing (two workers of one
thread on two cores: the sum competed with the next layer's backward for the same cores) and
cost a hand-off each way: MLP 784-1024-1024-10 on 2 cores, the engine's step 1.26-1.31x ->
1.34-1.37x DDP's (`benchmarks/bench_multiworker.py`). With cores to spare it overlaps backward.

Waiting (step 3) sleeps on a futex of the peer's control cell until the peer publishes, and
every ``CHECK_SECONDS`` (50 ms) checks that the peer processes still exist (a SIGKILLed worker is named
within that time), the group's health check and the deadline (`_shm_control.ControlBlock`).
Control cells are int64 written after the slot; x86-64 keeps stores in order, so this
transport is only used there (elsewhere, gloo).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx import settings
from phalanx.communication.checks.collective_check import UNCHECKED, Signed
from phalanx.communication.group.work import Lane, PeerGoneError, QueuedWork
from phalanx.communication.transports.gloo.signed import (
    Mismatch,
    signed_all_gather,
    signed_all_reduce,
    signed_broadcast,
)
from phalanx.communication.transports.shm.control import CALLS, SUMS, ControlBlock
from phalanx.communication.transports.shm.control import alive as _alive  # noqa: F401 (tests reach it here)
from phalanx.communication.transports.shm.same_machine import (  # noqa: F401 (re-exported: the transport's switch)
    SHARED_MEMORY_ENV,
    SHM_DIR,
    _pid_namespace,
    probe_machines,
    same_machine_pids,
    shared_memory_supported,
)

__all__ = [
    "CHUNK_ELEMENTS",
    "SET_ELEMENTS",
    "SHARED_MEMORY_ENV",
    "TWO_SHOT_ELEMENTS",
    "SharedMemoryAllReduce",
    "probe_machines",
    "same_machine_pids",
    "shared_memory_supported",
]

CHUNK_ELEMENTS = 1 << 20  # all-reduce: 4 MiB of float32 per slot at most (a 16 MiB segment for 2 workers)
SET_ELEMENTS = 1 << 21  # broadcast, all-gather, reduce-scatter: one set of slots, every worker's together
TWO_SHOT_ELEMENTS = 1 << 18  # from 1 MiB of float32, with 3 or more workers
TWO_SHOT_ENV = "PHALANX_SHM_TWO_SHOT"
MIN_CAPACITY = 1 << 10
_DIR = SHM_DIR
_MARKER = -7_000_000
_OPS: dict[Any, Callable[..., torch.Tensor]] = {
    dist.ReduceOp.SUM: torch.add,
    dist.ReduceOp.MAX: torch.maximum,
    dist.ReduceOp.MIN: torch.minimum,
}


def part_elements(world: int) -> int:
    """Elements of one worker's slot for a broadcast, an all-gather or a reduce-scatter:
    `SET_ELEMENTS` shared by the workers, rounded down to a power of two (a segment's size)."""
    share = max(MIN_CAPACITY, SET_ELEMENTS // world)
    return 1 << (share.bit_length() - 1)


def _wants_two_shot(world: int) -> bool:
    """This worker's view: force (``PHALANX_SHM_TWO_SHOT``), else whether it has a core per worker."""
    forced = settings.current().shm_two_shot
    if forced is not None:
        return forced
    return world > 2 and len(os.sched_getaffinity(0)) >= world


class _Segment:
    """A mapped file of ``sets x world x capacity`` elements (or the control block)."""

    def __init__(self, path: str, numel: int, dtype: torch.dtype) -> None:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC here, not SIGBUS at first touch
        finally:
            os.close(fd)
        self.path = path
        self.tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype)


class SharedMemoryAllReduce:
    """All-reduces CPU tensors between workers of one machine through ``/dev/shm``.

    Every call is queued to one thread, which runs them in order; all workers queue the same
    calls in the same order (as for any collective).

    Args:
        token: A name shared by the workers and unique to this job on the machine.
        rank, world_size: This worker and the number of workers (all on this machine).
        pids: Every worker's process id, by rank.
        group: A gloo process group of the same workers, used by this transport's thread only:
            to agree on each new segment, and for sizes shared memory could not be made for.
        failure: The group's verdict on its peers (heartbeats), None while healthy.
        name: ``name(rank) -> "worker:1"`` for messages.
        timeout: Seconds one call may wait for the others.
        keep: Called with every work this transport starts on ``group`` (see
            `phalanx.communication.group.worker_group.RecentWorks`); returns it.
        mismatch: ``mismatch(signed, peer)``: the error of a collective whose code differs
            from a peer's (`CollectiveCheck.mismatch`).
    """

    def __init__(
        self,
        token: str,
        rank: int,
        world_size: int,
        pids: list[int],
        group: Any,
        failure: Callable[[], str | None],
        name: Callable[[int], str],
        timeout: float,
        keep: Callable[[Any], Any] = lambda work: work,
        mismatch: Mismatch | None = None,
    ) -> None:
        if world_size < 2:
            raise ValueError(f"A shared-memory all-reduce needs at least 2 workers. Received: {world_size}.")
        self._token, self._rank, self._world = token, rank, world_size
        self._pids, self._group, self._failure_of_group = pids, group, failure
        self._name, self._timeout, self._keep = name, timeout, keep
        self._control: ControlBlock | None = None
        self._shared: bool | None = None  # None until the control block was agreed on
        self._use_two_shot = False  # agreed with the control block
        self._segments: dict[tuple[torch.dtype, int], _Segment | None] = {}
        self._paths: list[str] = []
        self._calls = 0
        self._part = part_elements(world_size)  # a slot of the collectives that move parts
        self._mismatch = mismatch or _differ
        self._closing = threading.Event()
        self._lane = Lane("phalanx-shm-allreduce")  # every call, in order, on one thread
        self._cores = len(os.sched_getaffinity(0))

    @staticmethod
    def handles(tensor: torch.Tensor, op: Any) -> bool:
        """Whether this transport takes ``tensor`` (a contiguous CPU tensor; SUM, MAX or MIN)."""
        return tensor.device.type == "cpu" and tensor.is_contiguous() and op in _OPS and not tensor.is_sparse

    def all_reduce_async(
        self,
        tensor: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        signed: Signed = UNCHECKED,
        may_block: bool = False,
    ) -> QueuedWork:
        """Queues an in-place all-reduce of ``tensor`` and returns its work (all workers).
        ``signed``: its code, compared with every peer's before the sum (`CollectiveCheck`).
        ``may_block``: the caller issues nothing another worker waits for before this ends
        (the gradient buckets), so it may run here, on the calling thread, where the machine
        has no core to spare (see the module doc)."""
        if not self.handles(tensor, op):  # verified here, carried by the gloo group
            return self._lane.submit(
                "shared-memory all_reduce", lambda: self._gloo_after_meeting(tensor, op, signed)
            )
        here = may_block and self._world * torch.get_num_threads() >= self._cores
        return self._lane.submit(
            "shared-memory all_reduce", lambda: self._all_reduce(tensor, op, signed), here=here
        )

    def broadcast_async(self, tensor: torch.Tensor, src: int, signed: Signed = UNCHECKED) -> QueuedWork:
        """Queues an in-place broadcast from ``src`` through the segments (all workers, in order
        with the all-reduces)."""
        return self._lane.submit("shared-memory broadcast", lambda: self._broadcast(tensor, src, signed))

    def all_gather_async(
        self, tensor: torch.Tensor, signed: Signed = UNCHECKED, out: list[torch.Tensor] | None = None
    ) -> tuple[QueuedWork, list[torch.Tensor]]:
        """Queues gathering every worker's tensor through the segments (as `all_reduce_async`):
        the work and the list it fills, in rank order (``out``: contiguous tensors of
        ``tensor``'s size and dtype to fill, one per worker; default new ones)."""
        if out is None:
            out = [torch.empty_like(tensor) for _ in range(self._world)]
        return self._lane.submit(
            "shared-memory all_gather", lambda: self._all_gather(tensor, out, signed)
        ), out

    def reduce_scatter_async(
        self,
        tensor: torch.Tensor,
        output: torch.Tensor,
        op: Any = dist.ReduceOp.SUM,
        signed: Signed = UNCHECKED,
    ) -> QueuedWork:
        """Queues a reduce-scatter: ``tensor`` holds one part per worker laid end to end (each
        of ``output``'s size); this worker's part of the sum over the workers goes into
        ``output``. Each worker reads only its part of every peer's slot."""
        if not self.handles(tensor, op) or not output.is_contiguous():
            raise ValueError(
                f"A shared-memory reduce-scatter takes contiguous CPU tensors and SUM, MAX or MIN. "
                f"Received: {tensor.dtype} {tuple(tensor.shape)}, op {op}."
            )
        return self._lane.submit(
            "shared-memory reduce_scatter", lambda: self._reduce_scatter(tensor, output, op, signed)
        )

    # ---------------------------------------------------------------- the transport's thread
    def _gloo_after_meeting(self, tensor: torch.Tensor, op: Any, signed: Signed) -> None:
        if not self._ensure_control():
            signed_all_reduce(self._group, self._rank, self._world, tensor, op, signed, self._mismatch)
            return
        self._meet(signed)
        self._gloo_all_reduce(tensor, op)

    def _broadcast(self, tensor: torch.Tensor, src: int, signed: Signed) -> None:
        if not self._ensure_control():
            signed_broadcast(self._group, self._rank, self._world, tensor, src, signed, self._mismatch)
            return
        flat = tensor.view(-1)
        if flat.numel() == 0:
            self._meet(signed)
        for start in range(0, flat.numel(), self._part):
            chunk = flat[start : start + self._part]
            rows = self._exchange(chunk, signed, write=self._rank == src)
            if rows is None:  # no segment of this size: the gloo group carries it
                options = dist.BroadcastOptions()
                options.rootRank = src
                self._keep(self._group.broadcast([chunk], options)).wait()
            elif self._rank != src:
                chunk.copy_(rows[src, : chunk.numel()])

    def _all_gather(self, tensor: torch.Tensor, out: list[torch.Tensor], signed: Signed) -> None:
        if not self._ensure_control():
            signed_all_gather(self._group, self._rank, self._world, tensor, out, signed, self._mismatch)
            return
        flat, targets = tensor.reshape(-1), [o.view(-1) for o in out]
        if flat.numel() == 0:
            self._meet(signed)
        for start in range(0, flat.numel(), self._part):
            chunk = flat[start : start + self._part]
            n = chunk.numel()
            pieces = [t[start : start + n] for t in targets]
            rows = self._exchange(chunk, signed)
            if rows is None:
                self._keep(self._group.allgather([pieces], [chunk])).wait()
                continue
            for k, piece in enumerate(pieces):
                piece.copy_(chunk if k == self._rank else rows[k, :n])

    def _reduce_scatter(self, tensor: torch.Tensor, output: torch.Tensor, op: Any, signed: Signed) -> None:
        parts = tensor.view(self._world, -1)  # row k: worker k's part
        mine = output.view(-1)
        if not self._ensure_control():
            staged = tensor.reshape(-1).clone()
            signed_all_reduce(self._group, self._rank, self._world, staged, op, signed, self._mismatch)
            mine.copy_(staged.view(self._world, -1)[self._rank])
            return
        m = parts.shape[1]
        if m == 0:
            self._meet(signed)
        step = max(1, self._part // self._world)  # (world, step) fills one slot
        combine = _OPS[op]
        for start in range(0, m, step):
            columns = parts[:, start : start + step]  # (world, width): one chunk of every part
            width = columns.shape[1]
            rows = self._exchange(columns, signed)
            out = mine[start : start + width]
            if rows is None:
                staged = columns.contiguous()
                self._gloo_all_reduce(staged, op)
                out.copy_(staged[self._rank])
                continue
            segment = slice(self._rank * width, (self._rank + 1) * width)
            combine(rows[0, segment], rows[1, segment], out=out)
            for k in range(2, self._world):
                combine(out, rows[k, segment], out=out)

    def _all_reduce(self, tensor: torch.Tensor, op: Any, signed: Signed) -> None:
        flat = tensor.view(-1)
        if not self._ensure_control():
            signed_all_reduce(self._group, self._rank, self._world, flat, op, signed, self._mismatch)
            return
        if flat.numel() == 0:  # still met: the peers' collective may not be empty
            self._meet(signed)
            return
        for start in range(0, flat.numel(), CHUNK_ELEMENTS):
            chunk = flat[start : start + CHUNK_ELEMENTS]
            rows = self._exchange(chunk, signed)
            if rows is None:
                self._gloo_all_reduce(chunk, op)
            else:
                self._reduce_chunk(chunk, rows, op)

    # ---------------------------------------------------------------- meetings (control block)
    def _meet(self, signed: Signed) -> None:
        """A call without data: every worker publishes it, waits for the others, and compares
        codes (before a collective the gloo group carries, or an empty one)."""
        assert self._control is not None
        self._control.announce(self._calls + 1, signed)
        self._calls += 1
        self._control.publish(CALLS, self._calls)
        self._control.wait_for(CALLS, self._calls, signed)

    def _exchange(self, chunk: torch.Tensor, signed: Signed, write: bool = True) -> torch.Tensor | None:
        """One meeting through the segment for ``chunk``'s size: writes ``chunk`` (any shape,
        laid end to end) into this worker's slot unless ``write`` is False, publishes the call,
        waits for every peer's and compares the codes. Returns the call's ``(world, capacity)``
        slots, which peers leave alone until this worker's next call; None when no segment of
        that size could be made (the peers met, the caller carries the data by gloo)."""
        assert self._control is not None
        self._control.announce(self._calls + 1, signed)
        n = chunk.numel()
        slots = self._slots(chunk.dtype, n, signed)
        if slots is None:
            self._meet(signed)
            return None
        rows = slots[self._calls % 2]
        if write:
            rows[self._rank, :n].view_as(chunk).copy_(chunk)
        self._calls += 1
        self._control.publish(CALLS, self._calls)  # after the slot: x86-64 keeps stores in order
        self._control.wait_for(CALLS, self._calls, signed)
        return rows

    def _reduce_chunk(self, chunk: torch.Tensor, rows: torch.Tensor, op: Any) -> None:
        """Step 4 of the all-reduce: the slots summed in rank order into ``chunk``."""
        n = chunk.numel()
        combine = _OPS[op]
        if self._use_two_shot and self._world > 2 and n >= TWO_SHOT_ELEMENTS:
            self._two_shot(chunk, rows[:, :n], combine)
            return
        if self._world == 2:  # chunk holds this worker's slot; a + b == b + a, bit for bit
            combine(chunk, rows[1 - self._rank, :n], out=chunk)  # one buffer fewer to read
            return
        combine(rows[0, :n], rows[1, :n], out=chunk)
        for k in range(2, self._world):
            combine(chunk, rows[k, :n], out=chunk)

    def _two_shot(
        self, chunk: torch.Tensor, rows: torch.Tensor, combine: Callable[..., torch.Tensor]
    ) -> None:
        """Step 4 for large chunks: sum this worker's segment, publish it, gather the others."""
        assert self._control is not None
        q, r = divmod(chunk.numel(), self._world)  # tensor_split's segments
        segments = [(k * q + min(k, r), q + (1 if k < r else 0)) for k in range(self._world)]
        start, length = segments[self._rank]
        own = chunk.narrow(0, start, length)
        combine(rows[0].narrow(0, start, length), rows[1].narrow(0, start, length), out=own)
        for k in range(2, self._world):
            combine(own, rows[k].narrow(0, start, length), out=own)
        rows[self._rank].narrow(0, start, length).copy_(own)  # only this worker reads segment r
        self._control.publish(SUMS, self._calls)  # after the sum, as the call cell after the slot
        self._control.wait_for(SUMS, self._calls)
        for k, (first, size) in enumerate(segments):
            if k != self._rank:
                chunk.narrow(0, first, size).copy_(rows[k].narrow(0, first, size))

    # ---------------------------------------------------------------- segments (transport thread)
    def _path(self, what: str) -> str:
        return os.path.join(_DIR, f"phalanx-{self._token}-{what}")

    def _ensure_control(self) -> bool:
        """Makes the control block on first use; False if this machine's workers cannot share
        memory (every worker reaches the same answer)."""
        if self._shared is not None:
            return self._shared
        ok = 1
        segment = None
        try:
            segment = _Segment(self._path("control"), 3 * self._world, torch.int64)  # see ControlBlock
            self._paths.append(segment.path)
            segment.tensor[self._rank] = _MARKER - self._rank
        except OSError:
            ok = 0
        self._agree(1)  # every worker wrote its marker
        if ok and segment is not None:
            cells = segment.tensor
            ok = int(all(int(cells[r]) == _MARKER - r for r in range(self._world)))
        self._shared = self._agree(ok)
        self._use_two_shot = self._agree(int(_wants_two_shot(self._world)))
        if segment is not None:
            self._control = ControlBlock(
                segment.tensor,
                self._rank,
                self._world,
                self._pids,
                self._name,
                self._timeout,
                self._failure_of_group,
                self._closing,
                self._mismatch,
            )
            self._control.clear()  # nobody reads a cell before the next meeting
        self._unlink_if_chief(self._path("control"))
        return self._shared

    def _slots(self, dtype: torch.dtype, numel: int, signed: Signed = UNCHECKED) -> torch.Tensor | None:
        capacity = max(MIN_CAPACITY, 1 << (numel - 1).bit_length())
        key = (dtype, capacity)
        if key not in self._segments:
            if self._control is not None:  # the gloo agreement below must meet the same call
                self._control.wait_announced(signed, self._calls + 1)
            path = self._path(f"{str(dtype).removeprefix('torch.')}-{capacity}")
            segment: _Segment | None
            try:
                segment = _Segment(path, 2 * self._world * capacity, dtype)
                self._paths.append(path)
            except OSError:
                segment = None
            if not self._agree(int(segment is not None)):
                segment = None
            self._unlink_if_chief(path)
            self._segments[key] = segment
        segment = self._segments[key]
        return None if segment is None else segment.tensor.view(2, self._world, capacity)

    def _agree(self, ok: int) -> bool:
        flag = torch.tensor([ok], dtype=torch.int64)
        self._gloo_all_reduce(flag, dist.ReduceOp.MIN)
        return bool(flag.item())

    def _gloo_all_reduce(self, tensor: torch.Tensor, op: Any) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._keep(self._group.allreduce([tensor], options)).wait()

    def _unlink_if_chief(self, path: str) -> None:
        if self._rank == 0:  # every worker has it mapped (or gave up on it): the name can go
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        """Stops the thread (a call still waiting fails) and removes any file left behind."""
        self._closing.set()
        self._lane.close()
        if not self._lane.alive:
            self._group = None  # its owner may now tear the group down
        for path in self._paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _differ(signed: Signed, peer: int | None) -> BaseException:
    """The error of a mismatch when no `CollectiveCheck` reports it (tests of the transport)."""
    return PeerGoneError(f"collective #{signed.seq}: worker {peer} called another collective")
