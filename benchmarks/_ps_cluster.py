"""Local parameter-server clusters for the PS benchmarks: one process per task on 127.0.0.1.

The standard library only, so the TensorFlow reference (`_ps_tf_reference.py`, run from its
own environment without phalanx or torch) and phalanx's side (`bench_ps_tf.py`) launch, time
and measure their clusters the same way:

* every ps and worker task is a process of its own, started with ``--serve JOB INDEX``;
* the chief (the calling process) schedules ``warmup`` steps and joins, then times rounds of
  ``steps`` scheduled steps (schedule all, then join); the best round counts;
* the CPU time of every process (user + system, all threads, from /proc) over that round,
  divided by its steps, says where the time goes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from _timing import best_time  # benchmarks/ is on sys.path for every script that imports this

WORKLOADS = {
    "mlp": "MLP 784-1024-1024-10, batch 256, SGD",
    "emb": "embedding 100k x 32 + dense, batch 256 x 8 ids, Adagrad",
    "emb_split": "same, table split in 2 (FixedShardsPartitioner(2))",
}
# (workload, workers, ps): the cases the side-by-side table shows, in order
CASES = [("mlp", 2, 1), ("emb", 2, 1), ("emb_split", 2, 1), ("emb_split", 2, 2), ("mlp", 4, 2)]
IDS_POOL = 64  # batches of ids cycled by each worker's dataset (the same on both sides)
# tasks on simulated hosts (`bench_ps_scaling.py --links`): JSON {"chief:0": [netns, ip], "worker:0":
# [netns, ip], ..., "ps:0": [...]}; each task runs in its network namespace, at ip:HOST_PORT
HOSTS_ENV = "PS_BENCH_HOSTS"
HOST_PORT = 7070


def hosts() -> dict[str, list[str]] | None:
    """The simulated hosts of ``PS_BENCH_HOSTS`` (None: every task on 127.0.0.1)."""
    value = os.environ.get(HOSTS_ENV, "")
    return dict(json.loads(value)) if value else None


def in_host(task: str) -> list[str]:
    """The command prefix that runs ``task`` ("worker:0") on its simulated host ([] if none)."""
    placed = hosts()
    return ["ip", "netns", "exec", placed[task][0]] if placed else []


def free_ports(n: int) -> list[int]:
    """``n`` ports free right now on 127.0.0.1."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def cluster_spec(workers: int, ps: int) -> dict[str, list[str]]:
    """A chief, ``workers`` workers and ``ps`` ps tasks on free local ports (or on their
    simulated hosts, `HOSTS_ENV`)."""
    placed = hosts()
    if placed:
        return {
            job: [f"{placed[f'{job}:{i}'][1]}:{HOST_PORT}" for i in range(n)]
            for job, n in (("chief", 1), ("worker", workers), ("ps", ps))
        }
    ports = iter(free_ports(1 + workers + ps))
    return {
        "chief": [f"127.0.0.1:{next(ports)}"],
        "worker": [f"127.0.0.1:{next(ports)}" for _ in range(workers)],
        "ps": [f"127.0.0.1:{next(ports)}" for _ in range(ps)],
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (every thread)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Tasks:
    """The ps and worker processes of a local cluster (the chief is the caller)."""

    spec: dict[str, list[str]]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        """``{"chief": this pid, "worker:0": pid, ..., "ps:0": pid}``."""
        return {"chief": os.getpid(), **{name: p.pid for name, p in self.processes.items()}}

    def wait_until_listening(self, timeout: float = 120.0) -> None:
        """Blocks until every task accepts TCP connections.

        Raises:
            RuntimeError: A task exited, or did not listen within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        for job in ("ps", "worker"):
            for index, address in enumerate(self.spec[job]):
                host, _, port = address.rpartition(":")
                while True:
                    process = self.processes[f"{job}:{index}"]
                    if process.poll() is not None:
                        raise RuntimeError(f"{job}:{index} exited with {process.returncode} before listening")
                    try:
                        socket.create_connection((host, int(port)), timeout=1).close()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise RuntimeError(
                                f"{job}:{index} did not listen at {address} in {timeout}s"
                            ) from None
                        time.sleep(0.1)

    def stop(self) -> None:
        """Ends the processes this cluster started."""
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
        for process in self.processes.values():
            process.wait(30)


def start_tasks(script: str, spec: dict[str, list[str]], args: list[str], env: dict[str, str]) -> Tasks:
    """Starts ``python script --serve JOB INDEX --cluster SPEC *args`` for every ps and worker."""
    tasks = Tasks(spec)
    for job in ("ps", "worker"):
        for index in range(len(spec[job])):
            cmd = [sys.executable, script, "--serve", job, str(index), "--cluster", json.dumps(spec), *args]
            cmd = in_host(f"{job}:{index}") + cmd
            tasks.processes[f"{job}:{index}"] = subprocess.Popen(cmd, env={**os.environ, **env})
    return tasks


def measure(
    run_steps: Callable[[int], None], pids: dict[str, int], steps: int, warmup: int, rounds: int
) -> dict[str, object]:
    """Times ``run_steps(steps)`` (schedule that many steps, then join) after a warm-up.

    Returns:
        ``{"steps_per_s": best round, "cpu_ms_per_step": {task: ms}}`` (CPU of the best round).
    """
    run_steps(warmup)
    best: tuple[float, dict[str, float]] | None = None
    for _ in range(rounds):
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        start = time.perf_counter()
        run_steps(steps)
        seconds = time.perf_counter() - start
        cpu = {name: (cpu_seconds(pid) - before[name]) * 1e3 / steps for name, pid in pids.items()}
        if best is None or seconds < best[0]:
            best = (seconds, cpu)
    assert best is not None
    return {"steps_per_s": steps / best[0], "cpu_ms_per_step": best[1]}


def time_kernel(step: Callable[[], None], seconds: float = 0.6, chunks: int = 5) -> float:
    """ms per call of ``step`` on this thread: the best of ``chunks`` timed chunks of about
    ``seconds / chunks`` each, after three warm-up calls (the best chunk: the least disturbed
    by other processes on a shared box)."""
    for _ in range(3):
        step()
    start = time.perf_counter()
    step()
    calls = max(1, int(seconds / chunks / max(time.perf_counter() - start, 1e-6)))
    return best_time(step, chunks, calls) * 1e3


def parse_common(argv: list[str] | None = None):  # noqa: ANN201 - argparse.Namespace
    """The arguments both benchmark scripts take."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--serve", nargs=2, metavar=("JOB", "INDEX"), help="(internal) run a ps or worker task"
    )
    parser.add_argument("--cluster", help="(internal) the cluster spec as JSON")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=1)
    parser.add_argument("--steps", type=int, default=0, help="steps per timed round (0: the workload's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    parser.add_argument(
        "--kernels", default="", help="(internal) time these workloads' model steps alone, one thread"
    )
    return parser.parse_known_args(argv)[0]


def warmup_steps(steps: int, workers: int) -> int:
    """Steps before the timed rounds: enough for every worker to have run a few (its first
    functions connect, build its dataset and read every variable: not what a step costs)."""
    return max(steps // 5, 5, 4 * workers)


def default_steps(workload: str, quick: bool) -> int:
    """Steps per timed round: a few seconds of training each."""
    if quick:
        return 20
    return 150 if workload == "mlp" else 400


def host_line() -> str:
    """The machine, for a benchmark's header."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"host {socket.gethostname()}, {os.cpu_count()} CPUs ({model}), load {load:.2f}"
