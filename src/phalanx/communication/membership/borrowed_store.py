"""The store of a torch.distributed group that something else initialised (Ray Train, a user's
``init_process_group``): where phalanx's rendezvous goes instead of serving its own.

Ray Train's ``TorchTrainer`` (and any harness that calls ``init_process_group`` before the
training function) has already made the default group and its TCPStore at
``MASTER_ADDR:MASTER_PORT``. A MultiWorkerMirroredStrategy made afterwards borrows both: every
worker opens its own client connections to that TCPStore (its own timeouts, its own heartbeat
connection) and keeps its keys under a prefix of its own, and the strategy's collectives run on
the borrowed group (`WorkerGroup`'s ``"borrowed"`` ownership), so there is no second store and
no second ``init_process_group``. What a borrowed group cannot have is listed in
docs/clusters.md: its per-collective deadline is the harness's group timeout wherever gloo's
own deadline applies, and the store listens where the harness put it (every interface, for
torch's TCPStore), with no cluster token unless every worker was given the same one.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import torch.distributed as dist

__all__ = ["borrowed_prefix", "borrowed_store", "claim_default_group"]

_generations = itertools.count()  # one per borrowed group in this process, the same on every worker
_own: weakref.WeakSet[Any] = weakref.WeakSet()  # default groups phalanx initialised: not borrowed


def claim_default_group() -> None:
    """Records that phalanx initialised the current default group (`WorkerGroup`, right after its
    ``init_process_group``): code that looks for a borrowed store then finds none."""
    _own.add(dist.group.WORLD)


def borrowed_prefix() -> str:
    """A fresh key prefix for a group on a borrowed store: ``phalanx/borrowed/<n>/`` for the n-th
    group this process makes (all workers, in the same order): a store that outlives a group must
    not show one group's check-ins to the next."""
    return f"phalanx/borrowed/{next(_generations)}/"


def borrowed_store() -> tuple[str, int] | None:
    """``(host, port)`` of the initialised default group's TCPStore, or None when torch.distributed
    is not initialised, or phalanx initialised it (every worker, before it opens a rendezvous: a
    group's, the preemption board's).

    Raises:
        ValueError: The initialised group's store is not a TCPStore (a FileStore, say), which
            other processes cannot reach by address.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.group.WORLD in _own:
        return None
    store: Any = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise ValueError(
            "MultiWorkerMirroredStrategy borrows an initialised torch.distributed group only when its "
            f"store is a TCPStore (init_method 'env://' or 'tcp://'). Received: a group whose store is a "
            f"{type(store).__name__}. HINT: initialise torch.distributed with init_method='env://' (or "
            "'tcp://HOST:PORT'), or let the strategy initialise it (do not call init_process_group)."
        )
    return str(store.host), int(store.port)
