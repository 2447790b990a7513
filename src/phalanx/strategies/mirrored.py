"""MirroredStrategy: one replica per local device, in one process (tf.distribute.MirroredStrategy)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from phalanx import config
from phalanx.communication.local.cross_device_ops import CrossDeviceOps
from phalanx.devices import canonical_name
from phalanx.strategies.strategy import DEFAULT_TIMEOUT_SECONDS, Strategy

__all__ = ["MirroredStrategy", "default_devices"]


def default_devices() -> list[str]:
    """All visible GPUs, else the logical CPUs: one, unless `phalanx.config` split the CPU
    (``set_logical_device_configuration``), as TF's MirroredStrategy() picks its devices."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [canonical_name(device.name) for device in config.list_logical_devices("CPU")]


class MirroredStrategy(Strategy):
    """Synchronous training with one replica per device; variables mirrored on every replica.

    Replicas run concurrently on persistent threads. Parameters created in ``scope()`` become
    `MirroredVariable`s (one copy per replica), buffers `SyncOnReadVariable`s. At
    ``optimizer.step()`` inside ``run`` gradients are summed across replicas and every
    replica applies the same update to its own copy, with its own optimizer state.

    Args:
        devices: e.g. ``["cuda:0", "cuda:1"]``, ``["/gpu:0", "/gpu:1"]`` or logical CPU
            replicas ``["cpu:0", "cpu:1"]``. Default: all visible GPUs, else one CPU replica.
        cross_device_ops: A `CrossDeviceOps`; default chosen from the devices as TF does
            (NCCL across GPUs, else reduction to one device).
        timeout_seconds: How long a replica waits for the others at a meeting point.
        sync_batch_norm: Batch-norm layers (any ``torch.nn.BatchNorm*d``) registered as
            submodules in ``scope()`` become `phalanx.nn.SyncBatchNorm`, whose statistics are
            those of the global batch, as on one device. By default each replica normalises
            with its own slice of the batch, as TF's BatchNormalization does.
    """

    def __init__(
        self,
        devices: Sequence[str | torch.device] | None = None,
        cross_device_ops: CrossDeviceOps | None = None,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        sync_batch_norm: bool = False,
    ) -> None:
        super().__init__(
            devices if devices is not None else default_devices(), cross_device_ops, timeout_seconds
        )
        self._sync_batch_norm = sync_batch_norm
