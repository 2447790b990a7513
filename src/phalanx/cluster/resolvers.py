"""Cluster resolvers: where the tasks are and who this process is (tf.distribute.cluster_resolver).

Environment variables are read when a resolver is created, never at import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.validation import parse_tf_config, validate_cluster

__all__ = [
    "ClusterResolver",
    "SimpleClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "expand_hostlist",
    "resolve_cluster",
]


class ClusterResolver:
    """Base: a cluster spec, this task's type and index, and what follows from them.

    The chief is the ``chief`` task if the cluster has one, else ``worker:0``. Workers are
    the chief and worker tasks; ``worker_index`` (= torch.distributed rank) is 0 for the chief,
    and workers follow in index order.
    """

    task_type: str | None
    task_id: int | None
    rpc_layer: str | None = None
    environment: str = ""

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task (this one by default), with the rpc layer prefix if any."""
        task_type = task_type or self.task_type
        task_id = self.task_id if task_id is None else task_id
        if not task_type or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """Local accelerators: {"GPU": n} when CUDA devices are visible, else {}."""
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return {"GPU": count} if count else {}

    def _workers(self) -> list[tuple[str, int]]:
        spec = self.cluster_spec()
        tasks = [("chief", i) for i in spec.task_indices("chief")] if "chief" in spec.jobs else []
        return tasks + ([("worker", i) for i in spec.task_indices("worker")] if "worker" in spec.jobs else [])

    @property
    def num_workers(self) -> int:
        """Chief and worker tasks (at least 1)."""
        return max(1, len(self._workers()))

    @property
    def worker_index(self) -> int:
        """This task's rank among the workers (0 for the chief)."""
        workers = self._workers()
        if not workers or self.task_type is None:
            return 0
        return workers.index((self.task_type, int(self.task_id or 0)))

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief."""
        workers = self._workers()
        return not workers or self.task_type is None or workers[0] == (self.task_type, self.task_id)

    def task_name(self, worker_index: int) -> str:
        """``job:index`` of the worker with this rank (for messages)."""
        workers = self._workers()
        if not workers:
            return f"worker:{worker_index}"
        job, index = workers[worker_index]
        return f"{job}:{index} ({self.cluster_spec().task_address(job, index)})"

    def chief_address(self) -> str:
        """host:port of the chief (the torch.distributed store)."""
        workers = self._workers()
        if not workers:
            return "127.0.0.1:0"
        return self.cluster_spec().task_address(*workers[0])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(task={self.task_type}:{self.task_id}, cluster={self.cluster_spec()!r})"


class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit values."""

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Any],
        master: str = "",
        task_type: str | None = None,
        task_id: int | None = None,
        environment: str = "",
        num_accelerators: dict[str, int] | None = None,
        rpc_layer: str | None = None,
    ) -> None:
        self._spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type, self.task_id = task_type, task_id
        self.environment, self.rpc_layer = environment, rpc_layer
        self._accelerators = num_accelerators
        validate_cluster(self._spec, task_type if self._spec else None, task_id)

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        if task_type is None and task_id is None and self._master:
            return self._master
        return super().master(task_type, task_id, rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        if self._accelerators is not None:
            return dict(self._accelerators)
        return super().num_accelerators(task_type, task_id, config_proto)


class TFConfigClusterResolver(ClusterResolver):
    """Reads the ``TF_CONFIG`` environment variable (as Kubernetes / Kubeflow TFJob set it).

    Raises:
        ValueError: Malformed JSON, missing ``cluster``/``task``, unknown task type, index out
            of range, duplicate addresses, more than one chief (each message names the field).
    """

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        tf_config: str | None = None,
    ) -> None:
        text = tf_config if tf_config is not None else os.environ.get("TF_CONFIG", "")
        config = parse_tf_config(text) if text.strip() else {}
        cluster = config.get("cluster", {})
        if config and "cluster" not in config:
            raise ValueError('TF_CONFIG has no \'cluster\' field. HINT: {"cluster": {...}, "task": {...}}.')
        if not isinstance(cluster, Mapping):
            raise ValueError(f"TF_CONFIG 'cluster' must be an object of jobs. Received: {cluster!r}.")
        self._spec = ClusterSpec(cluster)
        task = config.get("task", {})
        if not isinstance(task, Mapping):
            raise ValueError(
                f"TF_CONFIG 'task' must be an object with 'type' and 'index'. Received: {task!r}."
            )
        total = sum(self._spec.num_tasks(j) for j in self._spec.jobs)
        if total > 1 and not task and task_type is None:
            raise ValueError(
                "TF_CONFIG has a cluster of several tasks but no 'task' field saying which one this is."
            )
        self.task_type = task_type if task_type is not None else task.get("type")
        self.task_id = task_id if task_id is not None else task.get("index", 0 if self.task_type else None)
        self.rpc_layer = rpc_layer if rpc_layer is not None else config.get("rpc_layer")
        self.environment = environment if environment is not None else config.get("environment", "")
        if self._spec:
            validate_cluster(self._spec, self.task_type, self.task_id)

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


