"""ClusterSpec: the tasks of a cluster, by job name (``tf.train.ClusterSpec``)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

from phalanx.cluster.cluster_def import ClusterDef, JobDef

__all__ = ["ClusterSpec"]

# TF's rule for job names in device strings ("/job:worker/task:0").
_JOB_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_FORMS = "a list of 'host:port' strings or a dict {task_index: 'host:port'}"


class ClusterSpec:
    """Job name → task addresses, as in ``tf.train.ClusterSpec``.

    Each job is given as a list (task indices 0..n-1) or a dict ``{task_index: address}``
    (sparse indices; JSON's string keys such as ``"0"`` are accepted). Addresses are
    ``"host:port"`` strings; their format is checked by the resolvers' validation, not here,
    so a TF1-style cluster with any job names stays expressible.

    Args:
        cluster: A dict ``job -> list | dict``, another ``ClusterSpec``, or None (empty).

    Raises:
        ValueError: A job name that is not an identifier, a job that is neither a list nor a
            dict, a task index that is not a non-negative integer (or is given twice), or an
            address that is not a non-empty string. The message names the offending entry.
    """

    def __init__(self, cluster: Mapping[str, Any] | ClusterSpec | ClusterDef | None = None) -> None:
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if isinstance(cluster, ClusterDef):  # TF's ClusterSpec(cluster_def)
            cluster = {job.name: dict(job.tasks) for job in cluster.job}
        if cluster is not None and not isinstance(cluster, Mapping):
            raise ValueError(
                f"ClusterSpec takes a dict of job name -> tasks. Received: {cluster!r} "
                f"({type(cluster).__name__}). HINT: ClusterSpec({{'worker': ['host1:2222', 'host2:2222']}}) "
                "(a ClusterSpec or a ClusterDef works too)."
            )
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in (cluster or {}).items():
            _check_job_name(job)
            self._jobs[job] = dict(sorted(_parse_tasks(job, tasks).items()))

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """The cluster as a dict: a list for dense indices 0..n-1, else ``{index: address}``.

        Returns:
            ``{job: [address, ...]}`` or ``{job: {index: address}}`` per job (an empty job is
            ``{}``, as in TF).
        """
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            dense = bool(tasks) and list(tasks) == list(range(len(tasks)))
            out[job] = list(tasks.values()) if dense else dict(tasks)
        return out

    def as_cluster_def(self) -> ClusterDef:
        """The cluster as TF's ClusterDef message (a `phalanx.cluster.cluster_def.ClusterDef`
        dataclass with the proto's field names: ``job[i].name``, ``job[i].tasks``)."""
        return ClusterDef(tuple(JobDef(job, dict(tasks)) for job, tasks in self._jobs.items()))

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def num_tasks(self, job: str) -> int:
        """How many tasks ``job`` has.

        Raises:
            ValueError: ``job`` is not in the cluster.
        """
        return len(self._tasks(job))

    def task_indices(self, job: str) -> list[int]:
        """The task indices of ``job``, ascending.

        Raises:
            ValueError: ``job`` is not in the cluster.
        """
        return list(self._tasks(job))

    def task_address(self, job: str, index: int) -> str:
        """The ``host:port`` of task ``index`` of ``job``.

        Raises:
            ValueError: ``job`` is not in the cluster, or has no task ``index``.
        """
        tasks = self._tasks(job)
        if index not in tasks:
            raise ValueError(
                f"Job {job!r} has no task with index {index!r}. Its task indices are {list(tasks)}."
            )
        return tasks[index]

    def job_tasks(self, job: str) -> list[str | None]:
        """Addresses of ``job`` by index, with None where an index has no task (as TF).

        Raises:
            ValueError: ``job`` is not in the cluster.
        """
        tasks = self._tasks(job)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def _tasks(self, job: str) -> dict[int, str]:
        if job not in self._jobs:
            raise ValueError(
                f"No such job in the cluster: {job!r}. The cluster's jobs are {self.jobs}. "
                "HINT: check the job name (TF_CONFIG uses 'chief', 'worker', 'ps', 'evaluator')."
            )
        return self._jobs[job]

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ClusterSpec):
            return NotImplemented
        return self.as_dict() == other.as_dict()  # one dict per cluster: equal jobs, indices, addresses

    __hash__ = None  # type: ignore[assignment]  # mutable-looking value type, like TF's

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _check_job_name(job: object) -> None:
    if not isinstance(job, str) or not _JOB_NAME.match(job):
        raise ValueError(
            "Job names must be identifiers (a letter, then letters, digits or '_'). "
            f"Received: {job!r}. HINT: use 'chief', 'worker', 'ps' or 'evaluator'."
        )


def _parse_tasks(job: str, tasks: Any) -> dict[int, str]:
    if isinstance(tasks, (list, tuple)):
        items: Iterable[tuple[object, object]] = enumerate(tasks)
    elif isinstance(tasks, Mapping):
        items = tasks.items()
    else:
        raise ValueError(
            f"cluster[{job!r}] must be {_FORMS}. Received: {tasks!r} ({type(tasks).__name__}). "
            f"HINT: {{{job!r}: [{tasks!r}]}}."
        )
    parsed: dict[int, str] = {}
    for key, address in items:
        index = _task_index(job, key)
        if index in parsed:
            raise ValueError(f"cluster[{job!r}] gives task index {index} twice. Received: {tasks!r}.")
        if not isinstance(address, str) or not address:
            raise ValueError(
                f"cluster[{job!r}][{index}] must be a non-empty 'host:port' string. Received: {address!r}."
            )
        parsed[index] = address
    return parsed


def _task_index(job: str, key: object) -> int:
    if isinstance(key, str) and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise ValueError(
        f"cluster[{job!r}] task indices must be non-negative integers. Received: {key!r}. "
        "HINT: {0: 'host1:2222', 1: 'host2:2222'}, or a list."
    )
