"""The tasks a launcher starts: each one's name and environment (TF_CONFIG + torchrun's)."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.cluster._ports import free_ports
from phalanx.cluster._roles import TRAINER_JOBS, split_address, trainer_tasks
from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.validation import parse_tf_config, validate_cluster

__all__ = [
    "TORCHRUN_VARS",
    "NodeTasks",
    "PlannedTask",
    "cluster_from",
    "local_cluster",
    "plan_tasks",
    "select_node_tasks",
]

# torchrun's variables: never inherited from the launcher's own environment (a ps task must
# not see a stale RANK), set afresh for chief and worker tasks.
TORCHRUN_VARS = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "ROLE_NAME",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
    }
)
NodeTasks = str | Sequence[tuple[str, int]] | None


@dataclass(frozen=True)
class PlannedTask:
    """One task to start: its job, index and the environment variables it gets."""

    job: str
    index: int
    env: dict[str, str] = field(default_factory=dict)
    coordinated: bool = False  # a parameter-server cluster: the chief alone runs the program

    @property
    def name(self) -> str:
        """``job-index``, the prefix of its output lines."""
        return f"{self.job}-{self.index}"

    @property
    def is_trainer(self) -> bool:
        """Whether the job ends when it does: chief and worker tasks; in a parameter-server
        cluster (a chief and ps tasks) only the chief, whose workers serve it like the ps."""
        if self.coordinated:
            return self.job == "chief"
        return self.job in TRAINER_JOBS


def local_cluster(workers: int, ps: int = 0, chief: bool = False, host: str = "127.0.0.1") -> ClusterSpec:
    """A cluster on ``host`` with free ports: an optional chief, ``workers`` workers, ``ps`` ps.

    Raises:
        ValueError: A negative count, or no chief and no worker.
    """
    if workers < 0 or ps < 0 or workers + int(chief) < 1:
        raise ValueError(
            "A cluster needs at least one chief or worker task and no negative counts. "
            f"Received: workers={workers}, ps={ps}, chief={chief}. HINT: workers=2."
        )
    ports = iter(free_ports(int(chief) + workers + ps, host))
    sizes = {"chief": int(chief), "worker": workers, "ps": ps}
    return ClusterSpec({job: [f"{host}:{next(ports)}" for _ in range(n)] for job, n in sizes.items() if n})


def plan_tasks(spec: ClusterSpec, tasks: Sequence[tuple[str, int]]) -> list[PlannedTask]:
    """The environment of each of ``tasks`` (those that run on this machine) in ``spec``.

    Every task gets ``TF_CONFIG`` (the whole cluster and its own task). Chief and worker tasks
    also get torchrun's variables: ``RANK``/``WORLD_SIZE`` among all chief+worker tasks (chief
    first), ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` among those in ``tasks``, and
    ``MASTER_ADDR``/``MASTER_PORT`` = the chief's (else ``worker:0``'s) address, the same
    rendezvous address that ``ClusterResolver.chief_address()`` gives.
    """
    trainers = trainer_tasks(spec)
    local_trainers = [t for t in tasks if t in trainers]
    cluster = spec.as_dict()
    coordinated = "chief" in spec.jobs and "ps" in spec.jobs
    planned = []
    for job, index in tasks:
        env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}
        if (job, index) in trainers:
            host, port = split_address(spec.task_address(*trainers[0]))
            env.update(
                RANK=str(trainers.index((job, index))),
                WORLD_SIZE=str(len(trainers)),
                LOCAL_RANK=str(local_trainers.index((job, index))),
                LOCAL_WORLD_SIZE=str(len(local_trainers)),
                MASTER_ADDR=host.strip("[]"),
                MASTER_PORT=str(port),
            )
        planned.append(PlannedTask(job, index, env, coordinated))
    return planned


def cluster_from(cluster: ClusterSpec | Mapping[str, Any] | str, source: str = "--tf-config") -> ClusterSpec:
    """A validated cluster from a ClusterSpec, a dict, or JSON (a whole TF_CONFIG or its cluster).

    Raises:
        ValueError: Malformed JSON or a cluster that breaks a validation rule.
    """
    if isinstance(cluster, str):
        try:
            data = json.loads(cluster)
        except json.JSONDecodeError:
            data = None  # parse_tf_config below raises with the position
        if isinstance(data, dict) and "cluster" not in data:
            cluster = json.dumps({"cluster": data})
        spec = parse_tf_config(cluster, source).cluster
    else:
        spec = ClusterSpec(cluster)
    validate_cluster(spec, source)
    return spec


def select_node_tasks(spec: ClusterSpec, node_tasks: NodeTasks = None) -> list[tuple[str, int]]:
    """The tasks of ``spec`` that run on this node.

    Args:
        spec: The whole cluster.
        node_tasks: A host name (tasks whose address has this host), explicit
            ``[(job, index), ...]``, or None for this machine's host name.

    Raises:
        ValueError: No task matches the host, or a named task is not in the cluster.
    """
    if node_tasks is None or isinstance(node_tasks, str):
        names = {node_tasks} if node_tasks else _own_host_names()
        chosen = [
            (job, i)
            for job in spec.jobs
            for i in spec.task_indices(job)
            if split_address(spec.task_address(job, i))[0] in names
        ]
        if not chosen:
            raise ValueError(
                f"No task of the cluster runs on node {' or '.join(sorted(names))!r}: the cluster's hosts "
                f"are {_hosts(spec)}. HINT: pass the host name as the cluster spells it (--node HOST)."
            )
        return chosen
    chosen = [(job, int(index)) for job, index in node_tasks]
    for job, index in chosen:
        spec.task_address(job, index)  # raises, naming the job's tasks
    if len(set(chosen)) != len(chosen):
        raise ValueError(f"node_tasks names a task twice. Received: {chosen}.")
    return chosen


def _hosts(spec: ClusterSpec) -> list[str]:
    addresses = [spec.task_address(job, i) for job in spec.jobs for i in spec.task_indices(job)]
    return sorted({split_address(a)[0] for a in addresses})


def _own_host_names() -> set[str]:
    name = socket.gethostname()
    return {name, name.split(".")[0]}
