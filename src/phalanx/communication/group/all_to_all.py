"""``all_to_all`` on a phalanx process group whose transport has no point-to-point (the TLS
ring): carried by all-gathers, so it stays encrypted between machines.

Every worker first gathers how many elements each worker sends to each (a W x W table),
then gathers every worker's parts laid end to end (padded to the longest) and keeps the
parts addressed to it. Each worker receives W times the bytes of a true all-to-all: right
for the small exchanges (pipeline stages' metadata, a DeviceMesh's checks) it exists for.
"""

from __future__ import annotations

import torch

from phalanx.communication.group.pg_work import Engine, Work

__all__ = ["all_to_all_by_gather"]


def all_to_all_by_gather(
    engine: Engine, sends: list[torch.Tensor], receives: list[torch.Tensor], what: str
) -> Work:
    """Sends ``sends[j]`` to worker j and receives worker r's part for this one into
    ``receives[r]`` (all workers, W of each, one dtype). Blocks on the gather of the sizes.

    Raises:
        ValueError: A part's size differs from the size its receiver expects (both workers
            raise, naming the pair).
    """
    me, world = engine.rank, engine.world_size
    sizes = [s.numel() for s in sends] + [r.numel() for r in receives]  # sent to j, expected from r
    table_work, rows = engine.all_gather_async(torch.tensor(sizes, dtype=torch.int64))
    engine.wait(table_work, f"{what} (sizes)")
    both = torch.stack(rows).tolist()
    table = [row[:world] for row in both]  # table[r][j]: elements worker r sends to worker j
    for r in range(world):  # every worker checks every pair: all raise, or none
        for j in range(world):
            if table[r][j] != both[j][world + r]:
                raise ValueError(
                    f"{what}: worker {r} sends {table[r][j]} elements to worker {j}, which expects "
                    f"{both[j][world + r]}. HINT: pass output splits equal to the senders' input splits."
                )
    longest = max(1, *(sum(row) for row in table))
    payload = torch.zeros(longest, dtype=sends[0].dtype)
    if sends:
        mine = torch.cat([s.reshape(-1) for s in sends])
        payload[: mine.numel()] = mine
    inner, parts = engine.all_gather_async(payload)

    def finish() -> list[torch.Tensor]:
        for r, part in enumerate(parts):
            start = sum(table[r][:me])
            target = receives[r]
            target.copy_(part[start : start + target.numel()].view_as(target))
        return receives

    return Work(engine, inner, what, finish)
