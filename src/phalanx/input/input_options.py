"""Options that shape distributed input: InputContext, InputOptions, InputReplicationMode,
AutoShardPolicy."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["AutoShardPolicy", "InputContext", "InputOptions", "InputReplicationMode"]


class AutoShardPolicy(enum.IntEnum):
    """How a dataset is split across workers (tf.data.experimental.AutoShardPolicy).

    AUTO: shard by FILE when the dataset is read from a list of files, else by DATA.
    FILE: each worker reads its own subset of the files.
    DATA: every worker reads everything and keeps its own slice of every global batch.
    OFF: no sharding; every worker sees the same data.
    HINT: shard where the dataset calls ``shard(SHARD_HINT, SHARD_HINT)`` (TF's placeholder);
    phalanx's datasets have no such placeholder, so, as TF does for a dataset without one,
    nothing is sharded (every worker sees the same data, as with OFF).
    """

    OFF = -1
    AUTO = 0
    FILE = 1
    DATA = 2
    HINT = 3

    @classmethod
    def coerce(cls, value: AutoShardPolicy | str | int) -> AutoShardPolicy:
        """Accepts the enum, its name (any case) or its value."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls[value.upper()]
            except KeyError:
                pass
        elif isinstance(value, int):
            try:
                return cls(value)
            except ValueError:
                pass
        raise ValueError(f"auto_shard_policy must be one of {[p.name for p in cls]}. Received: {value!r}.")


@dataclass(frozen=True)
class InputContext:
    """What one input pipeline needs to know to produce its share of the data.

    Passed by `Strategy.distribute_datasets_from_function` to the user's dataset function,
    once per input pipeline (one pipeline per worker).

    Args:
        num_input_pipelines: How many pipelines feed the strategy (= workers).
        input_pipeline_id: This pipeline's index in ``[0, num_input_pipelines)``.
        num_replicas_in_sync: Replicas that consume the data of one step.
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        if self.num_input_pipelines < 1:
            raise ValueError(f"num_input_pipelines must be >= 1. Received: {self.num_input_pipelines}.")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"input_pipeline_id must be in [0, {self.num_input_pipelines}). "
                f"Received: {self.input_pipeline_id}."
            )
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"num_replicas_in_sync must be >= 1. Received: {self.num_replicas_in_sync}.")

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """The batch size of one replica for a given global batch size.

        Raises:
            ValueError: ``global_batch_size`` is not divisible by ``num_replicas_in_sync``.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by "
                f"num_replicas_in_sync ({self.num_replicas_in_sync}). HINT: pick a global "
                f"batch size that is a multiple of the number of replicas."
            )
        return global_batch_size // self.num_replicas_in_sync


class InputReplicationMode(enum.Enum):
    """How many input pipelines a worker runs (tf.distribute.InputReplicationMode).

    PER_WORKER: one pipeline per worker; its batches are split over the local replicas.
    PER_REPLICA: `Strategy.distribute_datasets_from_function` calls the dataset function once
    per replica (its `InputContext` counts replicas as pipelines); each replica reads its own.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclass(frozen=True)
class InputOptions:
    """How distributed input is delivered (tf.distribute.InputOptions).

    Args:
        experimental_fetch_to_device: Move each replica's slice to its device ahead of use.
        experimental_replication_mode: An `InputReplicationMode` (or its name).
        experimental_place_dataset_on_device: Build and iterate each replica's dataset with its
            device as torch's default device, so the tensors it makes are born there (TF places
            the dataset's ops there). Needs PER_REPLICA and ``experimental_fetch_to_device=False``.
        experimental_per_replica_buffer_size: How many batches are prepared ahead per replica
            (prefetch depth, >= 0; 0 prepares nothing ahead).

    Raises:
        ValueError: A negative buffer size, an unknown replication mode, or
            ``experimental_place_dataset_on_device`` without PER_REPLICA or with fetching.
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode | str = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        if self.experimental_per_replica_buffer_size < 0:
            raise ValueError(
                "experimental_per_replica_buffer_size must be >= 0. "
                f"Received: {self.experimental_per_replica_buffer_size}."
            )
        mode = self.experimental_replication_mode
        try:
            mode = InputReplicationMode(mode.upper() if isinstance(mode, str) else mode)
        except ValueError:
            raise ValueError(
                f"experimental_replication_mode must be one of {[m.name for m in InputReplicationMode]}. "
                f"Received: {self.experimental_replication_mode!r}."
            ) from None
        object.__setattr__(self, "experimental_replication_mode", mode)
        if self.experimental_place_dataset_on_device and mode is not InputReplicationMode.PER_REPLICA:
            raise ValueError(
                "experimental_place_dataset_on_device=True needs experimental_replication_mode="
                "InputReplicationMode.PER_REPLICA (as in TensorFlow). Received: PER_WORKER."
            )
        if self.experimental_place_dataset_on_device and self.experimental_fetch_to_device:
            raise ValueError(
                "experimental_place_dataset_on_device=True and experimental_fetch_to_device=True "
                "cannot both be set (as in TensorFlow). HINT: set experimental_fetch_to_device=False."
            )