class TorchrunClusterResolver(ClusterResolver):
    """torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

    Every rank is a ``worker`` task; only rank 0's address (MASTER_ADDR:MASTER_PORT) is known,
    so the others are recorded as ``MASTER_ADDR:<port+rank>`` placeholders (used in messages
    only: torch.distributed needs just the master).

    Raises:
        ValueError: A variable is missing or not an integer, or RANK is out of range.
    """

    def __init__(self) -> None:
        env = os.environ
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        except KeyError as exc:
            raise ValueError(f"torchrun environment is incomplete: {exc.args[0]} is not set.") from None
        except ValueError:
            raise ValueError(
                "RANK and WORLD_SIZE must be integers. "
                f"Received: {env.get('RANK')!r}, {env.get('WORLD_SIZE')!r}."
            ) from None
        if not 0 <= rank < world:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE={world}). Received: {rank}.")
        host, port = env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", "29500"))
        self._spec = ClusterSpec({"worker": [f"{host}:{port + i}" for i in range(world)]})
        self.task_type, self.task_id = "worker", rank
        self.local_rank = int(env.get("LOCAL_RANK", "0"))

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM host-list expansion: ``"node[1-3,5],gpu-[01-02]"`` -> every host, zero-padding kept.

    Raises:
        ValueError: Unbalanced brackets or a bad range.
    """
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", hostlist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if "[" in part and not match:
            raise ValueError(f"Bad SLURM host list {hostlist!r}: unbalanced brackets in {part!r}.")
        if not match:
            hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ValueError(f"Bad SLURM host range {item!r} in {hostlist!r}.")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
    return hosts


def _expand_tasks_per_node(text: str) -> list[int]:
    counts: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"Bad SLURM tasks-per-node value {text!r}.")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SlurmClusterResolver(ClusterResolver):
    """A cluster from SLURM's environment: one task per SLURM task, ports ``port_base + local index``.

    Raises:
        ValueError: SLURM variables missing or malformed.
    """

    def __init__(
        self,
        jobs: dict[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: dict[str, int] | None = None,
        auto_set_gpu: bool = False,
        rpc_layer: str = "grpc",
    ) -> None:
        env = os.environ
        try:
            rank = int(env["SLURM_PROCID"])
            nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        except KeyError as exc:
            raise ValueError(f"SLURM environment is incomplete: {exc.args[0]} is not set.") from None
        hosts = expand_hostlist(nodelist)
        per_node_text = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_NTASKS_PER_NODE") or "1"
        per_node = _expand_tasks_per_node(per_node_text)
        if len(per_node) == 1:
            per_node = per_node * len(hosts)
        addresses = [f"{h}:{port_base + i}" for h, n in zip(hosts, per_node, strict=False) for i in range(n)]
        jobs = jobs or {"worker": len(addresses)}
        if sum(jobs.values()) != len(addresses):
            raise ValueError(
                f"SLURM runs {len(addresses)} tasks but jobs ask for {sum(jobs.values())}: {jobs}."
            )
        cluster: dict[str, list[str]] = {}
        start = 0
        for job, count in jobs.items():
            cluster[job] = addresses[start : start + count]
            if start <= rank < start + count:
                self.task_type, self.task_id = job, rank - start
            start += count
        self._spec = ClusterSpec(cluster)
        self.rpc_layer = rpc_layer
        self._gpus_per_node = gpus_per_node

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        if self._gpus_per_node is not None:
            return {"GPU": self._gpus_per_node} if self._gpus_per_node else {}
        return super().num_accelerators(task_type, task_id, config_proto)


def resolve_cluster() -> ClusterResolver:
    """TF_CONFIG if set, else torchrun's RANK/WORLD_SIZE, else SLURM, else a single task."""
    env = os.environ
    if env.get("TF_CONFIG", "").strip():
        return TFConfigClusterResolver()
    if "RANK" in env and "WORLD_SIZE" in env:
        return TorchrunClusterResolver()
    if "SLURM_PROCID" in env and ("SLURM_STEP_NODELIST" in env or "SLURM_JOB_NODELIST" in env):
        return SlurmClusterResolver()
    return SimpleClusterResolver({})
