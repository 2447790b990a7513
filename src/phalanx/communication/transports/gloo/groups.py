"""The plain gloo groups under phalanx's process groups, with two connections between each pair.

torch makes a gloo group with one *device* (one TCP connection between each pair of workers)
per interface in ``GLOO_SOCKET_IFNAME`` (else one, on the address the host name resolves to),
and gives the group two threads per device. A gloo collective takes its connections from the
device its tag selects (``tag % devices``), and the bytes of collectives that share a
connection queue behind each other on it. A backward pass starts its gradient all-reduces one
after another while the earlier ones are still sending: on one connection the last (small)
bucket waited behind the megabytes of the one before it. With every interface's device listed
twice, consecutive collectives go over different connections and the two gloo threads
overlap them instead (MLP 784-1024-1024-10, 2 workers over gloo: ~23.5 -> ~22.2 ms a step;
docs/performance.md, multi-worker). Three connections, or more threads, measured slower on 2
cores. ``PHALANX_GLOO_CONNECTIONS`` sets the count (1 is torch's own layout).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from phalanx import _hooks, settings
from phalanx.communication.transports.interfaces import GLOO_INTERFACE_ENV

__all__ = ["GLOO_CONNECTIONS", "GLOO_CONNECTIONS_ENV", "gloo_connections", "make_gloo_group"]

GLOO_CONNECTIONS_ENV = "PHALANX_GLOO_CONNECTIONS"
GLOO_CONNECTIONS = 2
_MAX_CONNECTIONS = 8


def gloo_connections() -> int:
    """Connections between each pair of workers per interface: ``PHALANX_GLOO_CONNECTIONS``,
    else `GLOO_CONNECTIONS`.

    Raises:
        ValueError: The variable is not a whole number from 1 to 8.
    """
    return settings.current().gloo_connections


def make_gloo_group(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    """A ``ProcessGroupGloo`` as torch makes it, each interface's device `gloo_connections` times.

    Every worker of the group must make it with the same count (the connections are paired by
    position); ``PHALANX_GLOO_CONNECTIONS`` is read on each, so set it for the whole job.
    """
    interfaces = [name for name in os.environ.get(GLOO_INTERFACE_ENV, "").split(",") if name.strip()]
    if interfaces:
        devices = [dist.ProcessGroupGloo.create_device(interface=name.strip()) for name in interfaces]
    else:
        devices = [dist.ProcessGroupGloo.create_default_device()]
    options = _hooks.gloo_options(
        devices * gloo_connections(),
        threads=2 * len(devices),  # torch's count for these interfaces
        timeout=timeout,
    )
    return dist.ProcessGroupGloo(store, rank, size, options)
