"""Which strategy a cluster resolver was given to: how code handed only
``strategy.cluster_resolver`` (TF's ``PreemptionCheckpointHandler(cluster_resolver, ...)``, made
outside the scope) finds the strategy that joins the workers."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["claim", "owner_of"]

# id(resolver) -> the strategy made with it; weak, so a strategy dies with its last reference
_owners: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def claim(resolver: Any, strategy: Any) -> None:
    """Records that ``strategy`` was made with ``resolver`` (its constructor, every worker)."""
    _owners[id(resolver)] = strategy


def owner_of(resolver: Any) -> Any | None:
    """The live strategy last made with ``resolver``, or None."""
    strategy = _owners.get(id(resolver))
    if strategy is None or strategy.cluster_resolver is not resolver:  # an id reused after collection
        return None
    return strategy
