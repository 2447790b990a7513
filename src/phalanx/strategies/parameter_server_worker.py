"""WorkerStrategy: what ``strategy`` is inside a scheduled function on a worker; and
`PushGradients`, the step of every strategy whose workers push gradients to ps tasks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from phalanx.protocols import StepSync
from phalanx.strategies.strategy import Strategy

__all__ = ["GradientPusher", "PushGradients", "WorkerStrategy"]


class GradientPusher(Protocol):
    """What a `WorkerStrategy` runs on: a worker's environment (`phalanx.ps.worker.environment`)."""

    @property
    def worker_index(self) -> int:
        """This worker's index in the cluster's ``worker`` job."""

    def push_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Sends ``optimizer``'s gradients to the ps tasks, which apply them."""


class PushGradients:
    """A `StepSync` whose ``optimizer.step()`` pushes the gradients (``push(optimizer)``) to
    the ps tasks instead of updating locally: a parameter-server worker's and a between-graph
    worker's."""

    def __init__(self, push: Callable[[torch.optim.Optimizer], None]) -> None:
        self._push = push

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        self._push(optimizer)

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        return None

    def reset_thread(self) -> None:
        return None


class WorkerStrategy(Strategy):
    """What ``strategy`` is inside a scheduled function on a worker: one local replica
    (``run`` calls the function, ``reduce`` is local), optimizer steps go to the ps tasks.

    The chief's ParameterServerStrategy becomes this on unpickling (`phalanx.ps.pickling`).

    Args:
        env: The worker's environment (its variables and the ps tasks' client).
    """

    def __init__(self, env: GradientPusher) -> None:
        super().__init__(["cpu:0"])
        self._env = env
        self._push = PushGradients(env.push_gradients)

    @property
    def step_sync(self) -> StepSync:
        """Pushes the gradients to the ps tasks (see `Strategy.step_sync`)."""
        return self._push

    @property
    def worker_index(self) -> int:
        """This worker's index in the cluster's ``worker`` job."""
        return self._env.worker_index

    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        raise RuntimeError(
            f"A parameter ({type(module).__name__}.{name}) was created inside a scheduled function. "
            "With ParameterServerStrategy, variables live on the ps tasks and are created by the "
            "coordinator. HINT: create models and optimizers in strategy.scope() before scheduling."
        )

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        return None

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        self._env.push_gradients(optimizer)

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(worker {self._env.worker_index})"
