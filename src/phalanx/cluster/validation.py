"""Checks of a cluster configuration, with messages that name the offending field."""

from __future__ import annotations

import json
from typing import Any

from phalanx.cluster.cluster_spec import ClusterSpec

__all__ = ["TASK_TYPES", "parse_tf_config", "validate_cluster", "validate_for_strategy"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")


def parse_tf_config(text: str) -> dict[str, Any]:
    """The TF_CONFIG JSON as a dict.

    Raises:
        ValueError: Malformed JSON (with the position) or not an object.
    """
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"TF_CONFIG is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}. "
            f"Received: {text!r}."
        ) from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task'. Received: {text!r}.")
    return config


def validate_cluster(cluster: ClusterSpec, task_type: str | None, task_id: int | None) -> None:
    """Checks job names, the task, chief count and address uniqueness.

    Raises:
        ValueError: The first problem found, naming the field.
    """
    _check_jobs(cluster)
    _check_addresses(cluster)
    if task_type is not None:
        _check_task(cluster, task_type, task_id)


def _check_jobs(cluster: ClusterSpec) -> None:
    for job in cluster.jobs:
        if job not in TASK_TYPES:
            raise ValueError(f"TF_CONFIG cluster has an unknown job {job!r}. Allowed: {list(TASK_TYPES)}.")
        if cluster.num_tasks(job) == 0:
            raise ValueError(f"TF_CONFIG cluster job {job!r} has no tasks.")
    if "chief" in cluster.jobs and cluster.num_tasks("chief") > 1:
        raise ValueError(
            f"TF_CONFIG cluster has {cluster.num_tasks('chief')} chiefs; at most one is allowed."
        )


def _check_addresses(cluster: ClusterSpec) -> None:
    seen: dict[str, str] = {}
    for job in cluster.jobs:
        for index in cluster.task_indices(job):
            address = cluster.task_address(job, index)
            if address in seen:
                raise ValueError(
                    f"TF_CONFIG cluster address {address!r} is used by both {seen[address]} "
                    f"and {job}:{index}."
                )
            seen[address] = f"{job}:{index}"


def _check_task(cluster: ClusterSpec, task_type: str, task_id: int | None) -> None:
    if task_type not in TASK_TYPES:
        raise ValueError(f"TF_CONFIG task type {task_type!r} is unknown. Allowed: {list(TASK_TYPES)}.")
    if task_type not in cluster.jobs:
        raise ValueError(f"TF_CONFIG task type {task_type!r} is not a job of the cluster {cluster.jobs}.")
    if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
        raise ValueError(f"TF_CONFIG task index must be a non-negative integer. Received: {task_id!r}.")
    if task_id not in cluster.task_indices(task_type):
        raise ValueError(
            f"TF_CONFIG task index {task_id} is out of range for job {task_type!r} "
            f"with {cluster.num_tasks(task_type)} task(s)."
        )


def validate_for_strategy(cluster: ClusterSpec, strategy_name: str, allow_ps: bool) -> None:
    """Rejects jobs the strategy cannot use.

    Raises:
        ValueError: A ``ps`` job given to a strategy without parameter servers.
    """
    if not allow_ps and "ps" in cluster.jobs:
        raise ValueError(
            f"{strategy_name} does not use parameter servers, but the cluster has a 'ps' job. "
            "HINT: use ParameterServerStrategy, or remove 'ps' from TF_CONFIG."
        )
