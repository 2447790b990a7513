"""MultiWorkerMirroredStrategy: synchronous training across processes and machines."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from phalanx.cluster.resolvers import ClusterResolver, owners, resolve_cluster
from phalanx.cluster.validation import validate_for_strategy
from phalanx.communication.checks.stall_inspector import StallSettings
from phalanx.communication.engine.bucketing import GradientBuckets
from phalanx.communication.group.worker_group import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_JOIN_TIMEOUT,
    HEARTBEAT_TIMEOUT_ENV,
    JOIN_TIMEOUT_ENV,
    ElasticGroup,
    WorkerGroup,
    seconds_from_env,
)
from phalanx.communication.local.options import CommunicationImplementation, CommunicationOptions
from phalanx.communication.membership.membership import ElasticSettings, Membership
from phalanx.communication.transports.gloo.transport import DataFlag
from phalanx.protocols import StepSync
from phalanx.status.counters import COUNTERS
from phalanx.status.taking_part import join_status
from phalanx.strategies.run_options import RunOptions
from phalanx.strategies.strategy import DEFAULT_TIMEOUT_SECONDS, Strategy
from phalanx.strategies.workers.bucket_sync import BucketSync, group_buckets
from phalanx.strategies.workers.elastic_groups import ElasticGroups
from phalanx.strategies.workers.setup import deprecated_communication, local_devices, task_name
from phalanx.values import ReduceOp
from phalanx.variables import DistributedVariable

__all__ = ["MultiWorkerMirroredStrategy"]


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data-parallel training, one process per worker (tf.distribute.MultiWorkerMirroredStrategy).

    Every worker runs the same program; ``num_replicas_in_sync`` is workers x local replicas.
    The cluster comes from the resolver (``TF_CONFIG``, torchrun's variables or SLURM by
    default); the chief (``chief:0``, else ``worker:0``) serves the rendezvous at its address.
    Cross-worker collectives run on a torch.distributed process group: gloo for
    ``CommunicationImplementation.RING``, nccl for ``NCCL`` (CUDA tensors); ``AUTO`` picks
    NCCL when every local device is a GPU and NCCL is available, else gloo.

    * **One local replica** (the DDP layout): parameters stay plain ``nn.Parameter``s; their
      gradients are summed across workers in buckets while backward runs (see
      `phalanx.communication.engine.bucketing`); ``backward()`` returns with the sums in ``.grad``.
    * **Several local replicas**: parameters are `MirroredVariable`s; at the step gradients
      are summed over the local replicas, then across workers.
    * Gradients are **summed** over all replicas (TF's convention; DDP averages). Divide the
      loss by the global batch size (`phalanx.compute_average_loss`).
    * Initial values of every parameter and buffer created in ``scope()`` are broadcast from
      the chief at the first ``run`` after they were created (all workers).

    Every collective has a deadline and a health check: a worker that dies or stops answering
    becomes a `PeerUnavailableError` naming it on the others, within ``heartbeat_timeout`` +
    1.5 s (about 12 s by default; see `phalanx.communication.group.worker_group`).

    Args:
        cluster_resolver: Where the workers are; default ``phalanx.cluster.resolve_cluster()``.
        communication_options: `CommunicationOptions`: implementation, collective timeout
            (default 600 s), gradient bucket size (``bytes_per_pack``, default 25 MiB) and
            gradient compression (``compression``: ``"fp16"``, ``"bf16"`` or
            `phalanx.experimental.PowerSGD`; with one device per worker, where the gradient
            buckets run; `phalanx.communication.compression`).
        devices: This worker's replica devices (default: its LOCAL_RANK GPU, else all its
            GPUs, else one CPU replica; ``["cpu:0", "cpu:1"]`` gives two CPU replicas).
        join_timeout: Seconds to wait for every worker to start (default
            ``PHALANX_JOIN_TIMEOUT_SECONDS``, else 120).
        heartbeat_timeout: Seconds of silence after which a worker counts as dead (default
            ``PHALANX_HEARTBEAT_TIMEOUT_SECONDS``, else 10).
        communication: TF's deprecated spelling (a `CommunicationImplementation`, e.g.
            ``phalanx.experimental.CollectiveCommunication.RING``): accepted with a
            DeprecationWarning as ``CommunicationOptions(implementation=communication)``.
        sync_batch_norm: Batch-norm layers registered in ``scope()`` become
            `phalanx.nn.SyncBatchNorm`: statistics over the global batch of every worker,
            as on one device (default: each replica's own slice, as TF does).

    Raises:
        ValueError: Both ``communication`` and ``communication_options``; the cluster has a
            ``ps`` job, this task is not a chief or worker, NCCL is asked for without GPUs, a
            timeout is not positive, or compression is asked for with several devices.
        PeerUnavailableError: A worker did not join within ``join_timeout`` (it is named).
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: CommunicationOptions | None = None,
        devices: Sequence[str | torch.device] | None = None,
        join_timeout: float | None = None,
        heartbeat_timeout: float | None = None,
        communication: CommunicationImplementation | None = None,
        sync_batch_norm: bool = False,
    ) -> None:
        communication_options = deprecated_communication(communication, communication_options)
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        validate_for_strategy(resolver, "MultiWorkerMirroredStrategy", allow_ps=False)
        if resolver.task_type not in (None, "chief", "worker"):
            raise ValueError(
                "MultiWorkerMirroredStrategy runs on chief and worker tasks. Received: task "
                f"{resolver.task_type}:{resolver.task_id}. HINT: an evaluator runs its own "
                "OneDeviceStrategy or MirroredStrategy."
            )
        options = communication_options if communication_options is not None else CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(
                "communication_options must be a phalanx.CommunicationOptions. Received: "
                f"{type(options).__name__}."
            )
        timeout = options.timeout_seconds or DEFAULT_TIMEOUT_SECONDS
        super().__init__(
            list(devices) if devices is not None else local_devices(resolver),
            None,
            timeout,
            num_workers=resolver.num_workers,
            worker_index=resolver.worker_index,
        )
        self._resolver = resolver
        owners.claim(resolver, self)  # a handler given only the resolver finds this strategy
        self._options = options
        self._check_compression(options)
        self._sync_batch_norm = sync_batch_norm
        self._backend = self._pick_backend()
        self._comm_device = torch.device("cpu") if self._backend == "gloo" else self._devices[0]
        self._unbroadcast: list[weakref.ref[torch.Tensor]] = []
        self._plain: dict[int, weakref.ref[torch.Tensor]] = {}
        self._running = False
        self._closed = False
        self._group: WorkerGroup | None = None
        self._buckets: GradientBuckets | None = None
        self._bucket_sync: BucketSync | None = None
        self._elastic: ElasticGroups | None = None  # an elastic job's groups and membership
        self._status = join_status(self._status_name(), resolver.is_chief, self._membership_epoch)
        if self._num_workers > 1:
            self._group = self._joined(join_timeout, heartbeat_timeout)
            if self._num_local_replicas == 1:
                self._buckets = group_buckets(self, self._group)
                self._bucket_sync = BucketSync(self._gradient_sync, self._buckets, self)
        if self._status is not None:
            self._status.running()

    def _joined(self, join_timeout: float | None, heartbeat_timeout: float | None) -> WorkerGroup:
        """`_join`, its error kept for the status page."""
        try:
            return self._join(join_timeout, heartbeat_timeout)
        except Exception as exc:
            if self._status is not None:
                self._status.failed(exc)
            raise

    def _status_name(self) -> str:
        """``"worker:1"``: this task as the status page names it."""
        job, index = self._resolver.task_type, self._resolver.task_id
        return f"{job}:{index}" if job is not None and index is not None else f"worker:{self._worker_index}"

    def _membership_epoch(self) -> int | None:
        return self._elastic.membership.epoch if self._elastic is not None else None

    def _check_compression(self, options: CommunicationOptions) -> None:
        """Compression runs in the gradient buckets, which exist with one device per worker."""
        if options.compression is not None and self._num_local_replicas > 1:
            raise ValueError(
                "Gradient compression runs in MultiWorkerMirroredStrategy's gradient buckets, "
                "which sum the gradients of one device per worker. Received: "
                f"compression={options.compression!r} with devices={list(self._device_names)}. "
                "HINT: start one worker per device (phalanx launch, torchrun --nproc-per-node), "
                "or leave compression out."
            )

    @property
    def step_sync(self) -> StepSync:
        """The bucket sync with one local replica in a job of several workers, else the
        in-process gradient sync (see `Strategy.step_sync`)."""
        return self._bucket_sync if self._bucket_sync is not None else self._gradient_sync

    def _join(self, join_timeout: float | None, heartbeat_timeout: float | None) -> WorkerGroup:
        join, beat = self._timeouts(join_timeout, heartbeat_timeout)
        self._group_settings = (join, beat)
        settings = ElasticSettings.from_env()
        if settings is None:  # the job's one group, its store served by the chief
            host, _, port = self._resolver.chief_address().rpartition(":")
            names = task_name(self._resolver)
            return self._new_group(host, int(port), self._worker_index, self._num_workers, names, join)
        # an elastic job: the membership decides who trains, and the ranks
        names = task_name(self._resolver)
        membership = Membership(settings, self._worker_index, self._num_workers, names, join)
        membership.start()
        self._elastic = ElasticGroups(membership, self._new_group, join)
        group = self._elastic.make()
        self._num_workers, self._worker_index = self._elastic.size, self._elastic.rank
        return group

    def _new_group(
        self,
        host: str,
        port: int,
        rank: int,
        world: int,
        names: Callable[[int], str],
        join: float,
        elastic: ElasticGroup | None = None,
    ) -> WorkerGroup:
        return WorkerGroup(
            host,
            port,
            rank,
            world,
            self._backend,
            names,
            join_timeout=join,
            collective_timeout=self._timeout,
            heartbeat_timeout=self._group_settings[1],
            own_host=self._own_host(),  # gloo binds this task's address from the cluster spec
            stall=StallSettings.from_env(self._options.stall_timeout_seconds),
            elastic=elastic,
        )

    def _own_host(self) -> str:
        job, index = self._resolver.task_type, self._resolver.task_id
        own = self._resolver.chief_address().rpartition(":")[0]  # a lone task: the chief
        if job is not None and index is not None:
            own = self._resolver.cluster_spec().task_address(job, index).rpartition(":")[0]
        return own

    @property
    def worker_group(self) -> WorkerGroup | None:
        """The group of workers this strategy steps with (None: one worker), the current
        membership epoch's in an elastic job. The elastic step boundaries
        (`phalanx.checkpoint.failure_handling.elastic`) agree and hand state over on it."""
        return self._group

    @property
    def membership(self) -> Membership | None:
        """The elastic membership (``PHALANX_MIN_WORKERS`` set, several workers), else None."""
        return self._elastic.membership if self._elastic is not None else None

    def reform(self, admit: bool = True) -> None:
        """Drops the current group and makes the next membership epoch's: after a lost worker,
        or to admit a joiner (every live member; an elastic job only). The caller then hands
        the new members the chief's state (`phalanx.checkpoint.failure_handling.elastic`).
        ``admit=False``: waiting joiners are left waiting (a re-form inside an evaluation pass).
        What is still in flight on the dropped group fails at once, on every member
        (`phalanx.communication.transports.gloo.sockets`).

        Raises:
            RuntimeError: The strategy is not elastic.
            BelowMinimumWorkersError: Fewer workers are left than the job's minimum.
            PeerUnavailableError: This worker was left out, or the new group failed 5 times.
        """
        if self._elastic is None:
            raise RuntimeError(
                f"{self!r} is not elastic. HINT: set PHALANX_MIN_WORKERS (phalanx launch --min-workers)."
            )
        if self._buckets is not None:
            self._buckets.release()
        self._group = None  # the elastic groups drop it
        self._group = self._elastic.reform(admit)
        self._num_workers, self._worker_index = self._elastic.size, self._elastic.rank
        params = [p for p in (ref() for ref in self._plain.values()) if isinstance(p, torch.nn.Parameter)]
        for param in params:  # a step cut short left partial sums in .grad: drop them
            param.grad = None
        if self._num_local_replicas == 1:
            self._buckets = group_buckets(self, self._group)
            for param in params:  # in creation order, as on every member
                self._buckets.add(param)
            self._bucket_sync = BucketSync(self._gradient_sync, self._buckets, self)

    def handed_over(self) -> None:
        """Records that every member took the chief's state (an elastic job, after a re-form):
        the initial values of the variables created so far need no broadcast of their own."""
        self._unbroadcast = []

    def _timeouts(self, join_timeout: float | None, heartbeat_timeout: float | None) -> tuple[float, float]:
        join = join_timeout
        if join is None:
            join = seconds_from_env(JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT)
        beat = heartbeat_timeout
        if beat is None:
            beat = seconds_from_env(HEARTBEAT_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT)
        for name, value in (("join_timeout", join), ("heartbeat_timeout", beat)):
            if not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds. Received: {value!r}.")
        return join, beat

    def _pick_backend(self) -> str:
        impl = self._options.implementation
        gpus = all(d.type == "cuda" for d in self._devices)
        if impl is CommunicationImplementation.NCCL:
            if not gpus or not torch.distributed.is_nccl_available():
                raise ValueError(
                    "CommunicationImplementation.NCCL needs CUDA devices and a torch built with "
                    f"NCCL. Received: devices {list(self._device_names)}, NCCL available: "
                    f"{torch.distributed.is_nccl_available()}. HINT: use RING (gloo) on CPU."
                )
            return "nccl"
        if impl is CommunicationImplementation.AUTO and gpus and torch.distributed.is_nccl_available():
            return "nccl"
        return "gloo"

    # ---------------------------------------------------------------- identity
    @property
    def cluster_resolver(self) -> ClusterResolver:
        """The resolver this strategy's cluster came from."""
        return self._resolver

    @property
    def is_chief(self) -> bool:
        """Whether this worker is the chief (``chief:0``, else ``worker:0``; in an elastic job,
        rank 0 of the current membership: the lowest live task)."""
        if self._elastic is not None:
            return self._worker_index == 0
        return self._resolver.is_chief

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker's checkpoints are kept (the chief's only)."""
        return self.is_chief

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(worker {self._worker_index} of {self._num_workers}, "
            f"devices={list(self._device_names)})"
        )

    def write_dirpath(self, dirpath: str) -> str:
        """Where this worker writes files meant for ``dirpath`` (TF's ``write_dirpath``).

        Every worker runs the same save code (a save may read aggregated values, which is a
        collective); the chief writes to ``dirpath``, the others to
        ``dirpath/workertemp_<task_id>`` (created here), which `remove_temp_dirpath` removes.
        A file path (``model.pt``) is answered as ``write_filepath`` would.
        """
        from phalanx.strategies.workers import distributed_files as _distributed_files

        return _distributed_files.write_dirpath(dirpath, self)

    def remove_temp_dirpath(self, dirpath: str) -> None:
        """Removes this worker's ``workertemp_<task_id>`` folder under ``dirpath`` (non-chief)."""
        from phalanx.strategies.workers import distributed_files as _distributed_files

        _distributed_files.remove_temp_dirpath(dirpath, self)

    # ---------------------------------------------------------------- variables
    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        """One local replica: a plain parameter on the device, tracked for the gradient
        buckets and the chief's broadcast. Otherwise (or if annotated): a MirroredVariable."""
        if (
            self._num_local_replicas > 1
            or isinstance(param, DistributedVariable)
            or hasattr(param, "_phalanx_aggregation")
        ):
            return self._track(super()._create_parameter(module, name, param))
        known = self._plain.get(id(param))
        if known is not None and known() is param:
            return None  # the same parameter in a second module (tied weights)
        device = self._devices[0]
        if param.device != device:
            param = torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)
        self._plain[id(param)] = weakref.ref(param)
        if self._group is not None:
            self._unbroadcast.append(weakref.ref(param))
        if self._buckets is not None:
            self._buckets.add(param)
        return param

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        """A SyncOnReadVariable (as mirrored), broadcast from the chief before the next run."""
        return self._track(super()._create_buffer(module, name, buffer))

    def _track(self, var: Any) -> Any:
        """Queues a new distributed variable for the chief's broadcast (several workers)."""
        if var is not None and self._group is not None:
            self._unbroadcast.append(weakref.ref(var))
        return var

    def _before_run(self) -> None:
        if self._unbroadcast:
            self._broadcast_from_chief()
        super()._before_run()
        if self._buckets is not None:
            self._buckets.refresh()

    def _broadcast_from_chief(self) -> None:
        """Gives every worker the chief's values of the variables created since the last
        broadcast (all workers; one broadcast per dtype, in creation order)."""
        assert self._group is not None
        fresh = [t for t in (ref() for ref in self._unbroadcast) if t is not None]
        self._unbroadcast = []
        targets = [t.primary if isinstance(t, DistributedVariable) else t for t in fresh]
        with torch.no_grad():
            for dtype in dict.fromkeys(t.dtype for t in targets):
                group = [t for t in targets if t.dtype == dtype]
                flat = torch.cat([t.detach().reshape(-1).to(self._comm_device) for t in group])  # (total,)
                self._group.broadcast(flat, 0, what="the broadcast of initial values from the chief")
                start = 0
                for t in group:
                    t.copy_(flat[start : start + t.numel()].view_as(t))
                    start += t.numel()
        for var in fresh:
            if isinstance(var, DistributedVariable):
                var._dirty = True

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> Any:
        """`Strategy.run` on every local replica of every worker (all workers call it).

        Backward passes inside ``fn`` sum the gradients across all replicas and workers
        before they return (with one local replica: bucketed all-reduces that start while
        backward runs).

        Raises:
            RuntimeError: The strategy was closed.
            PeerUnavailableError: A worker died or stopped answering (it is named).
        """
        if self._closed:
            raise RuntimeError(
                f"{self!r}.run was called after close(). HINT: create a new "
                "MultiWorkerMirroredStrategy (on every worker)."
            )
        self._running = True
        try:
            result = super().run(fn, args, kwargs, options)
        except Exception as exc:
            COUNTERS.failed(exc)  # the status page's last error
            raise
        else:
            COUNTERS.stepped()
            return result
        finally:
            self._running = False
            if self._buckets is not None:
                self._buckets.abort_round()

    # ---------------------------------------------------------------- cross-worker collectives
    def _stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` as the process group takes it: contiguous, on its device (no copy if it is)."""
        return tensor.detach().to(self._comm_device).contiguous()

    def _call_timeout(self, options: CommunicationOptions | None) -> float | None:
        if options is None:
            return None
        if options.compression is not None:
            raise ValueError(
                "Compression applies to the gradients the strategy sums during backward, set "
                "once for the strategy; a single collective cannot ask for it. Received: "
                f"CommunicationOptions(compression={options.compression!r}) for one call. HINT: "
                "give it to MultiWorkerMirroredStrategy(communication_options=...)."
            )
        impl = options.implementation
        wanted = {CommunicationImplementation.RING: "gloo", CommunicationImplementation.NCCL: "nccl"}
        if impl in wanted and wanted[impl] != self._backend:  # type: ignore[index]
            raise ValueError(
                f"This strategy's collectives run on {self._backend}, fixed when it was created; "
                f"a call cannot switch them. Received: CommunicationOptions(implementation={impl}). "
                "HINT: give the implementation to MultiWorkerMirroredStrategy(communication_options=...)."
            )
        return self._options.merge(options).timeout_seconds

    def _cross_worker_all_reduce(
        self, tensor: torch.Tensor, op: Any, options: CommunicationOptions | None = None
    ) -> torch.Tensor:
        """Sums (or averages) ``tensor`` across workers (all workers; same shape and dtype).

        Callers pass buffers they own: the result may be written into ``tensor`` itself.
        ``options.timeout_seconds`` overrides the deadline for this call.
        """
        if self._group is None:
            return tensor
        timeout = self._call_timeout(options)
        staged = self._stage(tensor)
        self._group.all_reduce(staged, timeout=timeout)
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
        """Concatenates every worker's ``tensor`` along ``axis`` (all workers; sizes along
        ``axis`` may differ, other dimensions must match): gathers the sizes, then the
        tensors padded to the longest, then trims.

        Returns:
            The concatenation in worker order, and every replica's size along ``axis``.
        """
        if self._group is None:
            return tensor, local_sizes
        timeout = self._call_timeout(options)
        local = len(local_sizes)
        sizes = torch.tensor(local_sizes, dtype=torch.int64, device=self._comm_device)
        all_sizes = [int(s) for part in self._group.all_gather(sizes, timeout=timeout) for s in part]
        per_worker = [sum(all_sizes[w * local : (w + 1) * local]) for w in range(self._num_workers)]
        moved = self._stage(tensor.movedim(axis, 0))  # (rows, ...)
        padded = torch.zeros((max(per_worker), *moved.shape[1:]), dtype=moved.dtype, device=self._comm_device)
        padded[: moved.shape[0]] = moved
        parts = self._group.all_gather(padded, timeout=timeout)  # workers x (longest, ...)
        gathered = torch.cat([p[:n] for p, n in zip(parts, per_worker, strict=True)]).movedim(0, axis)
        return gathered.to(tensor.device), all_sizes

    def _cross_worker_sparse_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums a sparse COO tensor across workers by gathering every worker's indices and
        values (all workers, same shape; they may hold different entries; blocks)."""
        if self._group is None:
            return tensor
        t = tensor.coalesce()
        indices, values = t.indices(), t.values()  # (sparse_dim, nnz), (nnz, *dense)
        all_indices, _ = self._cross_worker_all_gather(indices, 1, [indices.shape[1]])
        all_values, _ = self._cross_worker_all_gather(values, 0, [values.shape[0]])
        # indices from other processes: checked (an out-of-range one raises, never corrupts memory)
        return torch.sparse_coo_tensor(all_indices, all_values, t.shape, check_invariants=True).coalesce()

    def any_worker_has_data(self, has_data: bool) -> bool:
        """Whether any worker still has input this step: an all-reduce MAX (all workers, every step)."""
        if self._group is None:
            return has_data
        flag = torch.tensor([int(has_data)], dtype=torch.int64, device=self._comm_device)  # (1,)
        self._group.all_reduce(flag, torch.distributed.ReduceOp.MAX, what="the end-of-data agreement")
        return bool(flag.item())

    def _carry_data_flag(self, has_data: bool) -> DataFlag | None:
        """`GroupCollectives.carry_data_flag`: the next step's input flag rides with this step's gradients."""
        return None if self._group is None or self._buckets is None else self._group.carry_data_flag(has_data)

    def close(self) -> None:
        """Leaves the cluster: waits for running gradient all-reduces, stops the health check
        and destroys the process group (all workers, at the end; idempotent). Collectives
        afterwards raise RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self._status is not None:
            self._status.close()
        try:
            if self._buckets is not None:
                self._buckets.close()
        finally:
            if self._group is not None:
                self._group.close()
            if self._elastic is not None:
                self._elastic.close()
            self._threads.close()
