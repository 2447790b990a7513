"""What both ends of the parameter server's gRPC share: the service, the handler type and the
methods a ps task also serves on its data path (`phalanx.ps.transport` for the whole picture)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from phalanx.ps import wire

Handler = Callable[
    [dict[str, Any], list[torch.Tensor]], tuple[dict[str, Any], list[torch.Tensor]] | wire.Packed
]
SERVICE = "phalanx.Task"
DATA_PATH_METHOD = "__data_path__"  # where a task's data path listens, and for which methods
# the methods a client asks a task's data path for (a ps task's reads and writes)
DATA_PATH_METHODS = frozenset(
    {"read", "read_if_newer", "read_since", "read_rows"}
    | {"apply_gradients", "assign", "assign_add", "create", "run"}
)


def as_is(data: bytes) -> bytes:
    """gRPC's (de)serializer for our messages: they are bytes already (`phalanx.ps.wire`)."""
    return data
