"""What MultiWorkerMirroredStrategy takes from its cluster before it joins: this worker's
devices, the tasks' names for messages, and TF's deprecated ``communication=`` argument."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable

import torch

from phalanx.cluster.resolvers import ClusterResolver
from phalanx.communication.local.options import CommunicationImplementation, CommunicationOptions

__all__ = ["deprecated_communication", "local_devices", "task_name"]


def local_devices(resolver: ClusterResolver) -> list[str]:
    """This worker's GPU (LOCAL_RANK's) or all its GPUs, else one CPU replica."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return ["cpu:0"]
    local_rank = getattr(resolver, "local_rank", None)
    if local_rank is None and os.environ.get("LOCAL_RANK", "").strip().isdigit():
        local_rank = int(os.environ["LOCAL_RANK"])
    if local_rank is not None:
        return [f"cuda:{int(local_rank) % count}"]
    return [f"cuda:{i}" for i in range(count)]


def task_name(resolver: ClusterResolver) -> Callable[[int], str]:
    """``name(rank) -> "worker:1 (host:port)"`` for messages."""
    named = getattr(resolver, "task_name", None)
    if callable(named):
        return named  # type: ignore[no-any-return]
    return lambda rank: f"worker:{rank}"


def deprecated_communication(
    communication: CommunicationImplementation | None, options: CommunicationOptions | None
) -> CommunicationOptions | None:
    """TF's ``communication=`` (deprecated) as ``CommunicationOptions(implementation=...)``."""
    if communication is None:
        return options
    if options is not None:
        raise ValueError(
            "Give communication_options or the deprecated communication, not both. Received: "
            f"communication={communication!r} and communication_options={options!r}. HINT: "
            "communication_options=CommunicationOptions(implementation=...)."
        )
    warnings.warn(
        "MultiWorkerMirroredStrategy(communication=...) is deprecated (as in TensorFlow): use "
        "communication_options=phalanx.CommunicationOptions(implementation=...).",
        DeprecationWarning,
        stacklevel=3,
    )
    return CommunicationOptions(implementation=communication)
