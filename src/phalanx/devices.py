"""Device names as users write them ("/gpu:0", "cuda:1", "cpu:0", "/cpu:1") and what torch needs."""

from __future__ import annotations

import re

import torch

__all__ = ["canonical_name", "torch_device"]

_PATTERN = re.compile(
    r"^/?(?:job:\w+/)?(?:replica:\d+/)?(?:task:\d+/)?(?:device:)?(cpu|gpu|cuda)(?::(\d+))?$",
    re.IGNORECASE,
)


def canonical_name(device: str | torch.device) -> str:
    """Normalises a device to "cpu:N" or "cuda:N".

    ``"cpu:N"`` with N > 0 is a *logical* CPU replica (as TF's logical devices): it computes
    on the host CPU like cpu:0, and exists so multi-replica code runs without GPUs.

    Raises:
        ValueError: The name is not a CPU or GPU device.
    """
    index: int | str | None
    if isinstance(device, torch.device):
        kind, index = device.type, device.index
    else:
        match = _PATTERN.match(device.strip())
        if not match:
            raise ValueError(
                f"Unknown device {device!r}. Use 'cpu:N' (logical CPU replicas), 'cuda:N' or '/gpu:N'."
            )
        kind, index = match.group(1).lower(), match.group(2)
    if kind == "gpu":
        kind = "cuda"
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"Only CPU and CUDA devices are supported. Received: {device!r}.")
    return f"{kind}:{int(index or 0)}"


def torch_device(name: str) -> torch.device:
    """The torch device that computes for a canonical name (every cpu:N is the host CPU)."""
    kind, index = name.split(":")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", int(index))
