"""Running a TF_CONFIG cluster's tasks on simulated hosts (helpers of the multihost tier)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from multihost.hosts import HostProcess, SimulatedHosts

TESTS = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"
PORT = 23456  # every host has its own network namespace: the same port on each never collides
# what the tasks must not inherit from the test's environment: the test sets the cluster
_CLUSTER_VARS = (
    *("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"),
    *("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "PHALANX_SHARED_MEMORY"),
)


def base_env(**extra: str) -> dict[str, str]:
    """This environment without any cluster configuration, with ``tests/`` importable."""
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PHALANX_JOIN_TIMEOUT_SECONDS", "90")
    return {**env, **extra}


def worker_cluster(hosts: SimulatedHosts, per_host: int = 1) -> dict[str, list[str]]:
    """``{"worker": [...]}`` with ``per_host`` workers on each host, host by host."""
    return {"worker": [f"{h.url_host}:{PORT + k}" for h in hosts for k in range(per_host)]}


def tf_config(cluster: dict[str, list[str]], job: str, index: int) -> str:
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})


def start_workers(
    hosts: SimulatedHosts, script: str, args: Sequence[object], **env: str
) -> list[HostProcess]:
    """Starts ``scripts/<script> args...`` as ``worker:i`` on host ``i`` (all with TF_CONFIG)."""
    cluster = worker_cluster(hosts)
    return [
        host.run(
            [sys.executable, str(SCRIPTS / script), *map(str, args)],
            base_env(TF_CONFIG=tf_config(cluster, "worker", i), **env),
            name=f"worker-{i}",
        )
        for i, host in enumerate(hosts)
    ]


def wait_all(processes: Sequence[HostProcess], timeout: float) -> tuple[list[int | None], str]:
    """Every process's exit code (None: still running after ``timeout``, then killed) and
    their output, one after the other."""
    deadline = time.monotonic() + timeout
    codes = [p.wait(max(deadline - time.monotonic(), 0.1))[0] for p in processes]
    for p in processes:
        p.kill()
    return codes, "\n".join(p.output for p in processes)


def wait_for(condition, timeout: float, processes: Sequence[HostProcess], what: str) -> None:
    """Polls ``condition()`` until true; fails naming ``what`` after ``timeout`` or once a process exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        ended = [p.name for p in processes if p.poll() is not None]
        if ended or time.monotonic() > deadline:
            output = "\n".join(p.output for p in processes)
            raise AssertionError(f"gave up waiting for {what} (ended: {ended}):\n{output}")
        time.sleep(0.1)


def start_cluster(
    hosts: SimulatedHosts, tasks: Sequence[tuple[str, int]], script: str, args: Sequence[object], **env: str
) -> dict[str, HostProcess]:
    """Starts ``scripts/<script> args...`` as task ``tasks[i]`` (``("ps", 0)``) on host ``i``,
    each with the TF_CONFIG of the whole cluster; returns them by name (``"ps:0"``)."""
    cluster: dict[str, list[str]] = {}
    for (job, _), host in zip(tasks, hosts, strict=True):
        cluster.setdefault(job, []).append(f"{host.url_host}:{PORT}")
    return {
        f"{job}:{index}": host.run(
            [sys.executable, str(SCRIPTS / script), *map(str, args)],
            base_env(TF_CONFIG=tf_config(cluster, job, index), **env),
            name=f"{job}-{index}",
        )
        for (job, index), host in zip(tasks, hosts, strict=True)
    }
