"""Options for cross-process collectives (tf.distribute.experimental.CommunicationOptions)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

__all__ = ["CommunicationImplementation", "CommunicationOptions"]


class CommunicationImplementation(enum.Enum):
    """Which collective engine carries cross-worker traffic.

    RING: torch.distributed's gloo backend (CPU tensors; GPU tensors are staged through CPU).
    NCCL: torch.distributed's nccl backend (CUDA tensors only).
    AUTO: NCCL when every local device is a GPU and NCCL is available, else RING.
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


@dataclass(frozen=True)
class CommunicationOptions:
    """How collectives are run; can be given to a strategy and overridden per call.

    Args:
        bytes_per_pack: Gradients are all-reduced in buckets of about this many bytes as
            they become ready (0 = phalanx's default of 25 MiB, as DDP).
        timeout_seconds: A collective that takes longer fails with an error naming the
            missing workers (None = the strategy's default).
        implementation: See `CommunicationImplementation`.
        stall_timeout_seconds: Workers that wait this long in collectives that cannot meet
            (they took different paths) all raise `CollectiveMismatchError` naming each one's
            pending collective and call site (None = ``PHALANX_STALL_TIMEOUT_SECONDS`` or
            30 s; `phalanx.communication.checks.stall_inspector`). Set per strategy, not per call.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO
    stall_timeout_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be >= 0. Received: {self.bytes_per_pack}.")
        if self.timeout_seconds is not None and self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive or None. Received: {self.timeout_seconds}.")
        if self.stall_timeout_seconds is not None and not self.stall_timeout_seconds > 0:
            raise ValueError(
                f"stall_timeout_seconds must be positive or None. Received: {self.stall_timeout_seconds}. "
                "HINT: turn the stall inspector off with PHALANX_STALL_INSPECTOR=0 instead."
            )
        impl = self.implementation
        if isinstance(impl, str):
            try:
                impl = CommunicationImplementation[impl.upper()]
            except KeyError:
                raise ValueError(
                    f"implementation must be AUTO, RING or NCCL. Received: {self.implementation!r}."
                ) from None
            object.__setattr__(self, "implementation", impl)

    def merge(self, override: CommunicationOptions | None) -> CommunicationOptions:
        """These options with the non-default fields of ``override`` applied."""
        if override is None:
            return self
        changes = {
            name: getattr(override, name)
            for name in ("bytes_per_pack", "timeout_seconds", "stall_timeout_seconds")
            if getattr(override, name) not in (0, None)
        }
        if override.implementation is not CommunicationImplementation.AUTO:
            changes["implementation"] = override.implementation
        return replace(self, **changes)
