"""The chief: what ParameterServerStrategy delegates to, and what ClusterCoordinator talks to.

`phalanx.strategies.parameter_server.ParameterServerStrategy` is a thin class over a `Chief`:
its connection to the ps tasks, the chief's copies of the variables (`LocalCopies`), the
optimizers' state (`OptimizerStates`) and the rules that send a closure to a worker
(`phalanx.ps.pickling`).

`ClusterCoordinator` uses the chief through these methods only, in this order:

=========================  ===========================================================
``Chief.of(strategy)``     finds the strategy's chief (None: not a ParameterServerStrategy)
``connect_workers(d)``     once: a connection per worker task, with deadlines ``d``
``attach(...)``            once: the coordinator and its count of pending closures
``before_schedule()``      ``schedule``: the chief's writes go to the ps tasks first
``after_schedule()``       ``schedule``: a closure is queued, the variables may change
``pickle_closure(c)``      a worker thread, before it sends closure ``c``
``take_buffers(c)``        a worker thread, before it takes a closure's result: adds the
                           closure's buffer changes to the ps tasks
``after_closure()``        a worker thread, once a closure finished
``fence(s, w, r)``         a worker thread, before a run given up on runs again
``refresh()``              ``join`` (once every closure finished): the copies take the ps
                           tasks' values
=========================  ===========================================================
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from phalanx.cluster.resolvers import ClusterResolver
from phalanx.ps import pickling
from phalanx.ps.coordinator.closure import Closure
from phalanx.ps.coordinator.deadlines import Deadlines, ps_call_timeout
from phalanx.ps.coordinator.local_copies import LocalCopies
from phalanx.ps.coordinator.optimizer_state import OptimizerStates
from phalanx.ps.coordinator.remote_worker import RemoteWorker
from phalanx.ps.pickle_cache import PickleCache, pickle_cache_enabled
from phalanx.ps.transport import RpcClient
from phalanx.ps.variables import BufferChanges, PSClient, VariableHandle
from phalanx.security.token import cluster_token

__all__ = ["DEFAULT_CONNECT_TIMEOUT", "Chief"]

DEFAULT_CONNECT_TIMEOUT = 120.0
log = logging.getLogger("phalanx")
_chiefs: weakref.WeakSet[Chief] = weakref.WeakSet()


def _check_cluster(resolver: ClusterResolver) -> None:
    spec = resolver.cluster_spec()
    missing = [job for job in ("ps", "worker") if job not in spec.jobs or spec.num_tasks(job) == 0]
    if missing:
        raise ValueError(
            f"ParameterServerStrategy needs 'ps' and 'worker' jobs in the cluster; {missing} "
            f"missing. Received: {spec.as_dict()!r}. HINT: phalanx launch --chief --workers 2 --ps 1 "
            "script.py."
        )
    if resolver.task_type is None:
        _check_client(spec.as_dict())
    elif resolver.task_type != "chief":
        raise ValueError(
            "ParameterServerStrategy is created by the coordinator, the 'chief' task, or by a "
            "client process that is not a task of the cluster. Received: task "
            f"{resolver.task_type}:{resolver.task_id}. HINT: ps tasks (and workers driven by a "
            "coordinator) run phalanx.Server(cluster_resolver.cluster_spec(), job_name, "
            "task_index).join(); a worker that runs its own training loop (between-graph "
            "replication) uses phalanx.train.replica_device_setter and "
            "phalanx.train.MonitoredTrainingSession."
        )


def _check_client(cluster: dict[str, Any]) -> None:
    """A process outside the cluster (TF1's client, with the session target of a worker)
    coordinates like the chief, in a cluster that has no chief task of its own."""
    if "chief" in cluster:
        raise ValueError(
            "A process outside the cluster (no task_type) coordinates only a cluster without a "
            "'chief' task: with one, that task is the coordinator, and two coordinators would "
            f"initialise the variables twice. Received: cluster {cluster!r} and no task. HINT: "
            "run this program as the chief task (TF_CONFIG task {'type': 'chief', 'index': 0}), "
            "or drop 'chief' from the cluster so that this client drives the workers."
        )


class Chief:
    """The coordinator's side of a parameter-server cluster (see the module docstring): the
    chief task's, or a client's that is not a task of the cluster (TF1's session target).

    Args:
        strategy: The ParameterServerStrategy that owns this chief (it travels to workers as
            their strategy).
        resolver: The cluster; it needs ``ps`` and ``worker`` jobs, and this process is its
            chief task or a client outside it (``task_type`` None, no chief task in the cluster).
        partitioner: Splits parameters over the ps tasks (`phalanx.partitioners`), or None.
        connect_timeout: Seconds to wait for every ps task to answer (blocks).

    Raises:
        ValueError: The cluster is unusable, or ``PHALANX_CLUSTER_TOKEN`` is not set.
        TaskUnavailableError: A ps task did not answer within ``connect_timeout``.
    """

    def __init__(
        self,
        strategy: object,
        resolver: ClusterResolver,
        partitioner: Any = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ) -> None:
        _check_cluster(resolver)
        self.strategy = strategy
        self._token = cluster_token()
        self._spec = resolver.cluster_spec()
        timeout = ps_call_timeout()
        clients = [self._client("ps", i, timeout) for i in range(self._spec.num_tasks("ps"))]
        for client in clients:
            client.wait_until_ready(connect_timeout)
        self._ps_clients = clients
        self.ps = PSClient(clients)
        self._coordinator: object | None = None
        self._closures_pending: Callable[[], int] = lambda: 0
        self.copies = LocalCopies(self.ps, partitioner, lambda: self._closures_pending())
        self.optimizers = OptimizerStates(self.ps, self.copies)
        # repeated schedules of one function are pickled once (`phalanx.ps.pickle_cache`)
        self._pickles = PickleCache() if pickle_cache_enabled() else None
        _chiefs.add(self)

    @classmethod
    def of(cls, strategy: object) -> Chief | None:
        """The chief of ``strategy``; None if it is not a ParameterServerStrategy."""
        return next((chief for chief in list(_chiefs) if chief.strategy is strategy), None)

    def _client(self, job: str, index: int, timeout: float = 60.0) -> RpcClient:
        address = self._spec.task_address(job, index)
        return RpcClient(address, self._token, name=f"{job}:{index} ({address})", timeout=timeout)

    @property
    def num_workers(self) -> int:
        """The number of worker tasks."""
        return self._spec.num_tasks("worker")

    @property
    def coordinator(self) -> object | None:
        """The attached `ClusterCoordinator`, if any."""
        return self._coordinator

    # ------------------------------------------------------------------ the strategy's side
    def place(self, module: torch.nn.Module, name: str, tensor: torch.Tensor, kind: str) -> None:
        """Creates a parameter or buffer made in ``strategy.scope()`` on the ps tasks (see
        `LocalCopies.place`)."""
        self.copies.place(module, name, tensor, kind)

    def handle_of(self, tensor: torch.Tensor) -> VariableHandle | None:
        """The handle of ``tensor`` if it is one of the chief's variables."""
        return self.copies.handle_of(tensor)

    def adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Moves ``optimizer``'s state to the ps tasks (see `OptimizerStates.adopt`)."""
        self.optimizers.adopt(optimizer)

    def close(self) -> None:
        """Closes the connections to the ps tasks."""
        if self._pickles is not None:
            self._pickles.clear()
        self.ps.close()

    # ------------------------------------------------------------------ the coordinator's side
    def connect_workers(self, deadlines: Deadlines | None = None) -> list[RemoteWorker]:
        """One connection per worker task, by index, with the coordinator's heartbeat and
        closure deadlines (default: `Deadlines.resolve()`); connecting does not block."""
        deadlines = deadlines or Deadlines.resolve()
        return [
            RemoteWorker.with_deadlines(
                i, self._client("worker", i), deadlines.heartbeat_timeout, deadlines.closure_timeout
            )
            for i in range(self.num_workers)
        ]

    def attach(self, coordinator: object, closures_pending: Callable[[], int]) -> None:
        """Makes ``coordinator`` this chief's coordinator; ``closures_pending()`` counts the
        closures it has queued or running.

        Raises:
            ValueError: A coordinator is attached already.
        """
        if self._coordinator is not None:
            raise ValueError(
                "This strategy already has a ClusterCoordinator. HINT: create one coordinator per "
                "strategy and reuse it (strategy.cluster_coordinator)."
            )
        self._coordinator, self._closures_pending = coordinator, closures_pending

    def before_schedule(self) -> None:
        """Sends what the chief wrote into its copies to the ps tasks (blocks)."""
        self.copies.push_writes()

    def after_schedule(self) -> None:
        """A closure was queued: the copies are stale until it finished."""
        self.copies.mark_stale()

    def pickle_closure(self, closure: Closure) -> bytes:
        """The bytes a worker runs: ``closure``'s function and arguments, by reference where
        `phalanx.ps.pickling` says so.

        Raises:
            TypeError: The closure uses the ClusterCoordinator.
            Exception: Whatever pickling the function raises.
        """
        root = (closure.fn, closure.args, closure.kwargs)
        if self._pickles is None:
            return pickling.dumps_for_worker(root, self)
        return self._pickles.dumps(root, pickling.replace_for_worker(self))

    def fence(self, session: str, worker: int, run: int, timeout: float = 10.0) -> None:
        """Makes every ps task refuse what run ``run`` of ``worker`` still sends (see
        `phalanx.ps.coordinator.fencing`); blocks up to ``timeout`` seconds per ps task. A ps
        task that does not answer is logged: it cannot be reached by the worker either."""
        header = {"session": session, "worker": worker, "run": run}
        for client in self._ps_clients:
            try:
                client.call("fence", header, timeout=timeout)
            except Exception as exc:  # the run goes again all the same; say what may go twice
                log.warning("Could not fence run %d of worker:%d on %s: %s", run, worker, client.name, exc)

    def take_buffers(self, changes: BufferChanges) -> None:
        """Adds what a closure changed in module buffers to the ps tasks (blocks; untagged,
        so never fenced: only a result the coordinator takes gets here).

        Raises:
            TaskUnavailableError: A ps task that holds one of the buffers did not answer.
        """
        changes.apply(self.ps)

    def after_closure(self) -> None:
        """A closure finished (or failed): its worker may have changed the variables."""
        self.copies.mark_stale()

    def refresh(self) -> None:
        """Reads the variables into the chief's copies if closures may have changed them (blocks)."""
        self.copies.refresh()
