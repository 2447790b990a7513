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

    __slots__ = ("accumulated", "bases", "leaves", "open")

    def __init__(self) -> None:
        self.open = False
        self.bases: dict[Any, torch.Tensor | None] = {}  # slot -> the .grad moved aside
        self.leaves: dict[Any, torch.Tensor] = {}  # slot -> its leaf (to put the base back)
        self.accumulated: set[Any] = set()  # slots whose leaf accumulated this round

    def restore(self) -> None:
        """Puts every moved-aside gradient back."""
        for slot, base in self.bases.items():
            self.leaves[slot].grad = base


class Rounds:
    """Per-replica rounds over hooked leaves (see module docstring).

    Args:
        num_replicas: The replicas of this process (one round state each).
        on_end: ``on_end(index, round)`` at the end of every round that accumulated, on the
            thread autograd ran the pass's end on; sums and installs ``base + sum``.
        active: Whether backward passes count now (inside the strategy's ``run``).
        on_open: ``on_open(index)`` at the first hook of a round (before any base moves).
        on_delta: ``on_delta(index, slot, leaf)`` once autograd accumulated into ``leaf``.
    """

    def __init__(
        self,
        num_replicas: int,
        on_end: Callable[[int, Round], None],
        active: Callable[[], bool],
        on_open: Callable[[int], None] | None = None,
        on_delta: Callable[[int, Any, torch.Tensor], None] | None = None,
    ) -> None:
        self._on_end, self._active = on_end, active
        self._on_open, self._on_delta = on_open, on_delta
        self._rounds = [Round() for _ in range(num_replicas)]

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

    def _before_accumulate(
        self, cell: list[Any], index: int, ref: weakref.ref[torch.Tensor], grad: torch.Tensor
    ) -> None:
        if not self._active():
            return
        state = self._rounds[index]
        if not state.open:
            if self._on_open is not None:
                self._on_open(index)
            state.open = True
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end, index))
        slot = cell[0]
        if slot not in state.bases:
            leaf = ref()
            if leaf is not None:
                base = state.bases[slot] = leaf.grad
                state.leaves[slot] = leaf
                if base is not None:  # (setting .grad costs more than reading it)
                    leaf.grad = None

    def _after_accumulate(self, cell: list[Any], index: int, leaf: torch.Tensor) -> None:
        state = self._rounds[index]
        if not (self._active() and state.open):
            return
        state.accumulated.add(cell[0])
        if self._on_delta is not None:
            self._on_delta(index, cell[0], leaf)

    def _end(self, index: int) -> None:
        """End of a replica's backward pass (autograd's callback)."""
        state = self._rounds[index]
        self._rounds[index] = Round()
        if not state.accumulated:  # autograd.grad only
            state.restore()
            return
        with torch.no_grad():
            self._on_end(index, state)

    def abort(self) -> None:
        """Ends the rounds left open by a backward pass that raised (its end-of-backward
        callback never ran): every moved-aside gradient goes back (after ``run``)."""
        for index, state in enumerate(self._rounds):
            if state.open:
                state.restore()
            self._rounds[index] = Round()
