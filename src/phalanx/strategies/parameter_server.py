"""ParameterServerStrategy: asynchronous training with variables on parameter-server tasks.

The chief (the coordinator) runs the training program. Parameters and buffers of modules
created in its ``scope()`` are placed on the ps tasks, round-robin in creation order (TF's
placement); the coordinator keeps a local copy of each. Functions given to
`ClusterCoordinator.schedule` run on the workers, each on its own, asynchronously: a worker
reads the variables, computes, and its ``optimizer.step()`` sends the gradients to the ps
tasks, where a copy of the optimizer (its state lives there) applies them one push at a time.

Workers and ps tasks run `phalanx.cluster.Server(...).join()`. Every task needs the same
secret in ``PHALANX_CLUSTER_TOKEN`` (`phalanx launch` sets one); nothing is unpickled from a
peer that did not present it.

The coordinator's local copies are refreshed from the ps tasks when a module created in
scope runs forward or gives its ``state_dict()`` after scheduled functions finished; what the
coordinator writes into them (``load_state_dict``, in-place initialisation) is sent to the ps
tasks before the next function is scheduled.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from phalanx.cluster._token import cluster_token
from phalanx.cluster.resolvers import ClusterResolver, resolve_cluster
from phalanx.ps import sharding
from phalanx.ps.partitioners import shard_rows
from phalanx.ps.pickling import dumps
from phalanx.ps.transport import RpcClient
from phalanx.ps.variables import PSClient, VariableHandle
from phalanx.ps.worker import environment as worker_lib
from phalanx.strategies.strategy import Strategy

if TYPE_CHECKING:
    from phalanx.ps.coordinator.closure import Closure
    from phalanx.ps.coordinator.cluster_coordinator import ClusterCoordinator
    from phalanx.ps.coordinator.remote_worker import RemoteWorker

__all__ = ["ParameterServerStrategy"]

DEFAULT_CONNECT_TIMEOUT = 120.0
_coordinators: weakref.WeakValueDictionary[int, ParameterServerStrategy] = weakref.WeakValueDictionary()
_forward_depth = threading.local()


def _check_cluster(resolver: ClusterResolver) -> None:
    spec = resolver.cluster_spec()
    missing = [job for job in ("ps", "worker") if job not in spec.jobs or spec.num_tasks(job) == 0]
    if missing:
        raise ValueError(
            f"ParameterServerStrategy needs 'ps' and 'worker' jobs in the cluster; {missing} "
            f"missing. Received: {spec.as_dict()!r}. HINT: phalanx launch --chief --workers 2 --ps 1 "
            "script.py."
        )
    if resolver.task_type != "chief":
        raise ValueError(
            "ParameterServerStrategy is created by the coordinator, the 'chief' task. Received: task "
            f"{resolver.task_type}:{resolver.task_id}. HINT: workers and ps tasks run "
            "phalanx.cluster.Server(cluster_resolver.cluster_spec(), job_name, task_index).join()."
        )


_STEP_ON_THE_COORDINATOR = (
    "With ParameterServerStrategy, training steps run on the workers: optimizer.step() on the "
    "coordinator would change only its local copy of the variables. HINT: put the step in a "
    "function and run it with ClusterCoordinator.schedule (Model.fit does this)."
)


class _NoStepsHere:
    """The coordinator's optimizer-step hook: steps belong in scheduled functions."""

    def before_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        raise RuntimeError(_STEP_ON_THE_COORDINATOR)

    def after_step(self, optimizer: torch.optim.Optimizer, replica_index: int) -> None:
        return None

    def reset_thread(self) -> None:
        return None


