"""Real processes for tests: a local cluster on 127.0.0.1, or one Python child (docs/testing.md).

Every child gets the same environment: ``PYTHONPATH`` with ``tests/`` (for ``support``) and
``src/``, no inherited cluster variables (``TF_CONFIG``, torchrun's ``RANK``...), a cluster
token, short join/heartbeat timeouts, unbuffered output and ``faulthandler``. Each task of a
cluster gets its own ``TF_CONFIG``; each line it prints is echoed as ``[worker-1] ...`` (pytest
shows it when the test fails) and kept. A hard timeout kills every process and fails the test
naming the tasks still running; nothing outlives its `LocalCluster`.

Example::

    run = run_cluster(SCRIPTS / "sync_bn.py", tmp_path, workers=2)
    run.check()  # every task exited 0, else an AssertionError with each task's output
    assert "[worker-1] done" in run.output

This is test infrastructure, independent of ``phalanx launch`` (which tests/multiprocess/
test_launcher.py tests): a test of a fault needs the survivors left running, which a launcher
would stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from phalanx.cluster._ports import free_ports

__all__ = [
    "ClusterRun",
    "ClusterTimeout",
    "LocalCluster",
    "TaskResult",
    "child_env",
    "free_ports",
    "run_cluster",
    "run_python",
]

TESTS = Path(__file__).resolve().parents[1]
SRC = TESTS.parent / "src"
# Cluster configuration a child must never inherit from the test process.
CLUSTER_VARS = frozenset(
    {"TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    | {"GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"}
    | {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
)
JOIN_TIMEOUT = 60.0  # the product default is 120 s; a test's tasks start within seconds
HEARTBEAT_TIMEOUT = 10.0  # the product default: the fault tests' detection bound is built on it


class ClusterTimeout(AssertionError):
    """A local cluster ran past its hard timeout; every process was killed."""


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a test's child process: this one's, cleaned, plus ``env``.

    Args:
        env: Variables to set on top (they win over the defaults, e.g. a shorter timeout).
    """
    paths = [str(TESTS), str(SRC), os.environ.get("PYTHONPATH", "")]
    return {
        **{k: v for k, v in os.environ.items() if k not in CLUSTER_VARS},
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "PYTHONUNBUFFERED": "1",  # lines arrive as printed, so a hang shows how far each task got
        "PYTHONFAULTHANDLER": "1",  # a native abort shows where each thread was
        "PHALANX_CLUSTER_TOKEN": secrets.token_hex(16),
        "PHALANX_JOIN_TIMEOUT_SECONDS": str(JOIN_TIMEOUT),
        "PHALANX_HEARTBEAT_TIMEOUT_SECONDS": str(HEARTBEAT_TIMEOUT),
        **(env or {}),
    }


