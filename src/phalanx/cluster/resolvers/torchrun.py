"""TorchrunClusterResolver: the cluster from torchrun's environment variables."""

from __future__ import annotations

import os
from collections.abc import Mapping

from phalanx.cluster.cluster_spec import ClusterSpec
from phalanx.cluster.resolvers.cluster_resolver import ClusterResolver
from phalanx.cluster.validation import validate

__all__ = ["TORCHRUN_ARGUMENTS", "TorchrunClusterResolver", "refuse_torchrun_arguments"]

_HINT = (
    "HINT: start the program with torchrun or `phalanx launch`, or set RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT yourself."
)

# torchrun's arguments as variables (torch.distributed.run reads PET_<ARG> as --<arg>'s default):
# what Kubeflow Trainer's torch runtime sets on each node of a TrainJob
TORCHRUN_ARGUMENTS = (
    "PET_NNODES",
    "PET_NPROC_PER_NODE",
    "PET_NODE_RANK",
    "PET_MASTER_ADDR",
    "PET_MASTER_PORT",
)


def refuse_torchrun_arguments(env: Mapping[str, str]) -> None:
    """Raises when torchrun's ``PET_*`` arguments are set but torchrun did not start this process
    (no ``RANK``): the program would otherwise train alone, as a world of one, and exit 0.

    Raises:
        ValueError: Naming the variables and torchrun.
    """
    found = [f"{name}={env[name]}" for name in TORCHRUN_ARGUMENTS if name in env]
    if found:
        raise ValueError(
            "PET_* variables are torchrun's arguments (a Kubeflow TrainJob sets them for torchrun), and "
            "only torchrun turns them into each process's RANK and WORLD_SIZE; this process was not "
            f"started by torchrun (RANK is unset). Received: {', '.join(found)}. HINT: start it with "
            "`torchrun prog.py ...` (the TrainJob torch runtime's command), or unset the PET_* variables "
            "for a single process (docs/clusters.md)."
        )


class TorchrunClusterResolver(ClusterResolver):
    """Reads torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` (when the resolver is created).

    Every process is a ``worker`` task: ``task_id = RANK``, and the cluster has
    ``WORLD_SIZE`` workers. torchrun tells a process only the rendezvous address, so only
    ``worker:0`` has a real address (``MASTER_ADDR:MASTER_PORT``, which is what
    ``chief_address()`` returns and what torch.distributed needs). Rank ``r > 0`` is recorded
    as the placeholder ``rank-<r>.torchrun.invalid:<MASTER_PORT>`` (``.invalid`` is reserved:
    it never resolves), which shows in messages but must not be dialled.

    ``MASTER_ADDR``/``MASTER_PORT`` may be left unset when ``WORLD_SIZE`` is 1 (they default
    to ``127.0.0.1:29500``); ``LOCAL_RANK`` defaults to 0 and ``LOCAL_WORLD_SIZE`` to 1.

    Raises:
        ValueError: A required variable is unset, not an integer, or out of range (the
            message names it).
    """

    source = "torchrun's environment"

    def __init__(self) -> None:
        env = os.environ
        world = _int_var(env, "WORLD_SIZE", low=1)
        rank = _int_var(env, "RANK", low=0, high=world, bound="WORLD_SIZE")
        local_world = _int_var(env, "LOCAL_WORLD_SIZE", low=1, default=1)
        self._local_rank = _int_var(
            env, "LOCAL_RANK", low=0, high=local_world, bound="LOCAL_WORLD_SIZE", default=0
        )
        self._local_world_size = local_world
        single = world == 1
        host = env.get("MASTER_ADDR") or _require(single, "MASTER_ADDR", "127.0.0.1")
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"  # an IPv6 MASTER_ADDR: bracketed, so that host:port stays unambiguous
        port = _int_var(env, "MASTER_PORT", low=0, high=65536, default=None if not single else 29500)
        workers = [f"{host}:{port}"] + [f"rank-{r}.torchrun.invalid:{port}" for r in range(1, world)]
        self._spec = ClusterSpec({"worker": workers})
        validate(self._spec, "worker", rank, self.source)
        self.task_type, self.task_id = "worker", rank

    def cluster_spec(self) -> ClusterSpec:
        """``WORLD_SIZE`` workers; only ``worker:0``'s address is real (see the class doc)."""
        return self._spec

    @property
    def local_rank(self) -> int:
        """``LOCAL_RANK``: this process's index on its machine (picks its GPU)."""
        return self._local_rank

    @property
    def local_world_size(self) -> int:
        """``LOCAL_WORLD_SIZE``: processes on this machine."""
        return self._local_world_size


def _require(optional: bool, name: str, default: str) -> str:
    if not optional:
        raise ValueError(f"torchrun's environment is incomplete: {name} is not set. {_HINT}")
    return default


def _int_var(
    env: Mapping[str, str],
    name: str,
    low: int,
    high: int | None = None,
    bound: str | None = None,
    default: int | None = None,
) -> int:
    text = env.get(name)
    if text is None:
        if default is None:
            raise ValueError(f"torchrun's environment is incomplete: {name} is not set. {_HINT}")
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer. Received: {name}={text!r}. {_HINT}") from None
    if value < low or (high is not None and value >= high):
        upper = f"{bound}={high}" if bound else str(high)
        limits = f"[{low}, {upper})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be in {limits}. Received: {name}={value}.")
    return value
