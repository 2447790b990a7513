"""PowerSGD (Vogels, Karimireddy and Jaggi, 2019): low-rank gradient all-reduce with error feedback.

For each gradient matrix ``M`` of a bucket (a parameter of two or more dimensions, seen as
``(shape[0], -1)``), with ``n`` workers and rank ``r`` (all workers, same order):

1. error feedback: ``M += e`` (what the last rounds' approximations left out on this worker);
2. ``P = M Q`` with ``Q`` (``(m, r)``) the last round's (warm start) or, the first time, drawn
   from a generator seeded alike on every worker; all-reduce the ``P``s (``(rows, r)``);
3. orthonormalise the summed ``P`` (a reduced QR); ``Q = M^T P``; all-reduce the ``Q``s;
4. the bucket gets ``P Q^T``: the rank-``r`` approximation of the *sum* of the workers' ``M``
   (the engine sums; it does not average), and ``e = M - P Q^T / n`` is kept for next round.

The ``P`` all-reduce carries, beside the ``P``s, the bucket's tensors that are not worth
compressing (vectors, and matrices where ``r (rows + cols) * min_compression_rate`` is not
below ``rows * cols``) uncompressed, as torch's hook does in a separate one. Error feedback is
kept for the compressed matrices only: the others' sums are exact. The first
``start_iteration`` rounds are plain all-reduces (torch's ``start_powerSGD_iter``).

Each bucket's ``P``s are computed when autograd completes it (during the backward pass), but
the all-reduces go once per pass for all buckets: one of every ``P`` (and rest), then one of
every ``Q``, at the end of the pass. The messages are small, so what they cost is round trips
and the collective check's per-message gate, not bytes: two per pass beat two per bucket
(torch's hook sends two per DDP bucket).

torch's ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` is the reference (DDP
averages where this sums; it keeps error feedback for the whole bucket; it orthogonalises by
Gram-Schmidt where this uses QR, which needs no epsilon for a rank-deficient ``P``).

State and its life: error feedback and warm-start ``Q``s are per worker and per bucket, in the
compressor. They are not saved in checkpoints (they differ on every worker, and a checkpoint
holds what every worker agrees on); a checkpoint restore resets them on every worker (they
belong to the trajectory that produced them, not to the restored weights), and so does a
rebuild of the buckets. An elastic re-form makes a new gradient engine, so a new compressor:
error feedback and ``Q``s start empty and the ``start_iteration`` plain rounds run again.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from phalanx.communication.compression.base import WHAT, Launch, PlainAllReduce, Started, Wait

__all__ = ["PowerSGD", "PowerSGDCompressor"]

_WIDE = (torch.float32, torch.float64)


@dataclass(frozen=True)
class PowerSGD:
    """Ask for PowerSGD compression: ``CommunicationOptions(compression=PowerSGD(rank=2))``.

    Args:
        rank: The rank ``r`` of the approximation of each gradient matrix (>= 1). Traffic per
            ``(rows, cols)`` matrix: ``r * (rows + cols)`` elements instead of ``rows * cols``.
        start_iteration: Backward passes all-reduced uncompressed first (>= 0); torch's
            ``start_powerSGD_iter``, whose default is 1,000 (Vogels et al. compress from the
            start; a warm-up helps when early gradients change fast).
        error_feedback: Carry what each approximation left out into the next round (the
            paper's error feedback; without it PowerSGD converges worse).
        warm_start: Start each round's power iteration from the last round's ``Q``.
        min_compression_rate: Compress a matrix only where it shrinks at least this many times.
        seed: Seeds the first ``Q``s (the same on every worker).

    Raises:
        ValueError: ``rank`` < 1, ``start_iteration`` < 0 or ``min_compression_rate`` < 1.
    """

    rank: int = 1
    start_iteration: int = 10
    error_feedback: bool = True
    warm_start: bool = True
    min_compression_rate: float = 2.0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(
                f"PowerSGD rank must be an integer >= 1. Received: rank={self.rank!r}. HINT: rank=1 "
                "or 2 compresses most; raise it if accuracy suffers."
            )
        if (
            isinstance(self.start_iteration, bool)
            or not isinstance(self.start_iteration, int)
            or self.start_iteration < 0
        ):
            raise ValueError(
                f"PowerSGD start_iteration must be an integer >= 0. Received: {self.start_iteration!r}."
            )
        if not self.min_compression_rate >= 1:
            raise ValueError(
                f"PowerSGD min_compression_rate must be >= 1. Received: {self.min_compression_rate!r}."
            )


@dataclass
class _Memory:
    """One bucket's state on this worker: each compressed matrix's error and ``Q``."""

    errors: dict[int, torch.Tensor] = field(default_factory=dict)
    qs: dict[int, torch.Tensor] = field(default_factory=dict)


class PowerSGDCompressor:
    """The state of `PowerSGD` for one gradient engine (see the module docstring).

    Args:
        config: What the user asked for.
        workers: How many workers sum (the error is this worker's part of the residual).
    """

    predictable = False  # a pass's all-reduces depend on which matrices compress: not announced

    def __init__(self, config: PowerSGD, workers: int) -> None:
        self.config, self._workers = config, workers
        self.rounds = 0
        self._memory: dict[Hashable, _Memory] = {}
        self._generator = torch.Generator().manual_seed(config.seed)
        self._open: dict[torch.dtype, _Batch] = {}  # this pass's batch per dtype, until it runs

    def applies(self, dtype: torch.dtype) -> bool:
        return dtype in _WIDE

    def wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return dtype  # its all-reduces are not announced (`predictable` is False)

    def begin_round(self) -> None:
        self.rounds += 1
        self._open = {}

    def reset(self) -> None:
        """Forgets error feedback and warm starts (all workers at the same point)."""
        self._memory = {}
        self._open = {}
        self._generator = torch.Generator().manual_seed(self.config.seed)

    def memory(self, key: Hashable) -> _Memory | None:
        """Bucket ``key``'s error feedback and ``Q``s (None before its first compressed round)."""
        return self._memory.get(key)

    def _compressed(self, view: torch.Tensor) -> bool:
        if view.dim() < 2:
            return False
        rows, cols = view.shape[0], view.numel() // max(view.shape[0], 1)
        r = min(self.config.rank, rows, cols)
        return r * (rows + cols) * self.config.min_compression_rate < rows * cols

    def start(
        self, key: Hashable, flat: torch.Tensor, views: Sequence[torch.Tensor], launch: Launch
    ) -> Started:
        matrices = {j: v.reshape(v.shape[0], -1) for j, v in enumerate(views) if self._compressed(v)}
        if self.rounds <= self.config.start_iteration or not matrices:
            return PlainAllReduce(launch(flat))
        memory = self._memory.setdefault(key, _Memory())
        member = _Member(memory, matrices, [v for j, v in enumerate(views) if j not in matrices])
        for j, m in matrices.items():
            if self.config.error_feedback:  # (rows, cols): this worker's M with its error, apart
                error = memory.errors.get(j)
                m = member.inputs[j] = m + error if error is not None else m.clone()
            else:
                member.inputs[j] = m
            q = memory.qs.get(j) if self.config.warm_start else None
            if q is None:
                r = min(self.config.rank, *m.shape)
                q = torch.randn(m.shape[1], r, generator=self._generator, dtype=torch.float64).to(
                    m.device, m.dtype
                )
            memory.qs[j] = q  # (cols, r)
            member.ps.append(m @ q)  # (rows, r)
        batch = self._open.get(flat.dtype)
        if batch is None or batch.done:
            batch = self._open[flat.dtype] = _Batch(self._workers, launch, self.config.error_feedback)
        batch.members.append(member)
        return _InBatch(batch)


@dataclass
class _Member:
    """One bucket's part of a pass's batch: its matrices (where the sums go), the rest, its
    ``P``s and what they were computed from."""

    memory: _Memory
    matrices: dict[int, torch.Tensor]
    rest: list[torch.Tensor]
    ps: list[torch.Tensor] = field(default_factory=list)
    inputs: dict[int, torch.Tensor] = field(default_factory=dict)  # M + e (M without error feedback)


class _Batch:
    """A pass's compressed buckets of one dtype: two all-reduces for all of them, the ``P``s
    (with the uncompressed rest), then the ``Q``s. Started by the first bucket's ``finish``, at
    the end of the backward pass (all workers, same point): PowerSGD's messages are small, so
    what they cost is round trips, not bytes, and two per pass beat two per bucket."""

    def __init__(self, workers: int, launch: Launch, error_feedback: bool) -> None:
        self._workers, self._launch, self._error_feedback = workers, launch, error_feedback
        self.members: list[_Member] = []
        self.done = False

    def run(self, wait: Wait) -> None:
        if self.done:
            return
        self.done = True
        members = self.members
        first = torch.cat([t.reshape(-1) for m in members for t in (*m.rest, *m.ps)])
        wait(self._launch(first), WHAT)  # (sum of rest numel + sum of rows * r,)
        at = 0
        ps: list[list[torch.Tensor]] = []
        qs: list[torch.Tensor] = []
        for member in members:
            for v in member.rest:  # exact sums
                v.copy_(first[at : at + v.numel()].view_as(v))
                at += v.numel()
            mine = []
            for m, p in zip(member.inputs.values(), member.ps, strict=True):
                p = first[at : at + p.numel()].view_as(p)  # the summed P
                at += p.numel()
                p = torch.linalg.qr(p, mode="reduced").Q  # (rows, r), orthonormal columns
                mine.append(p)
                # (cols, r): this worker's M^T P, as (P^T M)^T: CPU kernels take a transposed
                # left operand ~30x slower for a thin right one
                qs.append((p.t() @ m).t())
            ps.append(mine)
        second = torch.cat([q.reshape(-1) for q in qs])
        wait(self._launch(second), WHAT)
        at = 0
        for member, mine in zip(members, ps, strict=True):
            for (j, m), p in zip(member.matrices.items(), mine, strict=True):
                q = second[at : at + m.shape[1] * p.shape[1]].view(m.shape[1], p.shape[1])  # summed Q
                at += q.numel()
                torch.matmul(p, q.t(), out=m)  # rank-r approximation of the sum over workers
                if self._error_feedback:
                    member.memory.errors[j] = member.inputs[j].sub_(m, alpha=1.0 / self._workers)
                member.memory.qs[j] = q / self._workers


class _InBatch:
    """One bucket's handle on its batch: the first ``finish`` of a pass runs the batch."""

    def __init__(self, batch: _Batch) -> None:
        self._batch = batch

    def finish(self, wait: Wait) -> None:
        self._batch.run(wait)