def run_python(
    *args: Any, timeout: float, env: Mapping[str, str] | None = None, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` with `child_env`, its stdout and stderr captured apart.

    Raises:
        ClusterTimeout: It ran past ``timeout`` seconds (it and its children were killed).
    """
    argv = [sys.executable, *map(str, args)]
    proc = subprocess.Popen(
        argv,
        env=child_env(env),
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: killed with everything it started
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        message = f"{argv} timed out after {timeout}s; it was killed.\n{out[-3000:]}{err[-3000:]}"
        raise ClusterTimeout(message) from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@dataclass(frozen=True)
class TaskResult:
    """How one task ended: its name (``worker-1``), exit code and output (without prefixes)."""

    name: str
    returncode: int
    output: str


@dataclass(frozen=True)
class ClusterRun:
    """How every task of a cluster ended.

    ``output`` holds every task's lines, prefixed with its name, in the order they arrived.
    Tasks that serve (ps, and the workers of a parameter-server cluster) are killed once the
    tasks ``waited`` for have finished; their code is then ``-SIGKILL``.
    """

    tasks: dict[str, TaskResult]
    output: str
    waited: tuple[str, ...]

    def __getitem__(self, name: str) -> TaskResult:
        return self.tasks[name]

    @property
    def returncodes(self) -> dict[str, int]:
        return {name: task.returncode for name, task in self.tasks.items()}

    def check(self, *names: str) -> ClusterRun:
        """Fail, showing the output, unless the named tasks (default: those waited for) exited 0."""
        names = names or self.waited
        failed = {n: self.tasks[n].returncode for n in names if self.tasks[n].returncode != 0}
        assert not failed, f"tasks failed: {failed}\n{self.output}"
        return self


class _Task:
    """One started process and the thread that copies its output."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], sink: _Output) -> None:
        self.name = name
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        assert self.proc.stdout is not None
        self.pump = threading.Thread(target=sink.copy, args=(self, self.proc.stdout), name=f"output-{name}")
        self.pump.daemon = True
        self.pump.start()

    def result(self) -> TaskResult:
        self.pump.join(timeout=10)  # the pipe closes when the process group is gone
        return TaskResult(self.name, self.proc.wait(), "".join(self.lines))


class _Output:
    """Every task's lines, prefixed, echoed to this process's stdout as they arrive."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def copy(self, task: _Task, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace")
            line = line if line.endswith("\n") else line + "\n"
            with self._lock:
                task.lines.append(line)
                self.lines.append(f"[{task.name}] {line}")
                sys.stdout.write(f"[{task.name}] {line}")

    def text(self) -> str:
        with self._lock:
            return "".join(self.lines)


class LocalCluster:
    """A cluster of real processes on 127.0.0.1: ``workers`` workers, an optional chief, ``ps`` ps.

    Ports are free ones, picked when it is made. Use it as a context manager: leaving it kills
    every task still running. Tasks are named ``chief-0``, ``worker-0``, ``worker-1``, ``ps-0``.

    Args:
        workers: Worker tasks.
        chief: Whether there is a chief task.
        ps: Parameter-server tasks. A cluster with a chief and ps tasks is a parameter-server
            cluster: its chief alone runs to the end, the others serve it.
        env: Variables for every task, on top of `child_env`'s.
    """

    def __init__(
        self, workers: int = 2, *, chief: bool = False, ps: int = 0, env: Mapping[str, str] | None = None
    ) -> None:
        counts = {"chief": int(chief), "worker": workers, "ps": ps}
        ports = iter(free_ports(sum(counts.values())))
        self.spec = {job: [f"127.0.0.1:{next(ports)}" for _ in range(n)] for job, n in counts.items() if n}
        self.names = [f"{job}-{i}" for job, addresses in self.spec.items() for i in range(len(addresses))]
        self.env = child_env(env)  # one token for the whole cluster
        self._tasks: dict[str, _Task] = {}
        self._output = _Output()

    @property
    def trainers(self) -> list[str]:
        """The tasks that run to the end: the chief of a parameter-server cluster, else chief + workers."""
        if "chief" in self.spec and "ps" in self.spec:
            return ["chief-0"]
        return [n for n in self.names if n.split("-")[0] in ("chief", "worker")]

    def address(self, name: str) -> str:
        """``host:port`` of the task ``name`` (``worker-1``)."""
        job, index = name.rsplit("-", 1)
        return self.spec[job][int(index)]

    def start(self, script: str | Path, *args: Any) -> LocalCluster:
        """Start ``python SCRIPT ARGS`` as every task, each with its own ``TF_CONFIG``."""
        for name in self.names:
            job, index = name.rsplit("-", 1)
            config = {"cluster": self.spec, "task": {"type": job, "index": int(index)}}
            env = {**self.env, "TF_CONFIG": json.dumps(config)}
            argv = [sys.executable, str(script), *map(str, args)]
            self._tasks[name] = _Task(name, argv, env, self._output)
        return self

    def start_task(self, name: str, argv: Sequence[Any], env: Mapping[str, str]) -> LocalCluster:
        """Start one task as a cluster manager would (Kubeflow's operators, torchrun): ``argv``
        with exactly the variables ``env`` on top of the cluster's (no ``TF_CONFIG`` of its own).
        Wait for such tasks by name: ``wait(timeout, names=[...])``."""
        self._tasks[name] = _Task(name, [str(a) for a in argv], {**self.env, **env}, self._output)
        return self

    def pid(self, name: str) -> int:
        return self._tasks[name].proc.pid

    def wait(self, timeout: float, names: Sequence[str] | None = None) -> ClusterRun:
        """Wait until the tasks ``names`` (default: `trainers`) exit, kill the rest, report all.

        Raises:
            ClusterTimeout: One of them was still running after ``timeout`` seconds; every task
                was killed and the message names those still running, with everyone's output.
        """
        deadline = time.monotonic() + timeout
        waited = tuple(names or self.trainers)
        for name in waited:
            try:
                self._tasks[name].proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = [n for n in waited if self._tasks[n].proc.poll() is None]
                self.stop()
                for task in self._tasks.values():
                    task.result()  # every line up to the kill
                raise ClusterTimeout(
                    f"local cluster timed out after {timeout}s; still running: {hung} (every task "
                    f"was killed). Output:\n{self._output.text()}"
                ) from None
        self.stop()
        return ClusterRun({n: t.result() for n, t in self._tasks.items()}, self._output.text(), waited)

    def stop(self) -> None:
        """Kill every task still running, and anything a task started, then reap them."""
        for task in self._tasks.values():
            _kill_group(task.proc)  # also when the task has exited: a grandchild may live on
        for task in self._tasks.values():
            task.proc.wait()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_cluster(
    script: str | Path,
    *args: Any,
    workers: int = 2,
    chief: bool = False,
    ps: int = 0,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> ClusterRun:
    """Run ``python SCRIPT ARGS`` as every task of a new `LocalCluster`; report how each ended.

    Raises:
        ClusterTimeout: A task waited for was still running after ``timeout`` seconds.
    """
    with LocalCluster(workers, chief=chief, ps=ps, env=env) as cluster:
        return cluster.start(script, *args).wait(timeout)


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        os.killpg(proc.pid, signal.SIGKILL)  # the process and everything it started
