"""``send`` and ``recv`` of the phalanx process group over an engine's own links (the job's
point-to-point TLS links, `phalanx.communication.transports.tls.peers`), as torch's works
(`phalanx.communication.group.process_group` calls these; where the engine has no links,
the group's gloo carries them)."""

from __future__ import annotations

import torch

from phalanx.communication.group.pg_work import Channel, Engine, Work, check_cpu

__all__ = ["receive", "send"]


def send(engine: Engine, channel: Channel, tensors: list[torch.Tensor], dst: int, tag: int) -> Work:
    """Starts sending ``tensors[0]`` to the group's rank ``dst`` (the caller keeps it unchanged
    until the work is done).

    Raises:
        ValueError: Not exactly one tensor, or one off the CPU.
    """
    tensor = _one(tensors, "send")
    inner = channel.send_async(tensor, dst, tag)
    return Work(engine, inner, channel.describe("send to", dst, tag), lambda: list(tensors))


def receive(engine: Engine, channel: Channel, tensors: list[torch.Tensor], src: int | None, tag: int) -> Work:
    """Starts receiving into ``tensors[0]`` from the group's rank ``src`` (None: any, and the
    work's ``_source_rank`` says who); a tensor that is not contiguous receives through a copy.

    Raises:
        ValueError: Not exactly one tensor, or one off the CPU.
    """
    tensor = _one(tensors, "recv")
    staged = (
        tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
    )
    inner, sender = channel.recv_async(staged.detach(), src, tag)

    def finish() -> list[torch.Tensor]:
        if staged is not tensor:
            tensor.detach().copy_(staged)
        return list(tensors)

    return Work(engine, inner, channel.describe("recv from", src, tag), finish, sender)


def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    """The one CPU tensor of a point-to-point call (gloo's rule)."""
    if len(tensors) != 1:
        raise ValueError(
            f"{what} takes exactly one tensor. Received: {len(tensors)} tensors. HINT: call {what} once "
            "per tensor, or concatenate them."
        )
    check_cpu(tensors, what)
    return tensors[0]