class ParameterServerStrategy(Strategy):
    """Asynchronous data-parallel training with variables on ps tasks (the chief only;
    tf.distribute.ParameterServerStrategy). Use it with a `ClusterCoordinator`.

    Args:
        cluster_resolver: The cluster (default: from the environment, e.g. ``TF_CONFIG``);
            it needs ``ps`` and ``worker`` jobs, and this process must be the ``chief``.
        variable_partitioner: Splits parameters along their first axis over the ps tasks
            (`phalanx.partitioners`); None keeps each whole on one ps task.
        connect_timeout: Seconds to wait for every ps task to answer.

    Raises:
        ValueError: The cluster is unusable (the message names the field), or
            ``PHALANX_CLUSTER_TOKEN`` is not set.
        TaskUnavailableError: A ps task did not answer within ``connect_timeout``.
    """

    _schedules_steps = True

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
        self._partitioner = variable_partitioner
        super().__init__(["cpu:0"])
        resolver = cluster_resolver or resolve_cluster()
        _check_cluster(resolver)
        self._resolver = resolver
        self._token = cluster_token()
        self._spec = resolver.cluster_spec()
        self._coordinator: ClusterCoordinator | None = None
        clients = [self._client("ps", i) for i in range(self._spec.num_tasks("ps"))]
        for client in clients:
            client.wait_until_ready(connect_timeout)
        self._ps = PSClient(clients)
        self._registry: dict[int, tuple[weakref.ref[torch.Tensor], VariableHandle]] = {}
        self._versions: dict[str, int] = {}
        self._count = 0
        self._stale = False
        self._lock = threading.RLock()
        self._step_sync = _NoStepsHere()
        _coordinators[id(self)] = self

    def _client(self, job: str, index: int) -> RpcClient:
        address = self._spec.task_address(job, index)
        return RpcClient(address, self._token, name=f"{job}:{index} ({address})")

    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The cluster this strategy runs in."""
        return self._resolver

    @property
    def num_ps(self) -> int:
        """The number of ps tasks."""
        return self._ps.num_ps

    @property
    def cluster_coordinator(self) -> ClusterCoordinator | None:
        """The `ClusterCoordinator` made for this strategy, if any."""
        return self._coordinator

    def __repr__(self) -> str:
        return f"ParameterServerStrategy(workers={self._spec.num_tasks('worker')}, ps={self.num_ps})"

    def _step_outside_run(self, optimizer: torch.optim.Optimizer) -> None:
        raise RuntimeError(_STEP_ON_THE_COORDINATOR)

    # ------------------------------------------------------------------ variables
    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        self._place_on_ps(module, name, param, "parameter")
        return None

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        self._place_on_ps(module, name, buffer, "buffer")
        return None

    def _place_on_ps(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, kind: str) -> None:
        with self._lock:
            if id(tensor) in self._registry and self._registry[id(tensor)][0]() is tensor:
                return  # shared (tied) weights: one variable
            handle = self._handle(f"{type(module).__name__}.{name}", tensor, kind)
            if handle.shards and isinstance(module, torch.nn.Embedding) and name == "weight":
                handle = dataclasses.replace(handle, kind="embedding")  # workers read it by rows
            self._ps.create([handle], [tensor.detach()])
            self._registry[id(tensor)] = (weakref.ref(tensor), handle)
            self._versions[handle.name] = tensor._version
        if not getattr(module, "_phalanx_ps_hooks", False):
            module.register_forward_pre_hook(_refresh_before_forward)
            module.register_forward_hook(_after_forward, always_call=True)
            module.register_state_dict_pre_hook(_refresh_before_state_dict)
            module._phalanx_ps_hooks = True  # type: ignore[assignment]

    def _handle(self, name: str, tensor: torch.Tensor, kind: str) -> VariableHandle:
        """The next variable's place: the next ps task, round-robin; a parameter the
        partitioner splits gets one shard per ps task in turn."""

        def place(shape: tuple[int, ...], label: str) -> VariableHandle:
            handle = VariableHandle(
                name=f"{self._count}/{label}",
                ps=self._count % self.num_ps,
                shape=shape,
                dtype=str(tensor.dtype),
                kind=kind,
                requires_grad=bool(tensor.requires_grad),
            )
            self._count += 1
            return handle

        shards = 1
        if self._partitioner is not None and kind == "parameter" and tensor.dim() >= 1:
            shards = int(self._partitioner(tuple(tensor.shape), tensor.dtype)[0])
        if shards <= 1:
            return place(tuple(tensor.shape), name)
        rest = tuple(tensor.shape[1:])
        parts = tuple(
            place((stop - start, *rest), f"{name}/part_{i}")
            for i, (start, stop) in enumerate(shard_rows(tensor.shape[0], shards))
        )
        whole = f"{parts[0].name}/whole"
        return dataclasses.replace(parts[0], name=whole, shape=tuple(tensor.shape), shards=parts)

    def _live(self) -> list[tuple[torch.Tensor, VariableHandle]]:
        with self._lock:
            out = []
            for key, (ref, handle) in list(self._registry.items()):
                tensor = ref()
                if tensor is None:
                    del self._registry[key]
                else:
                    out.append((tensor, handle))
            return out

    def _mark_stale(self) -> None:
        self._stale = True

    def _refresh(self) -> None:
        """Reads every variable into the coordinator's copies if workers may have changed them."""
        if not self._stale:
            return
        with self._lock:
            if self._coordinator is None or self._coordinator._queue.pending == 0:
                self._stale = False
            pairs = self._live()
            if not pairs:
                return
            values = self._ps.read([h for _, h in pairs])
            with torch.no_grad():
                for (tensor, handle), value in zip(pairs, values, strict=True):
                    tensor.copy_(value)
                    self._versions[handle.name] = tensor._version

    def _push_coordinator_writes(self) -> None:
        """Sends what the coordinator wrote into its copies to the ps tasks (before scheduling)."""
        with self._lock:
            changed = [(t, h) for t, h in self._live() if t._version != self._versions.get(h.name)]
            if changed:
                self._ps.write("assign", [h for _, h in changed], [t.detach() for t, _ in changed])
                for tensor, handle in changed:
                    self._versions[handle.name] = tensor._version

    # ------------------------------------------------------------------ scheduling
    def _connect_workers(self) -> list[RemoteWorker]:
        from phalanx.ps.coordinator.remote_worker import RemoteWorker

        return [RemoteWorker(i, self._client("worker", i)) for i in range(self._spec.num_tasks("worker"))]

    def _pickle_closure(self, closure: Closure) -> bytes:
        return dumps((closure.fn, closure.args, closure.kwargs), self._by_reference)

    def _by_reference(self, obj: Any) -> Any:
        if isinstance(obj, torch.optim.Optimizer):
            self._adopt_optimizer(obj)
            return NotImplemented
        if isinstance(obj, torch.Tensor):
            entry = self._registry.get(id(obj))
            if entry is not None and entry[0]() is obj:
                return worker_lib._worker_variable, (entry[1],)
            return NotImplemented
        if obj is self:
            return worker_lib._worker_strategy, ()
        if obj is self._coordinator:
            raise TypeError(
                "A scheduled function uses the ClusterCoordinator, which exists on the chief only. "
                "HINT: schedule functions from the training loop, not from inside another function."
            )
        return NotImplemented

    # ------------------------------------------------------------------ optimizer state
    def _optimizer_handles(self, optimizer: torch.optim.Optimizer) -> list[list[VariableHandle]]:
        groups = []
        for group in optimizer.param_groups:
            handles = []
            for p in group["params"]:
                entry = self._registry.get(id(p))
                if entry is None or entry[0]() is not p:
                    raise ValueError(
                        "An optimizer used in a scheduled function holds a tensor that was not created in "
                        f"strategy.scope() (shape {tuple(p.shape)}). HINT: create the model in the scope."
                    )
                handles.append(entry[1])
            groups.append(handles)
        return groups

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """First sight of an optimizer a scheduled function uses: its state moves to the ps
        tasks (a checkpoint loaded before training), and its ``state_dict`` /
        ``load_state_dict`` read and write the ps tasks' state from now on."""
        with self._lock:
            if getattr(optimizer, "_phalanx_ps_adopted", False):
                return
            optimizer._phalanx_ps_adopted = True  # type: ignore[attr-defined]
            if optimizer.state:
                self._push_optimizer_state(optimizer)
            optimizer.register_state_dict_post_hook(_optimizer_state_from_ps)
            optimizer.register_load_state_dict_post_hook(_optimizer_state_to_ps)

    def _optimizer_key(self, optimizer: torch.optim.Optimizer) -> tuple[str, list[list[VariableHandle]]]:
        groups = self._optimizer_handles(optimizer)
        return worker_lib._optimizer_key(optimizer, groups), groups

    def _push_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        key, groups = self._optimizer_key(optimizer)
        hyper = [worker_lib._hyperparameters(g) for g in optimizer.param_groups]
        self._ps.create_optimizer(key, type(optimizer), list(zip(groups, hyper, strict=True)))
        states: list[dict[str, Any]] = [{"state": {}, "groups": hyper} for _ in range(self.num_ps)]
        for group, handles in zip(optimizer.param_groups, groups, strict=True):
            for p, handle in zip(group["params"], handles, strict=True):
                if p in optimizer.state:
                    state = dict(optimizer.state[p])
                    parts = sharding.split_state(handle, state) if handle.shards else [state]
                    for shard, part in zip(handle.physical(), parts, strict=True):
                        states[shard.ps]["state"][shard.name] = part
        self._ps.load_optimizer_state(key, states)
        optimizer.state.clear()  # it lives on the ps tasks; functions must not carry it

    def _pull_optimizer_state(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        key, groups = self._optimizer_key(optimizer)
        try:
            per_ps = self._ps.optimizer_state(key)
        except Exception as exc:
            if "KeyError" not in f"{type(exc).__name__} {exc}":
                raise
            return  # it never stepped: no state yet
        index = 0
        for handles in groups:
            for handle in handles:
                parts = [per_ps[p.ps]["state"].get(p.name) or {} for p in handle.physical()]
                entry = sharding.join_state(handle, parts) if handle.shards else parts[0]
                if entry:
                    state_dict["state"][index] = entry
                index += 1

    def close(self) -> None:
        """Stops the coordinator's threads and closes the connections (idempotent)."""
        if self._coordinator is not None:
            self._coordinator.shutdown()
        self._ps.close()


def _owner(module: torch.nn.Module) -> ParameterServerStrategy | None:
    for strategy in list(_coordinators.values()):
        with strategy._lock:
            if any(t is not None and id(t) in strategy._registry for t in module._parameters.values()):
                return strategy
            if any(t is not None and id(t) in strategy._registry for t in module._buffers.values()):
                return strategy
    return None


def _refresh_before_forward(module: torch.nn.Module, args: Any) -> None:
    depth = getattr(_forward_depth, "value", 0)
    _forward_depth.value = depth + 1
    if depth == 0 and _coordinators:
        strategy = _owner(module)
        if strategy is not None:
            strategy._refresh()


def _after_forward(module: torch.nn.Module, args: Any, output: Any) -> None:
    _forward_depth.value = max(getattr(_forward_depth, "value", 1) - 1, 0)


def _optimizer_strategy(optimizer: torch.optim.Optimizer) -> ParameterServerStrategy | None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for strategy in list(_coordinators.values()):
        if params and id(params[0]) in strategy._registry:
            return strategy
    return None


def _optimizer_state_from_ps(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    strategy = _optimizer_strategy(optimizer)
    if strategy is not None:
        strategy._pull_optimizer_state(optimizer, state_dict)
    return state_dict


def _optimizer_state_to_ps(optimizer: torch.optim.Optimizer) -> None:
    strategy = _optimizer_strategy(optimizer)
    if strategy is not None and optimizer.state:
        strategy._push_optimizer_state(optimizer)


def _refresh_before_state_dict(module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
    if _coordinators:
        strategy = _owner(module)
        if strategy is not None:
            strategy._refresh()
