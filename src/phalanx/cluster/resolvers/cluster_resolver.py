"""ClusterResolver: where the tasks are and which one this process is.

As ``tf.distribute.cluster_resolver.ClusterResolver``, plus what a torch.distributed
program needs from it: ``is_chief``, ``rank``/``world_size`` among the training tasks, and
the rendezvous address (``chief_address()``).
"""

from __future__ import annotations

import abc
from typing import Any

from phalanx.cluster._roles import trainer_tasks
from phalanx.cluster.cluster_spec import ClusterSpec

__all__ = ["ClusterResolver", "format_master_url"]


def format_master_url(address: str, rpc_layer: str | None = None) -> str:
    """``address`` with ``rpc_layer://`` in front when a layer is given (TF's helper).

    An empty address, or one that already has a scheme, is returned unchanged.
    """
    return f"{rpc_layer}://{address}" if rpc_layer and address and "://" not in address else address


class ClusterResolver(abc.ABC):
    """Base of the resolvers: a cluster spec, this task's type and index, and what follows.

    Training tasks are the chief and worker tasks. The chief is the ``chief`` task if the
    cluster has one, else ``worker:0``; a process without a cluster (one task) is the chief.
    ``rank`` (= ``worker_index``) numbers the training tasks for torch.distributed: 0 for the
    chief, then workers by index, so worker ``i`` is rank ``i + 1`` when a chief exists.

    Subclasses implement `cluster_spec` and set ``task_type``/``task_id`` when created.
    """

    #: Where the configuration came from, for messages ("TF_CONFIG", "SLURM", ...).
    source: str = "the cluster resolver"
    rpc_layer: str | None = None
    _task_type: str | None = None
    _task_id: int | None = None

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster: every task's address, by job."""

    @property
    def task_type(self) -> str | None:
        """This process's job ("chief", "worker", "ps", "evaluator"), or None if unknown."""
        return self._task_type

    @task_type.setter
    def task_type(self, value: str | None) -> None:
        if value is not None and not isinstance(value, str):
            raise ValueError(f"task_type must be a job name (str) or None. Received: {value!r}.")
        self._task_type = value

    @property
    def task_id(self) -> int | None:
        """This process's index within its job, or None if unknown."""
        return self._task_id

    @task_id.setter
    def task_id(self, value: int | None) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"task_id must be a non-negative int or None. Received: {value!r}.")
        self._task_id = value

    @property
    def environment(self) -> str:
        """The environment the cluster runs in (TF_CONFIG's ``environment``; "" if none)."""
        return ""

    def master(
        self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None
    ) -> str:
        """The address of a task, this process's by default, with ``rpc_layer://`` if any.

        Returns:
            ``[rpc_layer://]host:port``, or "" when no task is known (as TF).

        Raises:
            ValueError: The task is not in the cluster.
        """
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        if task_type is None or task_id is None:
            return ""
        address = self.cluster_spec().task_address(task_type, task_id)
        return format_master_url(address, rpc_layer or self.rpc_layer)

    def num_accelerators(
        self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None
    ) -> dict[str, int]:
        """Accelerators of this machine: ``{"GPU": n}`` for n > 0 visible CUDA devices, else ``{}``.

        The arguments are accepted for TF compatibility; only the local machine is counted.
        """
        import torch  # lazily: resolvers are created in processes that may never touch CUDA

        count = torch.cuda.device_count()
        return {"GPU": count} if count > 0 else {}

    @property
    def is_chief(self) -> bool:
        """Whether this task is the chief (``chief:0``, else ``worker:0``; a lone process is).

        Raises:
            ValueError: The cluster has several training tasks but this task is unknown.
        """
        return self._trainer_position() == 0

    @property
    def num_workers(self) -> int:
        """How many training (chief + worker) tasks the cluster has; 1 without a cluster."""
        return max(1, len(trainer_tasks(self.cluster_spec())))

    @property
    def worker_index(self) -> int:
        """This task's index among the training tasks: the chief is 0, then workers by index.

        Raises:
            ValueError: This task is a ``ps`` or ``evaluator`` task (not a training task), or
                the cluster has several training tasks but this task is unknown.
        """
        position = self._trainer_position()
        if position is None:
            raise ValueError(
                f"worker_index/rank are defined for chief and worker tasks only; this task is "
                f"{self.task_type}:{self.task_id}. HINT: a {self.task_type} task takes no part in "
                "torch.distributed collectives; check task_type before asking for a rank."
            )
        return position

    @property
    def rank(self) -> int:
        """torch.distributed rank of this task (the same as `worker_index`)."""
        return self.worker_index

    @property
    def world_size(self) -> int:
        """torch.distributed world size: the training tasks (the same as `num_workers`)."""
        return self.num_workers

    def chief_address(self) -> str:
        """``host:port`` of the chief (or ``worker:0``): the torch.distributed rendezvous address.

        Raises:
            ValueError: The cluster has no chief or worker task.
        """
        spec = self.cluster_spec()
        trainers = trainer_tasks(spec)
        if not trainers:
            raise ValueError(
                f"{self.source} has no 'chief' or 'worker' task, so there is no rendezvous address. "
                f"Received cluster: {spec.as_dict()}. HINT: a single-process run needs no rendezvous; "
                "a multi-process one needs a 'worker' job."
            )
        return spec.task_address(*trainers[0])

    def task_name(self, worker_index: int) -> str:
        """``"job:index (host:port)"`` of the training task with this rank, for messages."""
        spec = self.cluster_spec()
        trainers = trainer_tasks(spec)
        if not 0 <= worker_index < len(trainers):
            return f"worker:{worker_index}"
        job, index = trainers[worker_index]
        return f"{job}:{index} ({spec.task_address(job, index)})"

    def _trainer_position(self) -> int | None:
        trainers = trainer_tasks(self.cluster_spec())
        if self.task_type is None or self.task_id is None:
            if len(trainers) > 1:
                raise ValueError(
                    f"{self.source} has {len(trainers)} chief/worker tasks but does not say which one "
                    "this process is. HINT: set task_type and task_id (TF_CONFIG's 'task')."
                )
            return 0
        key = (self.task_type, self.task_id)
        return trainers.index(key) if key in trainers else None

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task={self.task_type}:{self.task_id}, "
            f"cluster={self.cluster_spec().as_dict()!r})"
        )
