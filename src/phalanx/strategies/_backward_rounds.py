"""Backward rounds: the end of each backward pass is where in-process replicas sum gradients.

See docs/architecture.md, "The optimizer step".

DDP's contract, which phalanx keeps under every synchronous strategy: once ``backward()`` has
returned, every replica's ``.grad`` holds the summed gradient, so reads and in-place edits
between backward and ``optimizer.step()`` (clipping, unscaling, logging) act on the sum and
the step applies what ``.grad`` holds.

One backward pass of one replica is one *round*. Two tensor hooks on every replica leaf of
the strategy's parameters drive it:

* the pre-hook (before autograd accumulates into ``.grad``), at a leaf's first visit in the
  round, moves the leaf's current ``.grad`` aside as its *base* (``.grad`` becomes None, so
  autograd writes this pass's contribution, the *delta*, into a fresh tensor), and at the
  round's first visit queues an end-of-backward callback in autograd's engine (as DDP does);
* the post-accumulate hook records that the leaf really accumulated (``torch.autograd.grad``
  fires pre-hooks but accumulates nothing).

At the end of the pass the callback hands every tracked leaf's (base, delta) to ``merge``,
which sums the deltas over the replicas and sets ``.grad = base + sum``. Summing deltas, not
whole gradients, keeps gradient accumulation right: two backward passes before one step give
``sum(d1) + sum(d2)``, not the first sum counted once per replica. A round that accumulated
nothing (``torch.autograd.grad`` only) puts the bases back and meets nobody; replicas run the
same program, so all of them decide alike.

The hooks act only while the strategy's ``run`` is active (``active``), so a backward pass
outside ``run`` (replica 0's leaves are the variables' cross-replica values under Mirrored)
changes nothing.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from phalanx.variables import DistributedVariable

__all__ = ["BackwardRounds", "Merge"]

_HOOKED = "_phalanx_round_hooks"  # attribute on a leaf: the rounds object that hooked it


class _Round:
    """One replica's state during one backward pass."""

    __slots__ = ("accumulated", "bases", "open")

    def __init__(self) -> None:
        self.open = False
        self.bases: dict[int, torch.Tensor | None] = {}  # slot -> the .grad moved aside
        self.accumulated: set[int] = set()  # slots whose leaf accumulated this round


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
    """

    def __init__(
        self, num_replicas: int, merge: Merge, alive_anywhere: Callable[[list[bool]], list[bool]]
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
        self._rounds = [_Round() for _ in range(num_replicas)]
        self._completed = [0] * num_replicas
        self.active = False

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
                if not var.requires_grad:
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
            ref = weakref.ref(leaf)
            leaf.register_hook(functools.partial(self._before_accumulate, cell, i, ref))
            leaf.register_post_accumulate_grad_hook(functools.partial(self._after_accumulate, cell, i))
            setattr(leaf, _HOOKED, (self, cell))
        return complete

    # ---------------------------------------------------------------- during backward
    def _before_accumulate(
        self, cell: list[int], index: int, ref: weakref.ref[torch.Tensor], grad: torch.Tensor
    ) -> None:
        if not self.active:
            return
        state = self._rounds[index]
        if not state.open:
            state.open = True
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._end_round, index)
            )
        slot = cell[0]
        if slot not in state.bases:
            leaf = ref()
            if leaf is not None:
                state.bases[slot] = leaf.grad
                leaf.grad = None

    def _after_accumulate(self, cell: list[int], index: int, leaf: torch.Tensor) -> None:
        if self.active and self._rounds[index].open:
            self._rounds[index].accumulated.add(cell[0])

    def _end_round(self, index: int) -> None:
        """End of a replica's backward pass: merge its deltas (see module docstring)."""
        state = self._rounds[index]
        self._rounds[index] = _Round()
        if not state.accumulated:
            _restore(self._leaves(index), state)
            return
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
        with torch.no_grad():
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
        for index, state in enumerate(self._rounds):
            if state.open:
                _restore(self._leaves(index), state)
            self._rounds[index] = _Round()


def _zeros(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def _restore(leaves: list[torch.Tensor], state: _Round) -> None:
    for slot, base in state.bases.items():
        if slot < len(leaves):
            leaves[slot].grad = base
