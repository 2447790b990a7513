"""SlurmClusterResolver: the cluster from SLURM's environment (one task per SLURM task)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers._slurm_lists import expand_hostlist, expand_tasks_per_node
from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver
from phalanx.cluster.validation import validate

__all__ = ["SlurmClusterResolver", "expand_hostlist", "expand_tasks_per_node"]

_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
_HINT = "HINT: run the program under srun (one SLURM task per phalanx task)."


class SlurmClusterResolver(ClusterResolver):
    """A cluster from SLURM's variables, read when the resolver is created.

    Nodes come from ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), tasks per node from
    ``SLURM_STEP_TASKS_PER_NODE`` (else ``SLURM_TASKS_PER_NODE``, else
    ``SLURM_NTASKS_PER_NODE``), this process from ``SLURM_PROCID``. Tasks are laid out as
    SLURM's default *block* distribution places them: ranks fill the first node, then the
    next, in node-list order; the ``k``-th task on a node listens on ``port_base + k``. When
    ``SLURM_LOCALID``/``SLURMD_NODENAME`` are set they are checked against that layout. The
    ranks are split among ``jobs`` in sorted job-name order (as TF: chief, evaluator, ps,
    worker), so a chief gets rank 0.

    Args:
        jobs: ``{job: number of tasks}``; default every SLURM task is a ``worker``.
        port_base: Port of the first task on each node.
        gpus_per_node: GPUs on each node; default this machine's CUDA device count.
        gpus_per_task: GPUs for each task; default ``gpus_per_node // max tasks per node``.
        tasks_per_node: Overrides SLURM's: one int for every node, or ``{host: count}``.
        auto_set_gpu: Set ``CUDA_VISIBLE_DEVICES`` to this task's GPUs now (TF's default is
            True; phalanx leaves the environment alone unless asked).
        rpc_layer: Protocol prefix for ``master()``.

    Raises:
        ValueError: A SLURM variable missing or malformed, ``jobs`` asking for more tasks than
            SLURM runs, more GPUs asked than a node has, or a layout that SLURM contradicts.
    """

    source = "SLURM"

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int = 8888,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = False,
        rpc_layer: str | None = "grpc",
    ) -> None:
        env = os.environ
        rank = _int_var(env, "SLURM_PROCID")
        hosts = expand_hostlist(_first_var(env, _NODELIST_VARS))
        per_node = _tasks_per_node(env, hosts, tasks_per_node)
        layout = [(host, k) for host, count in zip(hosts, per_node, strict=True) for k in range(count)]
        jobs = dict(jobs) if jobs is not None else {"worker": len(layout)}
        cluster, (self.task_type, self.task_id) = _assign(jobs, layout, rank, port_base)
        self._spec = ClusterSpec(cluster)
        validate(self._spec, self.task_type, self.task_id, self.source)
        _check_placement(env, rank, layout)
        self._gpus = _task_gpus(layout[rank][1], max(per_node), gpus_per_node, gpus_per_task)
        self.rpc_layer = rpc_layer
        if auto_set_gpu:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self._gpus)

    def cluster_spec(self) -> ClusterSpec:
        """The cluster laid out from SLURM's node list (see the class doc)."""
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """This process's ``(task_type, task_id)`` (TF's SlurmClusterResolver method)."""
        return self.task_type, self.task_id

    @property
    def gpu_ids(self) -> list[int]:
        """The GPUs of this node that belong to this task (what ``auto_set_gpu`` exposes)."""
        return list(self._gpus)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``, or ``{}`` when tasks get no GPU."""
        return {"GPU": len(self._gpus)} if self._gpus else {}


def _first_var(env: Mapping[str, str], names: Sequence[str]) -> str:
    for name in names:
        if env.get(name, "").strip():
            return env[name]
    raise ValueError(f"SLURM's environment is incomplete: none of {', '.join(names)} is set. {_HINT}")


def _int_var(env: Mapping[str, str], name: str) -> int:
    text = _first_var(env, [name])
    if not text.strip().isdigit():
        raise ValueError(f"{name} must be a non-negative integer. Received: {name}={text!r}.")
    return int(text)


def _tasks_per_node(
    env: Mapping[str, str], hosts: list[str], given: int | Mapping[str, int] | None
) -> list[int]:
    if isinstance(given, Mapping):
        missing = [h for h in hosts if h not in given]
        if missing:
            raise ValueError(
                f"tasks_per_node has no count for node(s) {missing}. Received: {dict(given)}; "
                f"SLURM's nodes: {hosts}. HINT: give every node a count, or one int for all."
            )
        return [given[h] for h in hosts]
    counts = [given] if given is not None else expand_tasks_per_node(_first_var(env, _PER_NODE_VARS))
    if len(counts) == 1:
        counts = counts * len(hosts)
    if len(counts) != len(hosts) or any(c < 0 for c in counts):
        raise ValueError(
            f"SLURM's tasks per node {counts} do not match its {len(hosts)} node(s) {hosts}. "
            "HINT: check SLURM_STEP_TASKS_PER_NODE against SLURM_STEP_NODELIST, or pass tasks_per_node."
        )
    return counts


def _assign(
    jobs: dict[str, int], layout: list[tuple[str, int]], rank: int, port_base: int
) -> tuple[dict[str, list[str]], tuple[str, int]]:
    wanted = sum(jobs.values())
    if any(not isinstance(n, int) or n < 0 for n in jobs.values()) or wanted > len(layout):
        raise ValueError(
            f"jobs ask for {wanted} tasks but SLURM runs {len(layout)}. Received: jobs={jobs}. "
            "HINT: make the job sizes add up to the number of SLURM tasks (srun --ntasks)."
        )
    if rank >= wanted:
        raise ValueError(
            f"SLURM_PROCID={rank} is past the {wanted} tasks that jobs={jobs} name. "
            "HINT: make the job sizes add up to the number of SLURM tasks."
        )
    addresses = [f"{host}:{port_base + k}" for host, k in layout]
    cluster, task, start = {}, ("worker", rank), 0
    for job, count in sorted(jobs.items()):  # sorted as TF, so every process agrees
        cluster[job] = addresses[start : start + count]
        if start <= rank < start + count:
            task = (job, rank - start)
        start += count
    return cluster, task


def _check_placement(env: Mapping[str, str], rank: int, layout: list[tuple[str, int]]) -> None:
    host, local = layout[rank]
    local_id, node = env.get("SLURM_LOCALID"), env.get("SLURMD_NODENAME")
    if (local_id is not None and local_id != str(local)) or (node is not None and node != host):
        raise ValueError(
            f"SLURM placed task {rank} as local task {local_id} on {node}, but the block layout puts it "
            f"at local task {local} on {host}. SlurmClusterResolver assumes SLURM's block distribution. "
            "HINT: srun --distribution=block, or build a SimpleClusterResolver yourself."
        )


def _task_gpus(local: int, max_per_node: int, per_node: int | None, per_task: int | None) -> list[int]:
    if per_node is None:
        import torch  # lazily: only when the GPU count is not given

        per_node = torch.cuda.device_count()
    if per_task is None:
        per_task = per_node // max(1, max_per_node)
    if per_task < 0 or per_task * max_per_node > per_node:
        raise ValueError(
            f"{max_per_node} task(s) on a node x {per_task} GPU(s) each need "
            f"{per_task * max_per_node} GPUs, but a node has {per_node}. "
            "HINT: lower gpus_per_task or the tasks per node."
        )
    return list(range(local * per_task, (local + 1) * per_task))
