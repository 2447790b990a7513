"""``Model.compile(gradient_accumulation_steps=k)``: Keras 3's gradient accumulation for ``fit``.

Keras 3's meaning (``keras.optimizers.Optimizer(gradient_accumulation_steps=k)``): every
training step computes its gradients; the model updates every ``k`` steps, with the MEAN of
the gradients of the ``k`` steps since the last update. Everything else still counts steps:
``fit``'s batch callbacks and logs, ``steps_per_epoch`` and the metrics (each step updates
them with its own batch), and the count carries across epochs and ``fit`` calls (Keras keeps
it in the optimizer's iteration counter). Learning-rate schedules count updates: phalanx's
optimizers are ``torch.optim`` optimizers, which step only at updates, so their own step
count (Adam's bias correction) and a scheduler stepped with them count updates.

The ``k - 1`` steps between updates run inside ``strategy.no_sync()``
(`phalanx.strategies.accumulation`): their gradients stay on each replica and worker, and
the update's backward pass sums all ``k`` steps' gradients once. The loss of every step is
divided by ``k`` so that this sum is the mean.

The accumulated gradients live in the parameters' ``.grad``, which checkpoints do not save:
a training restored between two updates starts a fresh accumulation (Keras 3 saves its
accumulators with the optimizer's variables).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["Accumulation", "check_steps", "check_strategy"]


def check_steps(steps: Any) -> int:
    """``gradient_accumulation_steps`` as an int (None: 1, no accumulation).

    Raises:
        TypeError: Not an int (a bool is not one here).
        ValueError: An int below 1.
    """
    if steps is None:
        return 1
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(
            "gradient_accumulation_steps must be an int (the number of steps per update) or None. "
            f"Received: {steps!r} of type {type(steps).__name__}. HINT: gradient_accumulation_steps=4 "
            "updates the model every 4 batches with the mean of their gradients."
        )
    if steps < 1:
        raise ValueError(
            "gradient_accumulation_steps must be at least 1 (1 or None: update at every step). "
            f"Received: {steps}."
        )
    return steps


def check_strategy(steps: int, strategy: Any) -> None:
    """Refuses accumulation under strategies whose ``fit`` cannot keep it (compile time).

    Raises:
        ValueError: A strategy that schedules each step on any remote worker
            (ParameterServerStrategy), or an elastic MultiWorkerMirrored job.
    """
    if steps == 1:
        return
    if strategy.schedules_steps:
        raise ValueError(
            "gradient_accumulation_steps > 1 needs consecutive steps on one worker, and "
            f"{type(strategy).__name__}'s fit schedules every step on whichever worker is free. "
            f"Received: gradient_accumulation_steps={steps}. HINT: accumulate inside one scheduled "
            "function instead: run the k micro-batches' backward passes and call optimizer.step() "
            "once (the worker pushes once); or use a larger batch_size."
        )
    if getattr(strategy, "membership", None) is not None:
        raise ValueError(
            "gradient_accumulation_steps > 1 is not supported in an elastic job: the gradients "
            "accumulated between two updates cannot follow a worker that leaves or joins. "
            f"Received: gradient_accumulation_steps={steps}. HINT: use a larger batch_size, or a "
            "fixed set of workers."
        )


class Accumulation:
    """Counts a model's training steps between updates (``fit``, ``train_on_batch``).

    Args:
        steps: Training steps per update (1: every step updates).
    """

    def __init__(self, steps: int = 1) -> None:
        self.steps = steps
        self._since_update = 0  # steps run since the last update (carried across epochs and fits)

    @property
    def updates_now(self) -> bool:
        """Whether the step now running updates the model (read inside ``run``)."""
        return self._since_update + 1 >= self.steps

    @property
    def loss_factor(self) -> float:
        """What each step's loss is multiplied by: the update applies the mean gradient."""
        return 1.0 / self.steps

    def run(self, strategy: Any, step: Callable[[Any], Any], data: Any) -> None:
        """Runs one training step, ``step(data)`` on every local replica (cross-replica
        context, every worker): inside ``strategy.no_sync()`` unless it updates."""
        if self.steps == 1:
            strategy.run(step, args=(data,))
            return
        with contextlib.nullcontext() if self.updates_now else strategy.no_sync():
            strategy.run(step, args=(data,))
        self._since_update = (self._since_update + 1) % self.steps
