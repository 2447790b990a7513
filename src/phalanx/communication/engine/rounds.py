"""Backward rounds: the one engine behind "when ``backward()`` returns, ``.grad`` holds the sum".

Every synchronous strategy keeps DDP's contract: once ``backward()`` has returned inside
``run``, ``.grad`` holds the gradient summed over every replica and worker, so reads and
in-place edits between backward and ``optimizer.step()`` (clipping, unscaling, logging) act
on the sum and the step applies what ``.grad`` holds. Two *stages* sum: in-process replicas
meet at the end of the pass (`phalanx.strategies.replicas.backward_rounds`, `_gradients`), workers
with one replica each all-reduce buckets while backward still runs
(`phalanx.communication.engine.bucketing`). Both run on the rounds here.

One backward pass of one replica is one *round*. Two hooks on every tracked leaf drive it:

* the pre-hook (before autograd accumulates into ``.grad``), at a leaf's first visit in the
  round, moves the leaf's current ``.grad`` aside as its *base* (``.grad`` becomes None, so
  autograd writes this pass's contribution, the *delta*, into a fresh tensor), and at the
  round's first visit tells the stage (``on_open``) and queues an end-of-backward callback in
  autograd's engine (as DDP does);
* the post-accumulate hook records that the leaf really accumulated (``torch.autograd.grad``
  fires pre-hooks but accumulates nothing) and hands the delta to the stage (``on_delta``:
  the buckets start their all-reduces from there).

At the end of the pass the stage's ``on_end`` sums the deltas and installs ``base + sum``.
Summing deltas, not whole gradients, keeps gradient accumulation right: two backward passes
before one step give ``sum(d1) + sum(d2)``, not the first sum counted once per replica. A
round that accumulated nothing puts the bases back and the stage never hears of it;
replicas and workers run the same program, so all of them decide alike. A backward pass
that raised never reaches its end: `abort` puts the bases back.

Accumulate-only rounds (``syncing()`` false when a round opens: the strategy's
``no_sync()``, `phalanx.strategies.accumulation`) tell the stage nothing, so nothing moves
between replicas or workers. At a leaf's first visit since the last synchronised round its
``.grad`` is *held* as its base, and autograd accumulates this pass's delta, and those of
the accumulate-only passes after it, into a fresh ``.grad``: the local sum of the pending
deltas. The next synchronised round takes the held base as the leaf's base and leaves the
pending sum in ``.grad``, so autograd adds its own delta to it and the stage sums
(pending + delta) across replicas and workers exactly once. A leaf that pass does not reach
still hands its pending sum to the stage at the end of the round.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Round", "Rounds"]


class Round:
    """One replica's state during one backward pass; ``slot`` is the stage's key of a leaf."""

    __slots__ = ("accumulated", "bases", "leaves", "open", "syncs")

    def __init__(self) -> None:
        self.open = False
        self.syncs = True  # False: an accumulate-only round (decided when it opens)
        self.bases: dict[Any, torch.Tensor | None] = {}  # slot -> the .grad moved aside
        self.leaves: dict[Any, torch.Tensor] = {}  # slot -> its leaf (to put the base back)
        self.accumulated: set[Any] = set()  # slots whose leaf accumulated this round

    def restore(self, keep: frozenset[Any] = frozenset()) -> None:
        """Puts every moved-aside gradient back, but those of ``keep`` (held pending sums)."""
        for slot, base in self.bases.items():
            if slot not in keep:
                self.leaves[slot].grad = base


class _Held:
    """A leaf's gradient held across accumulate-only rounds: its cell (``cell[0]`` is its
    slot now; the stage may renumber it), the leaf, and the base moved aside at its first
    accumulate-only visit (what the last synchronised round left)."""

    __slots__ = ("base", "cell", "leaf")

    def __init__(self, cell: list[Any], leaf: torch.Tensor, base: torch.Tensor | None) -> None:
        self.cell, self.leaf, self.base = cell, leaf, base


class Rounds:
    """Per-replica rounds over hooked leaves (see module docstring).

    Args:
        num_replicas: The replicas of this process (one round state each).
        on_end: ``on_end(index, round)`` at the end of every round that accumulated, on the
            thread autograd ran the pass's end on; sums and installs ``base + sum``.
        active: Whether backward passes count now (inside the strategy's ``run``).
        on_open: ``on_open(index)`` at the first hook of a round (before any base moves).
        on_delta: ``on_delta(index, slot, leaf)`` once autograd accumulated into ``leaf``.
        syncing: Whether a round opening now sums across replicas and workers (False: it
            only accumulates locally; see the module docstring).
    """

    def __init__(
        self,
        num_replicas: int,
        on_end: Callable[[int, Round], None],
        active: Callable[[], bool],
        on_open: Callable[[int], None] | None = None,
        on_delta: Callable[[int, Any, torch.Tensor], None] | None = None,
        syncing: Callable[[], bool] = lambda: True,
    ) -> None:
        self._on_end, self._active = on_end, active
        self._on_open, self._on_delta = on_open, on_delta
        self._syncing = syncing
        self._rounds = [Round() for _ in range(num_replicas)]
        # per replica: id(cell) -> the leaf's gradient held by accumulate-only rounds
        self._held: list[dict[int, _Held]] = [{} for _ in range(num_replicas)]

    def hook(self, leaf: torch.Tensor, index: int, cell: list[Any]) -> list[Any]:
        """Hooks replica ``index``'s ``leaf``, whose slot is ``cell[0]`` (the stage may
        renumber it in place); returns the hooks' handles."""
        ref = weakref.ref(leaf)
        return [
            leaf.register_hook(functools.partial(self._before_accumulate, cell, index, ref)),
            leaf.register_post_accumulate_grad_hook(functools.partial(self._after_accumulate, cell, index)),
        ]

    def state(self, index: int) -> Round:
        """Replica ``index``'s current round (its bases so far)."""
        return self._rounds[index]

    def holds(self, index: int) -> bool:
        """Whether accumulate-only rounds of replica ``index`` left deltas no synchronised
        round has summed yet."""
        return bool(self._held[index])

    def _before_accumulate(
        self, cell: list[Any], index: int, ref: weakref.ref[torch.Tensor], grad: torch.Tensor
    ) -> None:
        if not self._active():
            return
        state = self._rounds[index]
        if not state.open:
            state.syncs = self._syncing()
            if state.syncs and self._on_open is not None:
                self._on_open(index)
            state.open = True
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end, index))
        slot = cell[0]
        if slot in state.leaves:
            return
        leaf = ref()
        if leaf is None:
            return
        state.leaves[slot] = leaf
        pending = self._held[index]
        held = pending.get(id(cell)) if pending else None  # (none held: the usual pass)
        if held is not None:  # .grad is the pending sum: autograd adds this pass's delta to it
            if state.syncs:
                state.bases[slot] = held.base
            return
        base = state.bases[slot] = leaf.grad
        if not state.syncs:
            pending[id(cell)] = _Held(cell, leaf, base)
        if base is not None:  # (setting .grad costs more than reading it)
            leaf.grad = None

    def _after_accumulate(self, cell: list[Any], index: int, leaf: torch.Tensor) -> None:
        state = self._rounds[index]
        if not (self._active() and state.open):
            return
        state.accumulated.add(cell[0])
        if state.syncs and self._on_delta is not None:
            self._on_delta(index, cell[0], leaf)

    def _end(self, index: int) -> None:
        """End of a replica's backward pass (autograd's callback)."""
        state = self._rounds[index]
        if not state.syncs:
            self._rounds[index] = Round()
            self._end_accumulating(index, state)
            return
        self._take_held(index, state)  # before the round is replaced: the stage reads its bases
        self._rounds[index] = Round()
        if not state.accumulated:  # autograd.grad only
            state.restore()
            return
        with torch.no_grad():
            self._on_end(index, state)

    def _end_accumulating(self, index: int, state: Round) -> None:
        """End of an accumulate-only pass: leaves held at this pass that accumulated nothing
        (``torch.autograd.grad``) get their gradient back; the others keep their pending sum."""
        held = self._held[index]
        for key, entry in list(held.items()):
            slot = entry.cell[0]
            if slot in state.bases and slot not in state.accumulated:
                entry.leaf.grad = entry.base
                del held[key]

    def _take_held(self, index: int, state: Round) -> None:
        """A synchronised pass takes over every pending sum: each held leaf counts as
        accumulated in it (a leaf this pass did not reach hands its pending sum to the stage
        now); a leaf whose ``.grad`` was cleared since (``zero_grad()``) has none."""
        held = self._held[index]
        if not held:
            return
        for entry in held.values():
            slot = entry.cell[0]
            if entry.leaf.grad is None:
                continue
            reached = slot in state.leaves
            state.leaves[slot] = entry.leaf
            state.bases[slot] = entry.base
            state.accumulated.add(slot)
            if not reached and self._on_delta is not None:
                self._on_delta(index, slot, entry.leaf)
        held.clear()

    def abort(self) -> None:
        """Ends the rounds left open by a backward pass that raised (its end-of-backward
        callback never ran): every moved-aside gradient goes back (after ``run``)."""
        for index, state in enumerate(self._rounds):
            if state.open:  # (a round not open is a fresh one: nothing to end or replace)
                held = self._held[index]
                if not state.syncs:  # leaves first held by the failed pass let go
                    for key in [k for k, e in held.items() if e.cell[0] in state.bases]:
                        del held[key]
                state.restore(keep=frozenset(e.cell[0] for e in held.values()))
                self._rounds[index] = Round()
