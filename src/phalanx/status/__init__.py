"""A live status page for a running job: which worker is slow, which was lost (docs/status_page.md).

Turn it on with ``phalanx launch --status HOST:PORT`` or, for jobs started otherwise
(torchrun, Ray, SLURM, Kubernetes), ``PHALANX_STATUS_ADDRESS=HOST:PORT`` on every task.
"""

from __future__ import annotations

from phalanx.status.board import Board
from phalanx.status.counters import COUNTERS
from phalanx.status.reports import Reporter
from phalanx.status.server import StatusServer
from phalanx.status.settings import ADDRESS_ENV, StatusSettings
from phalanx.status.straggler import find_straggler
from phalanx.status.taking_part import TaskStatus, expect_steps, join_status

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
