"""ParameterServerStrategy: asynchronous training with variables on parameter-server tasks.

The chief (the coordinator) runs the training program. Parameters and buffers of modules
created in its ``scope()`` are placed on the ps tasks, round-robin in creation order (TF's
placement); the coordinator keeps a local copy of each. Functions given to
`ClusterCoordinator.schedule` run on the workers, each on its own, asynchronously: a worker
reads the variables, computes, and its ``optimizer.step()`` sends the gradients to the ps
tasks, where a copy of the optimizer (its state lives there) applies them one push at a time.

Workers and ps tasks run `phalanx.Server(...).join()`. Every task needs the same secret in
``PHALANX_CLUSTER_TOKEN`` (`phalanx launch` sets one); nothing is unpickled from a peer that
did not present it.

This class is thin: the work is done by its `phalanx.ps.coordinator.chief.Chief`, which the
`ClusterCoordinator` talks to as well (docs/architecture.md has the package map).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from phalanx.cluster.resolvers import ClusterResolver, resolve_cluster
from phalanx.protocols import StepSync
from phalanx.ps.coordinator.chief import DEFAULT_CONNECT_TIMEOUT, Chief
from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator
from phalanx.ps.variables import VariableHandle
from phalanx.status.taking_part import join_status
from phalanx.strategies.strategy import Strategy

__all__ = ["ParameterServerStrategy"]

_STEP_ON_THE_COORDINATOR = (
    "With ParameterServerStrategy, training steps run on the workers: optimizer.step() on the "
    "coordinator would change only its local copy of the variables. HINT: put the step in a "
    "function and run it with ClusterCoordinator.schedule (Model.fit does this)."
)


class _NoStepsHere:
    """The coordinator's optimizer-step hook (a `StepSync`): steps belong in scheduled functions."""

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        raise RuntimeError(_STEP_ON_THE_COORDINATOR)

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        return None

    def reset_thread(self) -> None:
        return None


_NO_STEPS_HERE = _NoStepsHere()


class ParameterServerStrategy(Strategy):
    """Asynchronous data-parallel training with variables on ps tasks (the coordinator only;
    tf.distribute.ParameterServerStrategy). Use it with a `ClusterCoordinator`.

    The coordinator is the cluster's ``chief`` task, or a client: a process that is not a task
    of the cluster (its resolver has no ``task_type``; TF1's session target), in a cluster
    without a chief task. Workers that run their own training loops (TF1's between-graph
    replication) use `phalanx.train.replica_device_setter` instead.

    Args:
        cluster_resolver: The cluster (default: from the environment, e.g. ``TF_CONFIG``);
            it needs ``ps`` and ``worker`` jobs, and this process must be the ``chief`` or a
            client outside the cluster.
        variable_partitioner: Splits parameters along their first axis over the ps tasks
            (`phalanx.partitioners`); None keeps each whole on one ps task.
        connect_timeout: Seconds to wait for every ps task to answer.

    Raises:
        TypeError: ``variable_partitioner`` is not callable.
        ValueError: The cluster is unusable (the message names the field), or
            ``PHALANX_CLUSTER_TOKEN`` is not set.
        TaskUnavailableError: A ps task did not answer within ``connect_timeout``.
    """

    schedules_steps = True

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Any = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(
                "variable_partitioner must be callable as partitioner(shape, dtype) -> partitions "
                f"per axis. Received: {type(variable_partitioner).__name__}. HINT: "
                "phalanx.partitioners.FixedShardsPartitioner(2)."
            )
        super().__init__(["cpu:0"])
        self._resolver = cluster_resolver or resolve_cluster()
        job, index = self._resolver.task_type, self._resolver.task_id
        task = f"{job}:{index}" if job is not None and index is not None else "chief:0"
        self._status = join_status(task, is_chief=True)  # the coordinator's task serves the page
        self._chief = Chief(self, self._resolver, variable_partitioner, connect_timeout)
        self._ps = self._chief.ps  # the ps tasks' client (benchmarks read variables through it)
        if self._status is not None:
            self._status.running()

    @property
    def step_sync(self) -> StepSync:
        """Refuses steps: they belong in scheduled functions (see `Strategy.step_sync`)."""
        return _NO_STEPS_HERE

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster this strategy runs in."""
        return self._resolver

    @property
    def num_ps(self) -> int:
        """The number of ps tasks."""
        return self._chief.ps.num_ps

    @property
    def cluster_coordinator(self) -> ClusterCoordinator | None:
        """The `ClusterCoordinator` made for this strategy, if any."""
        coordinator = self._chief.coordinator
        return coordinator if isinstance(coordinator, ClusterCoordinator) else None

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(workers={self._chief.num_workers}, ps={self.num_ps})"

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        raise RuntimeError(_STEP_ON_THE_COORDINATOR)

    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        self._chief.place(module, name, param, "parameter")
        return None

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        self._chief.place(module, name, buffer, "buffer")
        return None

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` is a variable placed on the ps tasks by this strategy's scope."""
        return isinstance(v, torch.Tensor) and self._chief.copies.handle_of(v) is not None

    def _parameter_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:ps/task:{i}/device:CPU:0" for i in range(self.num_ps))

    def _colocate_vars_with(self, colocate_with_variable: Any) -> contextlib.AbstractContextManager[None]:
        return self._chief.copies.colocated_with(colocate_with_variable)

    def _live(self) -> list[tuple[torch.Tensor, VariableHandle]]:
        """The chief's variables with their handles (tests read the placement from it)."""
        return self._chief.copies.live()

    def close(self) -> None:
        """Stops the coordinator's threads and closes the connections (idempotent)."""
        coordinator = self.cluster_coordinator
        if coordinator is not None:
            coordinator.shutdown()
        self._chief.close()
        if self._status is not None:
            self._status.close()
