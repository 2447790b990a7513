"""InputReplicationMode.PER_REPLICA: one dataset per replica, made by the user's function.

`Strategy.distribute_datasets_from_function` with ``InputOptions(experimental_replication_mode=
InputReplicationMode.PER_REPLICA)`` calls the dataset function once per local replica; each
call's `InputContext` counts every replica of the job as an input pipeline (TF's meaning). With
``experimental_place_dataset_on_device=True`` each dataset is made and read with its replica's
device as torch's default device, so the tensors it creates are born there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from phalanx.input.input_options import InputContext, InputOptions
from phalanx.input.splitting import as_tensors, batch_size_of, slice_batch

if TYPE_CHECKING:
    from phalanx.protocols import DistributionStrategy

__all__ = ["PerReplicaInput"]

Pieces = tuple[list[Any], int | None, list[int] | None]


class PerReplicaInput:
    """The local replicas' datasets, and a step function that takes one batch from each.

    Args:
        strategy: The strategy whose local replicas read.
        dataset_fn: Called once per local replica with that replica's `InputContext`.
        options: The input options (``experimental_place_dataset_on_device`` is read).
    """

    def __init__(
        self, strategy: DistributionStrategy, dataset_fn: Callable[[InputContext], Any], options: InputOptions
    ) -> None:
        self._strategy = strategy
        self._on_device = options.experimental_place_dataset_on_device
        self.datasets = []
        for index, device in enumerate(strategy.local_devices):
            context = InputContext(
                num_input_pipelines=strategy.num_replicas_in_sync,
                input_pipeline_id=strategy.first_replica_id + index,
                num_replicas_in_sync=strategy.num_replicas_in_sync,
            )
            with self._place(device):
                self.datasets.append(dataset_fn(context))

    def _place(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        return device if self._on_device else contextlib.nullcontext()

    def first_batch(self) -> Any:
        """Replica 0's first batch (a fresh pass), or None when its dataset is empty."""
        with self._place(self._strategy.local_devices[0]):
            return next(iter(self.datasets[0]), None)

    def step_function(self) -> Callable[[], Pieces | None]:
        """A function giving each step's pieces (one batch per replica) from fresh iterators;
        None when every replica's dataset is exhausted (a shorter one then gives empty batches)."""
        devices = self._strategy.local_devices
        iterators: list[Iterator[Any]] = []
        for dataset, device in zip(self.datasets, devices, strict=True):
            with self._place(device):
                iterators.append(iter(dataset))
        single_worker = self._strategy.num_workers_in_sync == 1

        def next_pieces() -> Pieces | None:
            taken: list[Any] = []
            for iterator, device in zip(iterators, devices, strict=True):
                with self._place(device):
                    taken.append(next(iterator, None))
            present = [as_tensors(b) for b in taken if b is not None]
            if not present:
                return None
            pieces = [as_tensors(b) if b is not None else slice_batch(present[0], 0, 0) for b in taken]
            if not single_worker:
                return pieces, None, None
            sizes = [batch_size_of(p) for p in pieces]
            return pieces, sum(sizes), [sum(sizes[:i]) for i in range(len(sizes))]

        return next_pieces
