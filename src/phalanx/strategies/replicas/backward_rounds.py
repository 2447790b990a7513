"""The in-process stage of the backward rounds: local replicas sum at the end of each pass.

See docs/architecture.md, "The optimizer step", and `phalanx.communication.engine.rounds` (the
round engine every strategy's gradient sum runs on: base/delta, the end-of-backward
callback, abort).

This module tracks the replica leaves of a strategy's distributed variables as the rounds'
slots (one slot per variable, the same on every replica and worker) and, at the end of a
replica's round, hands every slot's (base, delta) to ``merge``, which sums the deltas over
the replicas and sets ``.grad = base + sum``. The hooks act only while the strategy's
``run`` is active (``active``), so a backward pass outside ``run`` (replica 0's leaves are
the variables' cross-replica values under Mirrored) changes nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from phalanx.communication.engine.rounds import Round, Rounds
from phalanx.variables import DistributedVariable

__all__ = ["BackwardRounds", "Merge"]

_HOOKED = "_phalanx_round_hooks"  # attribute on a leaf: the rounds object that hooked it


# merge(index, leaves, bases, deltas): sums ``deltas`` over the replicas (None: no
# contribution) and installs ``base + sum`` as each leaf's gradient (replica ``index``).
Merge = Callable[[int, list[torch.Tensor], list[Any], list[Any]], None]


class BackwardRounds:
    """Hooks the replica leaves of a strategy's parameters and calls ``merge`` at the end of
    every backward pass made inside ``run`` (see module docstring).

    Args:
        num_replicas: The local replicas (one round state each).
        merge: Called at the end of every round that accumulated, on the thread autograd ran
            the pass's end on (the replica's own thread on CPU); it blocks until every local
            replica's round has ended.
        alive_anywhere: ``alive_anywhere(flags) -> flags``: given whether each slot's variable
            is alive here, whether it is alive on some worker (the identity in one process;
            across workers an all-reduce: all workers, blocks). Across workers the slots must
            stay the same whatever each garbage collector did, so a dead variable keeps its
            slot, as zeros of its shape, until it died on every worker; slots are forgotten
            when new variables are tracked (model after model in one process).
        syncing: Whether a pass opening now sums (False inside the strategy's ``no_sync()``:
            the pass only accumulates, `phalanx.communication.engine.rounds`).
    """

    def __init__(
        self,
        num_replicas: int,
        merge: Merge,
        alive_anywhere: Callable[[list[bool]], list[bool]],
        syncing: Callable[[], bool] = lambda: True,
    ) -> None:
        self._n = num_replicas
        self._merge = merge
        self._alive_anywhere = alive_anywhere
        self._vars: list[weakref.ref[DistributedVariable]] = []  # slot -> variable, creation order
        # slot -> its shape, dtype and replica devices, kept after it dies
        self._shapes: list[tuple[torch.Size, torch.dtype, list[torch.device]]] = []
        self._slot_of: dict[int, int] = {}  # id(variable) -> slot (check: ids of dead ones are reused)
        # slots whose every replica leaf is hooked: `track` skips them (leaves never change)
        self._complete: set[int] = set()
        self._rounds = Rounds(num_replicas, self._end_round, lambda: self.active, syncing=syncing)
        self._completed = [0] * num_replicas
        self.active = False

    def holds(self, index: int) -> bool:
        """Whether accumulate-only passes left replica ``index`` deltas not summed yet."""
        return self._rounds.holds(index)

    def completed(self, index: int) -> int:
        """How many rounds replica ``index`` has merged (the step compares it with its last)."""
        return self._completed[index]

    # ---------------------------------------------------------------- registration
    def track(self, variables: Iterable[DistributedVariable]) -> None:
        """Hooks the replica leaves of ``variables`` that need a gradient and are not hooked
        yet (called before each ``run``, with no backward pass running; every worker finds the
        same new variables, and agrees on the dead ones then)."""
        compacted = False
        complete = self._complete
        for var in variables:
            slot = self._slot_of.get(id(var))
            if slot is not None and slot in complete and self._vars[slot]() is var:
                continue
            if slot is None or self._vars[slot]() is not var:
                # The plain leaf's flag: reading the variable's would aggregate a sync-on-read
                # variable (a cross-worker all-reduce), and a variable that is dead but not yet
                # collected on one worker only would give the workers different collectives.
                if not var.primary.requires_grad:
                    continue  # picked up at a later run if it is unfrozen
                if not compacted:
                    self._compact()
                    compacted = True
                slot = self._add(var)
                complete = self._complete  # renumbered by a compaction
            if self._hook_leaves(var, slot):
                complete.add(slot)

    def _add(self, var: DistributedVariable) -> int:
        slot = len(self._vars)
        self._vars.append(weakref.ref(var))
        devices = [var.replica_leaf(i).device for i in range(self._n)]
        self._shapes.append((var.shape, var.dtype, devices))
        self._slot_of[id(var)] = slot
        return slot

    def _compact(self) -> None:
        """Forgets variables dead on every worker (slots are renumbered; no round is open here)."""
        anywhere = self._alive_anywhere([ref() is not None for ref in self._vars]) if self._vars else []
        keep = [k for k, here in enumerate(anywhere) if here]
        if len(keep) == len(self._vars):
            return
        kept = [self._vars[k] for k in keep]
        self._complete = {new for new, old in enumerate(keep) if old in self._complete}
        self._shapes = [self._shapes[k] for k in keep]
        self._vars = kept
        self._slot_of = {}
        for slot, var in enumerate(ref() for ref in kept):
            if var is None:  # died just now: left in place until the next compaction
                continue
            self._slot_of[id(var)] = slot
            for i in range(self._n):
                hooked = getattr(var.replica_leaf(i), _HOOKED, None)
                if hooked is not None and hooked[0] is self:
                    hooked[1][0] = slot

    def _hook_leaves(self, var: DistributedVariable, slot: int) -> bool:
        """Hooks the leaves not hooked yet; returns whether every leaf is hooked now (one
        that does not require a gradient yet is not: it is looked at again next run)."""
        complete = True
        for i in range(self._n):
            leaf = var.replica_leaf(i)
            hooked = getattr(leaf, _HOOKED, None)
            if hooked is not None and hooked[0] is self:
                continue
            if not leaf.requires_grad:
                complete = False
                continue
            cell = [slot]  # the leaf's slot; `_compact` renumbers it in place
            self._rounds.hook(leaf, i, cell)
            setattr(leaf, _HOOKED, (self, cell))
        return complete

    # ---------------------------------------------------------------- end of a round
    def _end_round(self, index: int, state: Round) -> None:
        """End of a replica's backward pass that accumulated: merge its deltas."""
        leaves, bases, deltas = [], [], []
        for slot, leaf in enumerate(self._leaves(index)):
            leaves.append(leaf)
            if slot in state.accumulated:
                bases.append(state.bases.get(slot))
                deltas.append(leaf.grad)
            else:  # not reached (or only read by autograd.grad): no contribution
                if slot in state.bases:
                    leaf.grad = state.bases[slot]
                bases.append(leaf.grad)
                deltas.append(None)
        self._merge(index, leaves, bases, deltas)
        self._completed[index] += 1

    def _leaves(self, index: int) -> list[torch.Tensor]:
        # A dead variable keeps its slot: zeros of its shape (no memory: an expanded scalar)
        # that need no gradient, so the merge installs none.
        leaves = []
        for ref, (shape, dtype, devices) in zip(self._vars, self._shapes, strict=True):
            var = ref()
            leaves.append(_zeros(shape, dtype, devices[index]) if var is None else var.replica_leaf(index))
        return leaves

    def abort(self) -> None:
        """Ends the rounds left open by a backward pass that raised (its end-of-backward
        callback never ran): every moved-aside gradient goes back (after ``run``)."""
        self._rounds.abort()


def _zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)
