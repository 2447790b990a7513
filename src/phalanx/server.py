"""Server: what a worker or ps task of a parameter-server cluster runs (tf.distribute.Server).

    resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        server = phalanx.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                task_index=resolver.task_id)
        server.join()  # serves until the task is stopped

A ps task serves its variables and the optimizers that update them (a
`phalanx.ps.variable_store.store.VariableStore`); a worker task runs the functions the coordinator schedules
(a `phalanx.ps.worker.environment.WorkerEnvironment`). Both listen on their address in the
cluster spec and accept only peers that prove, in a mutual TLS handshake, that they hold
``PHALANX_CLUSTER_TOKEN`` (`phalanx.security.channels`; docs/security.md).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from phalanx.cluster.cluster_def import ServerDef
from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.ps.coordinator.fencing import Fences, TaggedRpcClient
from phalanx.ps.rpc.common import DATA_PATH_METHODS
from phalanx.ps.rpc.service import RpcServer
from phalanx.ps.variable_store.store import VariableStore
from phalanx.ps.variables import PSClient
from phalanx.ps.worker.environment import WorkerEnvironment
from phalanx.ps.worker.running import RunningClosure
from phalanx.security.token import cluster_token
from phalanx.status.counters import COUNTERS
from phalanx.status.taking_part import TaskStatus, join_status
from phalanx.strategies.parameter_server_worker import WorkerStrategy

__all__ = ["Server"]


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"A task address must be host:port. Received: {address!r}.")
    return host.strip("[]"), int(port)


class Server:
    """Serves one ps or worker task of a parameter-server cluster.

    Args:
        server_or_cluster_def: A `ClusterSpec` or its dict (job -> addresses).
        job_name: "ps" or "worker".
        task_index: The task's index in its job.
        protocol: "grpc" (the only transport).
        start: Start serving now (else call `start`).

    Raises:
        ValueError: An unknown job or task, another protocol, an address that cannot be
            served, or ``PHALANX_CLUSTER_TOKEN`` unset.
    """

    def __init__(
        self,
        server_or_cluster_def: ClusterSpec | Mapping[str, Any],
        job_name: str,
        task_index: int = 0,
        protocol: str | None = "grpc",
        start: bool = True,
    ) -> None:
        spec = server_or_cluster_def
        if not isinstance(spec, ClusterSpec):
            spec = ClusterSpec(dict(spec))
        if protocol not in (None, "grpc"):
            raise ValueError(
                f"Server speaks gRPC only. Received: protocol={protocol!r}. HINT: protocol='grpc'."
            )
        if job_name not in ("ps", "worker"):
            raise ValueError(
                f"A Server runs a 'ps' or a 'worker' task. Received: job_name={job_name!r}. HINT: the "
                "chief runs the training program with ParameterServerStrategy and needs no Server."
            )
        self._spec, self._job, self._index = spec, job_name, task_index
        address = spec.task_address(job_name, task_index)
        self.name = f"{job_name}:{task_index} ({address})"
        host, port = _split(address)
        self._server = RpcServer(
            host,
            port,
            cluster_token(),
            self._handlers(),
            name=self.name,
            data_methods=sorted(DATA_PATH_METHODS),
        )
        self._stopped = threading.Event()
        self._started = False
        self._status: TaskStatus | None = None
        if start:
            self.start()

    def _handlers(self) -> dict[str, Any]:
        if self._job == "ps":
            handlers = Fences(self.name).guard(VariableStore(self.name).handlers())
        else:
            handlers = self._worker_environment().handlers()
        return {method: _counted(handler) for method, handler in handlers.items()}

    def _worker_environment(self) -> WorkerEnvironment:
        if "ps" not in self._spec.jobs:
            raise ValueError(f"A worker needs the cluster's 'ps' job. Received: {self._spec.as_dict()!r}.")
        token = cluster_token()
        current = RunningClosure()  # its calls carry the tag of the function run in progress
        clients = []
        for i in range(self._spec.num_tasks("ps")):
            address = self._spec.task_address("ps", i)
            clients.append(TaggedRpcClient(address, token, name=f"ps:{i} ({address})", tag=current.tag))
        workers = self._spec.num_tasks("worker")
        return WorkerEnvironment(
            PSClient(clients), self._index, workers, current, make_strategy=WorkerStrategy
        )

    @staticmethod
    def create_local_server(config: Any = None, start: bool = True) -> Server:
        """A one-task cluster on this machine: a ps task on a free port of 127.0.0.1.

        TF's local server is a single ``localhost`` job; phalanx's tasks are ps or worker
        tasks, and a lone worker has no variables to use, so the local server is a ps task
        (a client reaches it at `target`). ``PHALANX_CLUSTER_TOKEN`` must be set, as for any
        `Server`.

        Raises:
            ValueError: ``config`` is given (TF's session ConfigProto: PyTorch has none).
        """
        if config is not None:
            raise ValueError(
                "Server.create_local_server takes no config: TF's ConfigProto configures a "
                "TensorFlow session, which PyTorch does not have. HINT: pass config=None."
            )
        from phalanx.cluster._ports import free_ports

        address = f"127.0.0.1:{free_ports(1)[0]}"
        return Server(ClusterSpec({"ps": [address]}), job_name="ps", task_index=0, start=start)

    @property
    def server_def(self) -> ServerDef:
        """What this server serves, as TF's ServerDef fields (`phalanx.cluster.cluster_def`)."""
        _, port = _split(self._spec.task_address(self._job, self._index))
        return ServerDef(self._spec.as_cluster_def(), self._job, self._index, "grpc", port)

    @property
    def target(self) -> str:
        """``grpc://host:port`` of this task."""
        return f"grpc://{self._spec.task_address(self._job, self._index)}"

    def start(self) -> None:
        """Starts serving (idempotent), and reporting to the status page when it is on."""
        if not self._started:
            self._server.start()
            self._started = True
            self._status = join_status(f"{self._job}:{self._index}", is_chief=False)
            if self._status is not None:
                self._status.running()

    def join(self, timeout: float | None = None) -> bool:
        """Blocks until the server is stopped (`stop`, or the task is terminated); False
        after ``timeout`` seconds."""
        return self._stopped.wait(timeout)

    def stop(self) -> None:
        """Stops serving; `join` returns."""
        self._server.stop()
        self._stopped.set()
        if self._status is not None:
            self._status.close()


def _counted(handler: Any) -> Any:
    """``handler``, counting each request it serves (the status page's ps load)."""

    def served(header: Any, tensors: Any) -> Any:
        COUNTERS.served()
        return handler(header, tensors)

    return served
