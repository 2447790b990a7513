"""Distributed values: what `Strategy.run` takes and returns.

A distributed value has one component per *local* replica (the replicas of this process).
`PerReplica` components may differ; `Mirrored` components are equal copies. Functions here
pack and unpack them; they never communicate.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["DistributedValues", "Mirrored", "PerReplica", "ReduceOp"]


class ReduceOp(enum.Enum):
    """How values of several replicas combine (tf.distribute.ReduceOp)."""

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def coerce(cls, op: ReduceOp | str) -> ReduceOp:
        """Accepts a ReduceOp or its name in any case ("sum", "MEAN")."""
        if type(op) is cls:
            return op
        found = _REDUCE_OPS.get(op.upper()) if isinstance(op, str) else None  # (reduce runs every step)
        if found is None:
            raise ValueError(
                f"reduce op must be ReduceOp.SUM, ReduceOp.MEAN, 'SUM' or 'MEAN'. Received: {op!r}."
            )
        return found


_REDUCE_OPS = {op.name: op for op in ReduceOp}


class DistributedValues:
    """Base of values that hold one component per local replica.

    Args:
        values: The components, in local replica order.
    """

    __slots__ = ("_global_batch_size", "_values")

    def __init__(self, values: Sequence[Any]) -> None:
        if not values:
            raise ValueError("A distributed value needs at least one component. Received: ().")
        self._values = tuple(values)
        self._global_batch_size: int | None = None

    @property
    def values(self) -> tuple[Any, ...]:
        """The components, in local replica order."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ",\n".join(f"  {i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{\n{body}\n}}"


class PerReplica(DistributedValues):
    """One possibly different value per local replica (tf.distribute.DistributedValues)."""

    __slots__ = ()


class Mirrored(DistributedValues):
    """The same value on every local replica."""

    __slots__ = ()


def select_replica(replica_index: int, structure: Any) -> Any:
    """Replaces every distributed value in ``structure`` by its component for one replica."""
    if isinstance(structure, DistributedValues):
        return structure.values[replica_index]
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):  # namedtuple
        return type(structure)(*(select_replica(replica_index, v) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(select_replica(replica_index, v) for v in structure)
    if isinstance(structure, dict):
        return type(structure)((k, select_replica(replica_index, v)) for k, v in structure.items())
    return structure


def regroup(per_replica: Sequence[Any], wrap: type[DistributedValues] = PerReplica) -> Any:
    """Turns a list of same-shaped structures (one per replica) into one structure of values.

    Leaves that are the same object on every replica stay plain; others become ``wrap``.
    With a single replica the structure is returned unchanged.
    """
    if len(per_replica) == 1:
        return per_replica[0]
    first = per_replica[0]
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(regroup([r[i] for r in per_replica], wrap) for i in range(len(first))))
    if isinstance(first, (list, tuple)) and all(
        type(r) is type(first) and len(r) == len(first) for r in per_replica
    ):
        return type(first)(regroup([r[i] for r in per_replica], wrap) for i in range(len(first)))
    if isinstance(first, dict) and all(isinstance(r, dict) and r.keys() == first.keys() for r in per_replica):
        return type(first)((k, regroup([r[k] for r in per_replica], wrap)) for k in first)
    if all(r is first for r in per_replica):
        return first
    return wrap(per_replica)


def local_results(value: Any) -> tuple[Any, ...]:
    """The local components of ``value``: its components, or ``(value,)`` for a plain value."""
    if isinstance(value, DistributedValues):
        return value.values
    return (value,)


def map_structure(fn: Callable[[Any], Any], structure: Any) -> Any:
    """Applies ``fn`` to every tensor leaf of a nested tuple/list/dict structure."""
    if isinstance(structure, torch.Tensor):
        return fn(structure)
    if isinstance(structure, tuple) and hasattr(structure, "_fields"):
        return type(structure)(*(map_structure(fn, v) for v in structure))
    if isinstance(structure, (list, tuple)):
        return type(structure)(map_structure(fn, v) for v in structure)
    if isinstance(structure, dict):
        return type(structure)((k, map_structure(fn, v)) for k, v in structure.items())
    return structure


def iter_leaves(structure: Any) -> Iterator[Any]:
    """The leaves of a nested tuple/list/dict structure, depth first, lazily (a search that
    finds what it wants in the first leaf does not walk the rest)."""
    if isinstance(structure, (list, tuple)):
        for v in structure:
            yield from iter_leaves(v)
    elif isinstance(structure, dict):
        for v in structure.values():
            yield from iter_leaves(v)
    else:
        yield structure


def flatten(structure: Any) -> list[Any]:
    """The leaves of a nested tuple/list/dict structure, depth first."""
    if isinstance(structure, (list, tuple)):
        return [leaf for v in structure for leaf in flatten(v)]
    if isinstance(structure, dict):
        return [leaf for v in structure.values() for leaf in flatten(v)]
    return [structure]
