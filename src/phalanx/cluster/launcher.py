"""`phalanx launch`: a local cluster, one process per task, each with its own TF_CONFIG.

Every line a task prints is prefixed with its name (``[worker-1] ...``). When a task fails,
the others are stopped and the launcher exits non-zero naming it; when every worker has
finished, parameter servers are stopped. Chief and worker tasks also get torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so torchrun scripts run
unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

__all__ = [
    "add_launch_arguments",
    "free_ports",
    "launch",
    "launch_node",
    "node_environments",
    "run_launch",
    "task_environments",
]

GRACE_SECONDS = 5.0


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` right now."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def task_environments(
    workers: int, ps: int = 0, chief: bool = False, host: str = "127.0.0.1"
) -> dict[str, dict[str, str]]:
    """One environment per task of a loopback cluster: TF_CONFIG plus torchrun's variables.

    Raises:
        ValueError: No worker task, or negative counts.
    """
    if workers < 0 or ps < 0 or workers + int(chief) < 1:
        raise ValueError(
            f"A cluster needs at least one chief or worker task. Received: workers={workers}, ps={ps}."
        )
    ports = iter(free_ports(workers + ps + int(chief) + 1, host))
    cluster: dict[str, list[str]] = {}
    if chief:
        cluster["chief"] = [f"{host}:{next(ports)}"]
    if workers:
        cluster["worker"] = [f"{host}:{next(ports)}" for _ in range(workers)]
    if ps:
        cluster["ps"] = [f"{host}:{next(ports)}" for _ in range(ps)]
    master_port = str(next(ports))
    trainers = [(job, i) for job in ("chief", "worker") for i in range(len(cluster.get(job, [])))]
    envs = {}
    for job, tasks in cluster.items():
        for index in range(len(tasks)):
            env = {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}
            if (job, index) in trainers:
                rank = trainers.index((job, index))
                env.update(
                    RANK=str(rank),
                    WORLD_SIZE=str(len(trainers)),
                    LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(len(trainers)),
                    MASTER_ADDR=host,
                    MASTER_PORT=master_port,
                )
            envs[f"{job}-{index}"] = env
    return envs


@dataclass
class _Task:
    name: str
    process: subprocess.Popen[bytes]
    is_ps: bool


def _pump(name: str, stream: IO[bytes], out: IO[str]) -> None:
    for raw in iter(stream.readline, b""):
        out.write(f"[{name}] {raw.decode(errors='replace')}")
        out.flush()
    stream.close()


def _command(target: str | Callable[..., Any], args: Sequence[str]) -> list[str]:
    if callable(target):
        module, name = target.__module__, target.__qualname__
        if module == "__main__" or "." in name:
            raise ValueError(
                f"launch needs a module-level function of an importable module. Received: {target!r}."
            )
        target = f"{module}:{name}"
    if ":" in target and not os.path.exists(target):
        module, name = target.split(":", 1)
        code = f"import sys, {module} as m; sys.argv = ['{name}', *sys.argv[1:]]; sys.exit(m.{name}())"
        return [sys.executable, "-u", "-c", code, *args]
    if not os.path.exists(target):
        raise ValueError(f"No such script: {target!r}. Pass a script path or 'module:function'.")
    return [sys.executable, "-u", target, *args]


def _stop(tasks: list[_Task]) -> None:
    for task in tasks:
        if task.process.poll() is None:
            task.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_SECONDS
    for task in tasks:
        try:
            task.process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            task.process.kill()
            task.process.wait()


def launch(
    target: str | Callable[..., Any],
    *,
    workers: int = 2,
    ps: int = 0,
    chief: bool = False,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    out: IO[str] | None = None,
) -> int:
    """Runs ``target`` once per task of a loopback cluster and waits.

    Args:
        target: A script path, ``"module:function"`` or a module-level function.
        workers, ps, chief: The cluster's tasks.
        args: Command-line arguments for every task.
        env: Extra environment variables for every task.
        timeout: Seconds before every task is killed (None: no limit).
        out: Where prefixed output goes (default stdout).

    Returns:
        0 when every chief/worker task succeeded; else the first failure's exit code
        (124 on timeout).
    """
    return _run_tasks(_command(target, args), task_environments(workers, ps, chief), env, timeout, out)


def node_environments(
    cluster: dict[str, Any] | str, node: str | None = None, tasks: Sequence[tuple[str, int]] | None = None
) -> dict[str, dict[str, str]]:
    """TF_CONFIGs for the tasks of a real cluster that run on this node.

    Args:
        cluster: The cluster (a dict of job -> addresses, or a TF_CONFIG / cluster JSON string).
        node: Select the tasks whose address host is this name (default: this host's name).
        tasks: Or name the tasks explicitly, as (job, index) pairs.

    Raises:
        ValueError: No task of the cluster runs on this node.
    """
    from phalanx.cluster.cluster_spec import ClusterSpec

    if isinstance(cluster, str):
        parsed = json.loads(cluster)
        spec = ClusterSpec(parsed.get("cluster", parsed))
    else:
        spec = ClusterSpec(cluster)
    host = node or socket.gethostname()
    chosen = (
        list(tasks)
        if tasks is not None
        else [
            (job, i)
            for job in spec.jobs
            for i in spec.task_indices(job)
            if spec.task_address(job, i).rsplit(":", 1)[0] == host
        ]
    )
    if not chosen:
        raise ValueError(
            f"No task of the cluster runs on node {host!r}. Cluster: {spec.as_dict()}. HINT: pass --node."
        )
    cluster_dict = spec.as_dict()
    return {
        f"{job}-{index}": {
            "TF_CONFIG": json.dumps({"cluster": cluster_dict, "task": {"type": job, "index": index}})
        }
        for job, index in chosen
    }


def launch_node(
    target: str | Callable[..., Any],
    cluster: dict[str, Any] | str,
    *,
    node: str | None = None,
    tasks: Sequence[tuple[str, int]] | None = None,
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    out: IO[str] | None = None,
) -> int:
    """Per-node mode for real clusters: starts only this node's tasks, each with its TF_CONFIG.

    Run it on every node of the cluster (same ``cluster`` everywhere). Output prefixing,
    failure handling and exit codes are those of `launch`.
    """
    return _run_tasks(_command(target, args), node_environments(cluster, node, tasks), env, timeout, out)


def _run_tasks(
    command: list[str],
    environments: dict[str, dict[str, str]],
    env: dict[str, str] | None,
    timeout: float | None,
    out: IO[str] | None,
) -> int:
    out = out or sys.stdout
    tasks: list[_Task] = []
    pumps = []
    for name, task_env in environments.items():
        full_env = {**os.environ, **(env or {}), **task_env, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(command, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        tasks.append(_Task(name, process, name.startswith("ps-")))
        assert process.stdout is not None
        pump = threading.Thread(target=_pump, args=(name, process.stdout, out), daemon=True)
        pump.start()
        pumps.append(pump)
    try:
        code = _supervise(tasks, timeout, out)
    finally:
        _stop(tasks)
        for pump in pumps:
            pump.join(timeout=5)
    return code


def _supervise(tasks: list[_Task], timeout: float | None, out: IO[str]) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    trainers = [t for t in tasks if not t.is_ps]
    while True:
        for task in tasks:
            code = task.process.poll()
            if code not in (None, 0) or (task.is_ps and code is not None):
                out.write(
                    f"[phalanx launch] {task.name} exited with code {code}; stopping the other tasks.\n"
                )
                return code or 1
        if all(t.process.poll() == 0 for t in trainers):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            running = [t.name for t in tasks if t.process.poll() is None]
            out.write(f"[phalanx launch] timed out after {timeout}s; still running: {running}.\n")
            return 124
        time.sleep(0.05)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``phalanx launch``."""
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default 2)")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="torchrun's name for the number of worker processes on this machine",
    )
    parser.add_argument("--ps", type=int, default=0, help="parameter-server processes")
    parser.add_argument("--chief", action="store_true", help="add a separate chief task")
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument(
        "--tf-config",
        default=None,
        help="per-node mode: the whole cluster (TF_CONFIG or cluster JSON); starts this node's tasks",
    )
    parser.add_argument("--node", default=None, help="per-node mode: this node's host name as in the cluster")
    parser.add_argument("script", help="the training script (or module:function)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def run_launch(ns: argparse.Namespace) -> int:
    """Runs ``phalanx launch`` from parsed arguments.

    Raises:
        ValueError: --workers and --nproc-per-node disagree.
    """
    if ns.workers is not None and ns.nproc_per_node is not None and ns.workers != ns.nproc_per_node:
        raise ValueError(
            f"--workers ({ns.workers}) and --nproc-per-node ({ns.nproc_per_node}) both give the number of "
            "worker processes on this machine and disagree. HINT: pass one of them."
        )
    if ns.tf_config is not None:
        return launch_node(ns.script, ns.tf_config, node=ns.node, args=ns.script_args, timeout=ns.timeout)
    workers = ns.workers if ns.workers is not None else (ns.nproc_per_node or 2)
    return launch(
        ns.script, workers=workers, ps=ns.ps, chief=ns.chief, args=ns.script_args, timeout=ns.timeout
    )
