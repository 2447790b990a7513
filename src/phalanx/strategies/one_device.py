"""OneDeviceStrategy: everything on one device, with the API of the distributed strategies."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.strategies.strategy import Strategy

__all__ = ["OneDeviceStrategy"]


class OneDeviceStrategy(Strategy):
    """Places variables and input on one device and runs there (tf.distribute.OneDeviceStrategy).

    Parameters and buffers of modules created in ``scope()`` are placed on the device as they
    are registered; batches from a distributed dataset are moved there ahead of use.

    Args:
        device: "cpu", "cuda:0", "/gpu:0", ...
    """

    def __init__(self, device: str | torch.device) -> None:
        super().__init__([device])

    def _create_parameter(self, module: torch.nn.Module, name: str, param: Any) -> Any:
        device = self._devices[0]
        if param.device == device:
            return None
        return torch.nn.Parameter(param.detach().to(device), requires_grad=param.requires_grad)

    def _create_buffer(self, module: torch.nn.Module, name: str, buffer: Any) -> Any:
        device = self._devices[0]
        return None if buffer.device == device else buffer.to(device)

    def __repr__(self) -> str:
        return f"OneDeviceStrategy(device={self._device_names[0]!r})"
