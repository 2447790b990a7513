"""``phalanx.config``: tf.config's device listing, for the devices phalanx can place replicas on.

Physical devices are the host CPU and each CUDA GPU torch sees. Logical devices are what a
strategy can be given: the CUDA GPUs, and the *logical CPU replicas* ``/device:CPU:0``,
``/device:CPU:1``, ... which all compute on the host CPU (phalanx's ``"cpu:N"``), so that
multi-replica programs run on a machine without GPUs. Their names are accepted wherever a
device is (``MirroredStrategy([d.name for d in list_logical_devices("CPU")])``).

By default there is one logical CPU, as in TensorFlow; `set_logical_device_configuration`
with N `LogicalDeviceConfiguration` objects for the CPU makes `list_logical_devices` list N.
A strategy accepts any number of ``"cpu:i"`` names whatever this setting is: the
configuration only decides what the listing returns.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "LogicalDevice",
    "LogicalDeviceConfiguration",
    "PhysicalDevice",
    "get_logical_device_configuration",
    "list_logical_devices",
    "list_physical_devices",
    "set_logical_device_configuration",
]

_DEVICE_TYPES = ("CPU", "GPU")


class PhysicalDevice(NamedTuple):
    """A device of this machine (tf.config.PhysicalDevice): ``/physical_device:GPU:0``, "GPU"."""

    name: str
    device_type: str


class LogicalDevice(NamedTuple):
    """A device a strategy can place a replica on (tf.config.LogicalDevice): ``/device:CPU:1``, "CPU"."""

    name: str
    device_type: str


@dataclass(frozen=True)
class LogicalDeviceConfiguration:
    """One logical device to make of a physical one (tf.config.LogicalDeviceConfiguration).

    Args:
        memory_limit: For a GPU: the most memory, in MiB, this process may allocate on it
            (applied with ``torch.cuda.set_per_process_memory_fraction``). Ignored for the CPU.
        experimental_priority: Accepted for TF compatibility; has no effect.
    """

    memory_limit: int | None = None
    experimental_priority: int | None = None


_lock = threading.Lock()
_configurations: dict[str, list[LogicalDeviceConfiguration]] = {}


def _check_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    upper = device_type.upper()
    if upper not in _DEVICE_TYPES:
        raise ValueError(
            f"device_type must be 'CPU', 'GPU' or None. Received: {device_type!r}. "
            "HINT: phalanx places replicas on the host CPU and CUDA GPUs only (no TPU)."
        )
    return upper


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The host CPU and every CUDA GPU torch sees, as TF names them.

    Args:
        device_type: "CPU", "GPU" (either case) or None for all.

    Raises:
        ValueError: Another device type.
    """
    wanted = _check_type(device_type)
    devices = [PhysicalDevice("/physical_device:CPU:0", "CPU")]
    devices += [PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(_gpu_count())]
    return [d for d in devices if wanted in (None, d.device_type)]


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """The devices a strategy can be given: the logical CPUs, then every CUDA GPU.

    ``/device:CPU:i`` is phalanx's logical CPU replica ``"cpu:i"``; ``/device:GPU:i`` is
    ``"cuda:i"``. Either spelling works in a strategy's device list.

    Args:
        device_type: "CPU", "GPU" (either case) or None for all.

    Raises:
        ValueError: Another device type.
    """
    wanted = _check_type(device_type)
    with _lock:
        cpus = len(_configurations.get("/physical_device:CPU:0", [])) or 1
    devices = [LogicalDevice(f"/device:CPU:{i}", "CPU") for i in range(cpus)]
    devices += [LogicalDevice(f"/device:GPU:{i}", "GPU") for i in range(_gpu_count())]
    return [d for d in devices if wanted in (None, d.device_type)]


def _physical(device: PhysicalDevice | str) -> PhysicalDevice:
    name = device.name if isinstance(device, PhysicalDevice) else device
    for known in list_physical_devices():
        if known.name == name:
            return known
    raise ValueError(
        f"Unknown physical device {name!r}. HINT: pass one of phalanx.config.list_physical_devices(): "
        f"{[d.name for d in list_physical_devices()]}."
    )


def set_logical_device_configuration(
    device: PhysicalDevice | str, logical_devices: Sequence[LogicalDeviceConfiguration] | None
) -> None:
    """Sets how a physical device is presented as logical devices (tf.config's function).

    For the CPU, N configurations make `list_logical_devices` list N logical CPUs (a strategy
    accepts any number of ``"cpu:i"`` names regardless). For a GPU, one configuration with a
    ``memory_limit`` caps this process's allocations on it; torch cannot split a GPU, so more
    than one is refused. ``None`` or ``[]`` restores the default.

    Raises:
        ValueError: Unknown device, or several logical devices asked of one GPU.
    """
    physical = _physical(device)
    configs = list(logical_devices or [])
    if physical.device_type == "GPU":
        _configure_gpu(physical, configs)
    with _lock:
        if configs:
            _configurations[physical.name] = configs
        else:
            _configurations.pop(physical.name, None)


def _configure_gpu(physical: PhysicalDevice, configs: list[LogicalDeviceConfiguration]) -> None:
    if len(configs) > 1:
        raise ValueError(
            f"A GPU cannot be split into several logical GPUs with torch. Received: {len(configs)} "
            f"configurations for {physical.name}. HINT: use one replica per GPU, or logical CPU "
            "replicas ('cpu:0', 'cpu:1', ...) to test multi-replica code."
        )
    if configs and configs[0].memory_limit is not None:
        import torch

        index = int(physical.name.rsplit(":", 1)[1])
        total_mib = torch.cuda.get_device_properties(index).total_memory / 2**20
        torch.cuda.set_per_process_memory_fraction(min(1.0, configs[0].memory_limit / total_mib), index)


def get_logical_device_configuration(device: PhysicalDevice | str) -> list[LogicalDeviceConfiguration] | None:
    """The configurations set for ``device`` (None when it has the default).

    Raises:
        ValueError: Unknown device.
    """
    physical = _physical(device)
    with _lock:
        configs = _configurations.get(physical.name)
    return list(configs) if configs is not None else None
