"""ParameterServerStrategy scaling, phalanx against TensorFlow 2.21, with a plot.

Run: python benchmarks/bench_ps_scaling.py [--workloads mlp,emb] [--workers 1,2,4,8] [--ps 1,2]
     [--links local,1gbit,10gbit] [--quick] [--plot ps_scaling.png] [--tf-python PATH]

Each point is one case of `bench_ps_tf.py` (same clusters, same timing, TF from its own
environment): steps/s and CPU ms per step summed over every task of the cluster. With more
tasks than cores (8 workers on a 2-core box) steps/s says how the cores were shared and CPU per
step is the comparable figure; the plot shows both, per workload and ps count. Set
``PHALANX_PS_DATA_PATH=grpc`` to see phalanx without its data path. Nothing is asserted.

``--links``: ``local`` is every task on 127.0.0.1; a rate (``1gbit``, ``10gbit``: any tc rate)
puts every task on a simulated host of its own, a network namespace joined to the others
through a bridge by a veth pair whose both directions a tc token bucket (``tbf``) limits to that
rate. That needs root (``ip netns``, ``tc``); the benchmark creates its namespaces (named
``phxbench<pid>-*``), touches nothing outside them and deletes them at the end. The hosts share
this machine's cores, so CPU per step stays the comparable figure; phalanx runs its data path
as a stream there (``PHALANX_PS_DATA_PATH=stream``: hosts share no memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_ps_tf as side_by_side  # noqa: E402


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workloads", default="mlp,emb")
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--ps", default="1,2")
    parser.add_argument("--links", default="local", help="local and/or tc rates, e.g. local,1gbit,10gbit")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tf-python", default=None)
    parser.add_argument("--plot", default=None, help="write the figure here (needs matplotlib)")
    return parser.parse_args()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _in(namespace: str, *args: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, *args], check=True, capture_output=True, text=True, timeout=30
    )


def _bytes_per_second(rate: str) -> float:
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"A link rate is a number and kbit, mbit or gbit. Received: {rate!r}. HINT: 1gbit.")


def _shape(namespace: str, device: str, rate: str) -> None:
    # a burst of 5 ms at the rate (at least two 64 KB GSO segments, which tbf must hold whole)
    burst = max(int(_bytes_per_second(rate) * 0.005), 1 << 17)
    _in(
        namespace,
        "tc",
        "qdisc",
        "add",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        str(burst),
        "latency",
        "100ms",
    )


@contextlib.contextmanager
def _simulated_hosts(tasks: list[str], rate: str) -> Iterator[dict[str, list[str]]]:
    """One network namespace per task, each with a ``rate`` link (both ways) to a bridge in a
    hub namespace; yields ``{task: [namespace, ip]}``. Deletes them all at the end."""
    prefix = f"phxbench{os.getpid()}"
    hub, made = f"{prefix}-hub", []
    try:
        _ip("netns", "add", hub)
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        placed = {}
        for i, task in enumerate(tasks):
            namespace, ip = f"{prefix}-h{i}", f"10.77.{i // 250}.{i % 250 + 1}"
            _ip("netns", "add", namespace)
            made.append(namespace)
            _ip("-n", hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", namespace)
            _ip("-n", hub, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{ip}/16", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            _shape(namespace, "eth0", rate)  # what the host sends
            _shape(hub, f"v{i}", rate)  # what it receives
            placed[task] = [namespace, ip]
        yield placed
    finally:
        for namespace in reversed(made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


@contextlib.contextmanager
def _links(link: str, max_workers: int, max_ps: int) -> Iterator[None]:
    """Runs the cases inside on 127.0.0.1 (``local``) or on simulated hosts with ``link``."""
    if link == "local":
        yield
        return
    tasks = ["chief:0"] + [f"worker:{i}" for i in range(max_workers)] + [f"ps:{i}" for i in range(max_ps)]
    saved = {key: os.environ.get(key) for key in (side_by_side.cluster.HOSTS_ENV, "PHALANX_PS_DATA_PATH")}
    with _simulated_hosts(tasks, link) as placed:
        os.environ[side_by_side.cluster.HOSTS_ENV] = json.dumps(placed)
        os.environ["PHALANX_PS_DATA_PATH"] = "stream"
        try:
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


def _cpu(result: dict[str, Any] | str | None) -> float | None:
    return sum(result["cpu_ms_per_step"].values()) if isinstance(result, dict) else None


def _rate(result: dict[str, Any] | str | None) -> float | None:
    return float(result["steps_per_s"]) if isinstance(result, dict) else None


def _plot(path: str, rows: list[tuple[str, int, int, Any, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((w, p) for w, _, p, _, _ in rows))  # in the order run
    fig, axes = plt.subplots(2, len(groups), figsize=(4 * len(groups), 7), squeeze=False)
    for column, (workload, ps) in enumerate(groups):
        mine = [(n, a, b) for w, n, p, a, b in rows if (w, p) == (workload, ps)]
        workers = [n for n, _, _ in mine]
        for row, (measure, label) in enumerate(((_rate, "steps/s"), (_cpu, "CPU ms per step"))):
            axis = axes[row][column]
            for index, side in ((1, "phalanx"), (2, "TensorFlow 2.21")):
                values = [measure(point[index]) for point in mine]
                shown = [(n, v) for n, v in zip(workers, values, strict=True) if v is not None]
                if shown:
                    axis.plot(*zip(*shown, strict=True), marker="o", label=side)
            axis.set_xscale("log", base=2)
            axis.set_xticks(workers, [str(n) for n in workers])
            axis.set_xlabel("workers")
            axis.set_ylabel(label)
            axis.set_title(f"{workload}, {ps} ps")
            axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = _parse()
    tf_python = side_by_side._tf_python(args)
    print(side_by_side._header(tf_python), flush=True)
    print(side_by_side._kernels_line(args.workloads.split(","), tf_python), flush=True)
    columns = f"{'steps/s ph':>10} {'TF':>8} {'ratio':>6} {'CPU ms ph':>10} {'CPU ms TF':>10} {'join ms':>9}"
    print(f"{'case':<40} {columns}")
    workers_list = [int(n) for n in args.workers.split(",")]
    ps_list = [int(p) for p in args.ps.split(",")]
    rows = []
    for link in args.links.split(","):
        with _links(link, max(workers_list), max(ps_list)):
            for workload in args.workloads.split(","):
                for ps in ps_list:
                    for workers in workers_list:
                        case = (workload, workers, ps)
                        ours = side_by_side._run_side(sys.executable, HERE / "bench_ps_tf.py", case, args)
                        ref = (
                            side_by_side._run_side(tf_python, side_by_side.TF_REFERENCE, case, args)
                            if tf_python
                            else None
                        )
                        rows.append((f"{workload}, {link}", workers, ps, ours, ref))
                        print(f"{link:>7} " + side_by_side._row(case, ours, ref), flush=True)
                        for side, result in (("phalanx", ours), ("TF", ref)):
                            if isinstance(result, str):
                                print(f"    {side}: {result}", flush=True)
    if args.plot:
        _plot(args.plot, rows)
        print(f"# plot: {args.plot}")


if __name__ == "__main__":
    main()
