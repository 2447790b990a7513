"""Elastic membership in one process, for the membership unit tests: a real TCPStore served
here (the `membership_store` fixture, its port), members made on it, and calls run on threads
as every member makes them at once."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch.distributed as dist

from phalanx.cluster._ports import free_ports
from phalanx.communication.membership.membership import ElasticSettings, Membership
from phalanx.communication.membership.rendezvous import listening_socket

TOKEN = "m" * 32


@pytest.fixture
def membership_store(monkeypatch) -> Iterator[int]:
    """The port of a TCPStore served in this process (the job's token set)."""
    monkeypatch.setenv("PHALANX_CLUSTER_TOKEN", TOKEN)
    (port,) = free_ports(1, "127.0.0.1")
    listening = listening_socket("127.0.0.1", port)  # as the launcher's store (IPv4, loopback only)
    store = dist.TCPStore(
        "127.0.0.1", port, None, is_master=True, wait_for_workers=False, master_listen_fd=listening
    )
    yield port
    del store


def membership(
    port: int, task: int, tasks: int = 3, minimum: int = 2, incarnation: int = 0, timeout: float = 20.0
) -> Membership:
    """Task ``task``'s membership of a ``tasks``-task job on the store at ``port``."""
    settings = ElasticSettings(("127.0.0.1", port), minimum, incarnation, dead_after=1.0)
    return Membership(settings, task, tasks, lambda t: f"worker:{t}", timeout=timeout)


def run_together(*calls: Callable[[], object]) -> list[object]:
    """Runs the calls on threads (every member at once); their results or errors, in order."""
    results: list[object] = [None] * len(calls)

    def run(i: int, call: Callable[[], object]) -> None:
        try:
            results[i] = call()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return results
