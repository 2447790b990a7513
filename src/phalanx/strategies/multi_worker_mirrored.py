"""MultiWorkerMirroredStrategy: synchronous training across processes and machines."""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from phalanx import context
from phalanx.cluster.resolvers import ClusterResolver, resolve_cluster
from phalanx.cluster.validation import validate_for_strategy
from phalanx.communication.bucketing import GradientBuckets
from phalanx.communication.collectives import WorkerGroup
from phalanx.communication.options import CommunicationImplementation, CommunicationOptions
from phalanx.strategies.strategy import DEFAULT_TIMEOUT_SECONDS, Strategy
from phalanx.values import ReduceOp

__all__ = ["MultiWorkerMirroredStrategy"]


def _local_devices(resolver: ClusterResolver) -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is not None:
            return [f"cuda:{int(local_rank) % torch.cuda.device_count()}"]
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return ["cpu:0"]


class _BucketSync:
    """The optimizer-step hook of the DDP layout: wait for the buckets, install the sums."""

    def __init__(self, buckets: GradientBuckets) -> None:
        self._buckets = buckets

    def before_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        self._buckets.synchronize()

    def after_step(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        """Nothing to do: parameters are plain and updated in place."""

    def reset_thread(self) -> None:
        """No per-thread state."""


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data-parallel training, one process per worker (tf.distribute.MultiWorkerMirroredStrategy).

    Each worker runs the same program; ``num_replicas_in_sync`` is workers x local replicas.
    The cluster comes from the resolver (TF_CONFIG, torchrun's environment or SLURM by
    default). Variables are broadcast from the chief before the first step; at
    ``optimizer.step()`` gradients are summed over the local replicas, then across workers
    with a torch.distributed collective (gloo = RING, nccl = NCCL). Every collective has a
    deadline, and a dead or silent worker becomes a `PeerUnavailableError` naming it on every
    other worker (bounds in `phalanx.communication.collectives`).

    Args:
        cluster_resolver: Where the workers are; default ``phalanx.cluster.resolve_cluster()``.
        communication_options: Implementation and timeout of collectives.
        devices: This worker's replica devices (default: its GPU(s), else one CPU replica).
        join_timeout: Seconds to wait for every worker to start.

    Raises:
        ValueError: The cluster has a ``ps`` job, this task is not a chief/worker, or NCCL is
            asked for without GPUs.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str | torch.device] | None = None,
        join_timeout: float = 120.0,
    ) -> None:
        resolver = cluster_resolver or resolve_cluster()
        validate_for_strategy(resolver.cluster_spec(), "MultiWorkerMirroredStrategy", allow_ps=False)
        if resolver.task_type not in (None, "chief", "worker"):
            raise ValueError(
                f"MultiWorkerMirroredStrategy runs on chief and worker tasks; this task is "
                f"{resolver.task_type!r}. HINT: an evaluator runs its own OneDevice/Mirrored strategy."
            )
        self._options = communication_options or CommunicationOptions()
        timeout = self._options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        super().__init__(list(devices) if devices is not None else _local_devices(resolver), None, timeout)
        self._resolver = resolver
        self._num_workers = resolver.num_workers
        self._worker_index = resolver.worker_index
        self._group: WorkerGroup | None = None
        self._plain_params: list[weakref.ref[torch.nn.Parameter]] = []
        self._buckets: GradientBuckets | None = None
        if self._num_workers > 1:
            host, port = resolver.chief_address().rsplit(":", 1)
            self._group = WorkerGroup(
                host,
                int(port),
                self._worker_index,
                self._num_workers,
                self._backend(),
                resolver.task_name,
                join_timeout=join_timeout,
                collective_timeout=timeout,
            )

    def _in_my_replica(self) -> bool:
        replica = context._state.replica
        return replica is not None and replica[0] is self

    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        if self._buckets is None:
            return super()._create_parameter(module, name, param)
        device = self._devices[0]
        if param.device != device:
            param = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
        self._buckets.add(param)
        self._plain_params.append(weakref.ref(param))
        return param

    def _backend(self) -> str:
        impl = self._options.implementation
        gpus = all(d.type == "cuda" for d in self._devices)
        if impl is CommunicationImplementation.NCCL:
            if not gpus or not torch.distributed.is_nccl_available():
                raise ValueError(
                    "CommunicationImplementation.NCCL needs CUDA devices and an NCCL-enabled torch. "
                    "HINT: use RING (gloo) on CPU."
                )
            return "nccl"
        if impl is CommunicationImplementation.AUTO and gpus and torch.distributed.is_nccl_available():
            return "nccl"
        return "gloo"

    # ---------------------------------------------------------------- identity
    @property
    def cluster_resolver(self) -> ClusterResolver:
        return self._resolver

    @property
    def is_chief(self) -> bool:
        return self._resolver.is_chief

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(worker {self._worker_index} of {self._num_workers}, "
            f"devices={list(self._device_names)})"
        )

    def write_dirpath(self, dirpath: str) -> str:
        """Where this worker should write ``dirpath``'s files: the path on the chief, a
        ``workertemp_<task>`` sibling elsewhere (remove it after writing)."""
        if self.is_chief:
            return dirpath
        task = f"{self._resolver.task_type}_{self._resolver.task_id}"
        return os.path.join(
            os.path.dirname(os.path.abspath(dirpath)), f"workertemp_{task}", os.path.basename(dirpath)
        )

    # ---------------------------------------------------------------- variables
    def _before_run(self) -> None:
        super()._before_run()
        if self._group is None:
            return
        alive = [ref() for ref in self._variables] + [ref() for ref in self._plain_params]
        fresh = [v for v in alive if v is not None and not getattr(v, "_from_chief", False)]
        if not fresh:
            return
        with torch.no_grad():
            for var in fresh:  # the chief's initial values, in registration order (the same everywhere)
                primary = var._components[0]
                staged = (
                    primary.detach().cpu().contiguous() if self._group_on_cpu(primary) else primary.detach()
                )
                self._group.broadcast(staged, 0)
                primary.copy_(staged)
                var._dirty = True
                self._materialize(var)
                var._from_chief = True

    def _group_on_cpu(self, tensor: torch.Tensor) -> bool:
        return self._backend() == "gloo" and tensor.device.type != "cpu"

    # ---------------------------------------------------------------- cross-worker collectives
    def _cross_worker_all_reduce(
        self, tensor: torch.Tensor, op: Any, options: CommunicationOptions | None = None
    ) -> torch.Tensor:
        """Sums ``tensor`` across workers (all workers). Callers pass buffers they own: the
        sum may be written into ``tensor`` itself, with no copy."""
        if self._group is None:
            return tensor
        staged = tensor.detach().cpu() if self._group_on_cpu(tensor) else tensor.detach()
        staged = staged.contiguous()
        per_call = options.timeout_seconds if options is not None else None  # CommunicationOptions per call
        self._group.all_reduce(staged, timeout=per_call)
        result = staged if staged.device == tensor.device else staged.to(tensor.device)
        if ReduceOp.coerce(op) is ReduceOp.MEAN:
            result = result / self._num_workers
        return result

    def _cross_worker_all_gather(
        self,
        tensor: torch.Tensor,
        axis: int,
        local_sizes: list[int],
        options: CommunicationOptions | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        if self._group is None:
            return tensor, local_sizes
        sizes = torch.tensor(local_sizes, dtype=torch.int64)
        all_sizes = [int(s) for part in self._group.all_gather(sizes) for s in part]
        local = tensor.movedim(axis, 0)
        longest = max(
            sum(all_sizes[w * len(local_sizes) : (w + 1) * len(local_sizes)])
            for w in range(self._num_workers)
        )
        padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype)
        padded[: local.shape[0]] = local.cpu()
        parts = self._group.all_gather(padded)
        per_worker = [
            sum(all_sizes[w * len(local_sizes) : (w + 1) * len(local_sizes)])
            for w in range(self._num_workers)
        ]
        gathered = torch.cat([p[:n] for p, n in zip(parts, per_worker, strict=True)]).movedim(0, axis)
        return gathered.to(tensor.device), all_sizes

    def _any_worker_has_data(self, has_data: bool) -> bool:
        if self._group is None:
            return has_data
        flag = torch.tensor([1 if has_data else 0], dtype=torch.int64)
        self._group.all_reduce(flag, torch.distributed.ReduceOp.MAX, what="the end-of-data agreement")
        return bool(flag.item())

    def close(self) -> None:
        """Leaves the cluster: stops the health check and destroys the process group (all workers)."""
        if self._group is not None:
            self._group.close()
            self._group = None
        self._threads.close()
