"""Between-graph replication: every worker runs its own training loop against the ps tasks.

TF1's ``tf.train.replica_device_setter``: each worker process builds the same model in
``strategy.scope()``; its parameters and buffers are created on the ps tasks, round-robin in
creation order (the placement `ParameterServerStrategy` uses, through the same
`phalanx.ps.coordinator.local_copies.LocalCopies`), so that every worker names the same
variables. ``optimizer.step()`` in the scope or in ``strategy.run`` sends the gradients to the
ps tasks, whose copy of the optimizer applies them one push at a time (asynchronous
training, TF1's default) and returns the new values.

The chief alone initialises: its values (or the checkpoint it restores) are written to the ps
tasks, then it marks the model ready; the other workers wait for that mark and read the
chief's values (TF1's ``SessionManager.wait_for_session``). A restarted worker finds the mark
and continues from the current values and global step. `phalanx.train.MonitoredTrainingSession`
drives all of this; a loop of one's own calls `initialize` / `wait_until_ready`, then
`pull` / `push_buffer_changes` / `increment_global_step` around each step.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers import ClusterResolver, SimpleClusterResolver, resolve_cluster
from phalanx.protocols import StepSync
from phalanx.ps.coordinator.local_copies import LocalCopies
from phalanx.ps.coordinator.optimizer_state import OptimizerStates
from phalanx.ps.messages import hyperparameters, optimizer_key
from phalanx.ps.transport import RpcClient
from phalanx.ps.variables import PSClient, VariableHandle
from phalanx.security.token import cluster_token
from phalanx.strategies.parameter_server_worker import PushGradients
from phalanx.strategies.strategy import Strategy

__all__ = ["BetweenGraphStrategy", "replica_device_setter"]

DEFAULT_CONNECT_TIMEOUT = 120.0
_POLL_SECONDS = 0.2
# Two scalars on ps task 0 that every worker shares: TF1's global step, and the chief's mark
# that the variables hold its initial (or restored) values.
_GLOBAL_STEP = VariableHandle("__phalanx__/global_step", 0, (), "torch.int64", "buffer", False)
_READY = VariableHandle("__phalanx__/ready", 0, (), "torch.int64", "buffer", False)


def _check_task(resolver: ClusterResolver) -> ClusterSpec:
    spec = resolver.cluster_spec()
    if "ps" not in spec.jobs:
        raise ValueError(
            "Between-graph replication keeps the variables on 'ps' tasks; the cluster has none. "
            f"Received: {spec.as_dict()!r}. HINT: add a 'ps' job, or train synchronously with "
            "MultiWorkerMirroredStrategy."
        )
    if resolver.task_type not in ("chief", "worker"):
        raise ValueError(
            "A between-graph training loop runs on the 'chief' and 'worker' tasks. Received: task "
            f"{resolver.task_type}:{resolver.task_id}. HINT: a ps task runs phalanx.Server(cluster, "
            "'ps', index).join(); a client outside the cluster drives the workers with "
            "ParameterServerStrategy and ClusterCoordinator; an evaluator evaluates checkpoints."
        )
    return spec


def connect_ps(spec: ClusterSpec, timeout: float) -> PSClient:
    """A client of every ps task of ``spec``, once each answers (blocks up to ``timeout`` s).

    Raises:
        ValueError: ``PHALANX_CLUSTER_TOKEN`` is not set.
        TaskUnavailableError: A ps task did not answer within ``timeout`` (it is named).
    """
    token = cluster_token()
    clients = []
    for i in range(spec.num_tasks("ps")):
        address = spec.task_address("ps", i)
        clients.append(RpcClient(address, token, name=f"ps:{i} ({address})"))
    for client in clients:
        client.wait_until_ready(timeout)
    return PSClient(clients)


class BetweenGraphStrategy(Strategy):
    """One worker's strategy in between-graph replication (TF1's ``replica_device_setter``).

    Every chief and worker task runs the same program: models and optimizers created in
    ``scope()`` live on the ps tasks; ``optimizer.step()`` (in the scope or in ``run``) pushes
    the gradients there, asynchronously. See the module docstring for initialisation.

    Args:
        cluster_resolver: The cluster and this task, a ``chief`` or a ``worker`` (default:
            from the environment, e.g. ``TF_CONFIG``). The cluster needs a ``ps`` job.
        connect_timeout: Seconds to wait for every ps task to answer.

    Raises:
        ValueError: No ``ps`` job, this task is not a chief or worker, or
            ``PHALANX_CLUSTER_TOKEN`` is not set.
        TaskUnavailableError: A ps task did not answer within ``connect_timeout``.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        resolver = cluster_resolver or resolve_cluster()
        spec = _check_task(resolver)
        super().__init__(["cpu:0"])
        self._resolver = resolver
        self._ps = connect_ps(spec, connect_timeout)
        self._ps.create([_GLOBAL_STEP, _READY], [torch.zeros((), dtype=torch.int64)] * 2)  # idempotent
        self._copies = LocalCopies(self._ps, None)
        self._optimizers = OptimizerStates(self._ps, self._copies)
        self._created: set[str] = set()
        self._buffers_read: dict[str, tuple[torch.Tensor, VariableHandle, torch.Tensor]] = {}
        self._push = PushGradients(self.push_gradients)

    @property
    def step_sync(self) -> StepSync:
        """Pushes the gradients to the ps tasks (see `Strategy.step_sync`)."""
        return self._push

    # ------------------------------------------------------------------ identity
    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster and this task."""
        return self._resolver

    @property
    def is_chief(self) -> bool:
        """Whether this task initialises the variables and writes checkpoints (``chief:0``,
        else ``worker:0``)."""
        return self._resolver.is_chief

    @property
    def task_name(self) -> str:
        """``worker:1``: this task, for messages."""
        return f"{self._resolver.task_type}:{self._resolver.task_id}"

    @property
    def num_ps(self) -> int:
        """The number of ps tasks."""
        return self._ps.num_ps

    def __repr__(self) -> str:
        return f"BetweenGraphStrategy({self.task_name}, ps={self.num_ps})"

    # ------------------------------------------------------------------ variables (hooks)
    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        self._copies.place(module, name, param, "parameter")
        return None

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        self._copies.place(module, name, buffer, "buffer")
        return None

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        self.push_gradients(optimizer)

    def variables(self) -> dict[str, torch.Tensor]:
        """Every variable created in this strategy's scope, by its name on the ps tasks (the
        same on every worker), in creation order: what TF1's default ``Saver`` saves."""
        return {handle.name: tensor for tensor, handle in self._copies.live()}

    # ------------------------------------------------------------------ initialisation
    def initialize(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """(chief) Writes this task's values of every variable, and the state of
        ``optimizers`` (restored from a checkpoint), to the ps tasks, then marks the model
        ready for the other workers (blocks on one write per ps task)."""
        for optimizer in optimizers:
            self._optimizers.adopt(optimizer)  # a restored state moves to the ps tasks now
        self._copies.push_writes()  # what changed since placement; keeps the copies' bookkeeping
        pairs = self._copies.live()
        if pairs:  # all of them: a worker may have created a variable first, with its own values
            self._ps.write("assign", [h for _, h in pairs], [t.detach() for t, _ in pairs])
        self._ps.write("assign", [_READY], [torch.ones((), dtype=torch.int64)])

    def wait_until_ready(self, timeout: float) -> None:
        """(other workers) Waits until the chief marked the model ready, then reads its values.

        Raises:
            TimeoutError: The chief did not initialise within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        while int(self._ps.read([_READY])[0]) < 1:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.task_name} waited {timeout:g}s for the chief to initialise the variables on "
                    f"the ps tasks; it did not. Received: no ready mark from the chief "
                    f"({self._chief_name()}). HINT: start the chief task (it runs the same program with "
                    "is_chief=True), or raise max_wait_secs."
                )
            time.sleep(_POLL_SECONDS)
        self.pull()

    def _chief_name(self) -> str:
        return "chief:0" if "chief" in self._resolver.cluster_spec().jobs else "worker:0"

    # ------------------------------------------------------------------ one step
    def pull(self) -> None:
        """Reads every variable's current value from the ps tasks (before a step; blocks)."""
        self._copies.mark_stale()
        self._copies.refresh()
        self._buffers_read = {
            h.name: (t, h, t.detach().clone()) for t, h in self._copies.live() if h.kind == "buffer"
        }

    def push_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Sends the gradients of ``optimizer``'s variables to the ps tasks, which apply them
        with their copy of the optimizer (its state lives there), and takes the new values.
        Clears the gradients, so that the local ``step`` that follows changes nothing.

        Raises:
            ValueError: The optimizer holds a tensor not created in this strategy's scope.
        """
        self._optimizers.adopt(optimizer)  # a restored state moves to the ps tasks
        groups = [[self._handle(p) for p in group["params"]] for group in optimizer.param_groups]
        hyper = [hyperparameters(group) for group in optimizer.param_groups]
        key = optimizer_key(optimizer, groups)
        if key not in self._created:
            self._ps.create_optimizer(key, type(optimizer), list(zip(groups, hyper, strict=True)))
            self._created.add(key)
        pairs = [
            (p, h)
            for group, handles in zip(optimizer.param_groups, groups, strict=True)
            for p, h in zip(group["params"], handles, strict=True)
            if p.grad is not None
        ]
        if not pairs:
            return
        grads = [p.grad.detach() for p, _ in pairs if p.grad is not None]
        values, _ = self._ps.apply_gradients(key, [h for _, h in pairs], grads, hyper)
        with torch.no_grad():
            for (p, _), value in zip(pairs, values, strict=True):
                p.copy_(value)
                p.grad = None

    def _handle(self, tensor: torch.Tensor) -> VariableHandle:
        handle = self._copies.handle_of(tensor)
        if handle is None:
            raise ValueError(
                "Between-graph replication trains the variables on the ps tasks: every tensor an "
                f"optimizer steps must be created in strategy.scope(). Received: a tensor of shape "
                f"{tuple(tensor.shape)} created outside it. HINT: create the model and the optimizer "
                "inside `with strategy.scope():`."
            )
        return handle

    def push_buffer_changes(self) -> None:
        """Adds to the ps copies what the step changed in module buffers (BatchNorm's
        statistics) since `pull`."""
        handles, deltas = [], []
        for tensor, handle, read in self._buffers_read.values():
            if tensor.dtype != torch.bool and not torch.equal(tensor, read):
                handles.append(handle)
                deltas.append(tensor.detach() - read)
        self._buffers_read = {}
        if handles:
            self._ps.write("assign_add", handles, deltas)

    # ------------------------------------------------------------------ the global step
    def global_step(self) -> int:
        """The cluster's global step: steps taken by all workers together (blocks)."""
        return int(self._ps.read([_GLOBAL_STEP])[0])

    def set_global_step(self, value: int) -> None:
        """(chief, restoring a checkpoint) Sets the global step."""
        self._ps.write("assign", [_GLOBAL_STEP], [torch.tensor(int(value), dtype=torch.int64)])

    def increment_global_step(self) -> int:
        """Adds this step to the global step; returns the new value (blocks)."""
        self._ps.write("assign_add", [_GLOBAL_STEP], [torch.ones((), dtype=torch.int64)])
        return self.global_step()

    def close(self) -> None:
        """Closes the connections to the ps tasks."""
        self._ps.close()


_DEVICE = re.compile(r"/job:(?P<job>[a-z]+)(?:/replica:\d+)?/task:(?P<task>\d+)")


def replica_device_setter(
    cluster: ClusterSpec | Mapping[str, Any] | ClusterResolver | None = None,
    worker_device: str | None = None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> BetweenGraphStrategy:
    """This worker's `BetweenGraphStrategy` (tf.compat.v1.train.replica_device_setter).

    TF1 writes ``with tf.device(tf.train.replica_device_setter(cluster=cluster,
    worker_device="/job:worker/task:%d" % task_index)):``; phalanx writes ``with
    phalanx.train.replica_device_setter(cluster, "/job:worker/task:%d" % task_index).scope():``.
    Variables go round-robin over the ps tasks (TF's default placement).

    Args:
        cluster: A `ClusterSpec`, its dict, or a cluster resolver that knows this task
            (default: from the environment, e.g. ``TF_CONFIG``).
        worker_device: ``"/job:worker/task:N"`` (or ``/job:chief/task:0``): this task, when
            ``cluster`` does not say.
        connect_timeout: Seconds to wait for every ps task to answer.

    Raises:
        ValueError: ``worker_device`` is not ``/job:<job>/task:<index>``, or what
            `BetweenGraphStrategy` raises.
    """
    if isinstance(cluster, ClusterResolver) or cluster is None:
        resolver = cluster or resolve_cluster()
        if worker_device is None:
            return BetweenGraphStrategy(resolver, connect_timeout)
        spec: ClusterSpec | Mapping[str, Any] = resolver.cluster_spec()
    else:
        spec = cluster
    job, index = _parse_device(worker_device)
    resolver = SimpleClusterResolver(ClusterSpec(spec), task_type=job, task_id=index)
    return BetweenGraphStrategy(resolver, connect_timeout)


def _parse_device(worker_device: str | None) -> tuple[str, int]:
    match = _DEVICE.fullmatch(worker_device or "")
    if match is None:
        raise ValueError(
            "worker_device names this task as '/job:<job>/task:<index>'. Received: "
            f"{worker_device!r}. HINT: replica_device_setter(cluster, '/job:worker/task:%d' % task_index)."
        )
    return match["job"], int(match["task"])
