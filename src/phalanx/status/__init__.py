"""A live status page for a running job: which worker is slow, which was lost (docs/status_page.md).

Turn it on with ``phalanx launch --status HOST:PORT`` or, for jobs started otherwise
(torchrun, Ray, SLURM, Kubernetes), ``PHALANX_STATUS_ADDRESS=HOST:PORT`` on every task.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {  # imported on first use: a worker that serves no page never loads http.server
    "ADDRESS_ENV": "phalanx.status.settings",
    "COUNTERS": "phalanx.status.counters",
    "Board": "phalanx.status.board",
    "Reporter": "phalanx.status.reports",
    "StatusServer": "phalanx.status.server",
    "StatusSettings": "phalanx.status.settings",
    "TaskStatus": "phalanx.status.taking_part",
    "expect_steps": "phalanx.status.taking_part",
    "find_straggler": "phalanx.status.straggler",
    "join_status": "phalanx.status.taking_part",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'phalanx.status' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


__all__ = [
    "ADDRESS_ENV",
    "COUNTERS",
    "Board",
    "Reporter",
    "StatusServer",
    "StatusSettings",
    "TaskStatus",
    "expect_steps",
    "find_straggler",
    "join_status",
]
