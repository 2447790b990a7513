"""Who trains: the chief and worker tasks, in rank order (one rule for resolvers and launcher)."""

from __future__ import annotations

from phalanx.cluster.cluster_spec import ClusterSpec

__all__ = ["TASK_TYPES", "TRAINER_JOBS", "split_address", "trainer_tasks"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
TRAINER_JOBS = ("chief", "worker")


def trainer_tasks(spec: ClusterSpec) -> list[tuple[str, int]]:
    """The chief and worker tasks in torch.distributed rank order.

    The chief (if any) is rank 0 and workers follow by index; without a chief, worker 0 is
    rank 0 (TF's rule: the chief is ``chief:0``, else ``worker:0``).

    Returns:
        ``[(job, index), ...]``, possibly empty.
    """
    return [(job, index) for job in TRAINER_JOBS if job in spec.jobs for index in spec.task_indices(job)]


def split_address(address: str) -> tuple[str, int]:
    """``"host:port"`` → ``("host", port)``; IPv6 hosts keep their brackets (``"[::1]:80"``).

    Raises:
        ValueError: No ``:port`` suffix, an empty host, or a port outside 0..65535.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"A task address must be 'host:port' with a port in 0..65535. Received: {address!r}. "
            "HINT: 'localhost:2222'."
        )
    return host, int(port)
