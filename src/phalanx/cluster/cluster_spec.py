"""ClusterSpec: the tasks of a cluster by job name (tf.train.ClusterSpec)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["ClusterSpec"]

_JOB_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class ClusterSpec:
    """Job name -> task addresses, given as a list (indices 0..n-1) or a dict {index: address}.

    Raises:
        ValueError: A bad job name, index or address (the message names it).
    """

    def __init__(self, cluster: Mapping[str, Any] | ClusterSpec | None = None) -> None:
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        self._jobs: dict[str, dict[int, str]] = {}
        for job, tasks in (cluster or {}).items():
            if not isinstance(job, str) or not _JOB_NAME.match(job):
                raise ValueError(f"Job names must be lower-case identifiers. Received: {job!r}.")
            items = enumerate(tasks) if isinstance(tasks, (list, tuple)) else _indexed(job, tasks)
            parsed: dict[int, str] = {}
            for index, address in items:
                if not isinstance(address, str) or not address:
                    raise ValueError(
                        f"cluster['{job}'][{index}] must be a 'host:port' string. Received: {address!r}."
                    )
                parsed[int(index)] = address
            self._jobs[job] = dict(sorted(parsed.items()))

    def as_dict(self) -> dict[str, list[str] | dict[int, str]]:
        """Lists for jobs with dense indices 0..n-1, dicts otherwise (as TF)."""
        out: dict[str, list[str] | dict[int, str]] = {}
        for job, tasks in self._jobs.items():
            out[job] = list(tasks.values()) if list(tasks) == list(range(len(tasks))) else dict(tasks)
        return out

    @property
    def jobs(self) -> list[str]:
        """The job names, sorted."""
        return sorted(self._jobs)

    def _job(self, job: str) -> dict[int, str]:
        if job not in self._jobs:
            raise ValueError(f"No such job in the cluster: {job!r}. Jobs: {self.jobs}.")
        return self._jobs[job]

    def num_tasks(self, job: str) -> int:
        return len(self._job(job))

    def task_indices(self, job: str) -> list[int]:
        return list(self._job(job))

    def task_address(self, job: str, index: int) -> str:
        tasks = self._job(job)
        if index not in tasks:
            raise ValueError(f"Job {job!r} has no task {index}; its tasks are {list(tasks)}.")
        return tasks[index]

    def job_tasks(self, job: str) -> list[str | None]:
        """Addresses by index, None for gaps (as TF)."""
        tasks = self._job(job)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


def _indexed(job: str, tasks: Any) -> list[tuple[int, Any]]:
    if not isinstance(tasks, Mapping):
        raise ValueError(f"cluster['{job}'] must be a list of addresses or a dict. Received: {tasks!r}.")
    items = []
    for key, address in tasks.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"cluster['{job}'] task index must be an integer. Received: {key!r}.") from None
        if index < 0:
            raise ValueError(f"cluster['{job}'] task index must be >= 0. Received: {index}.")
        items.append((index, address))
    return items
