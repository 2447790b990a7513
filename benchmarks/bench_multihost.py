"""MultiWorkerMirroredStrategy against DDP, and ParameterServer training, across simulated
hosts on shaped links.

Run (as root; uses tests/multihost/hosts.py):
    python benchmarks/bench_multihost.py [--quick] [--hosts 2|4] [--rate 1gbit|10gbit] [--ps]

For 2 and 4 hosts (network namespaces on a private bridge, one worker each, a worker's
traffic goes over its host's link, never through shared memory) with every link limited to
1 Gbit/s and to 10 Gbit/s (``tc ... tbf``, both directions), trains MLP 784-1024-1024-10 at
global batch 256 (256 / workers per worker, SGD, 1 intra-op thread per worker): a phalanx
custom loop (experimental_distribute_dataset, strategy.run, compute_average_loss, gradient
buckets over gloo) against DistributedDataParallel (gloo) on the same per-worker batches, in
alternating rounds in the same processes; the best round of each counts. Prints examples per
second and ratio = phalanx / DDP. Nothing is asserted. Prints why and exits 0 where hosts
cannot be simulated (not root, no iproute2).

With ``--ps``, instead: ParameterServerStrategy with a chief, 2 workers and 2 ps tasks on 5
hosts, the same MLP (its variables split over both ps tasks) at batch 128 per step, steps
scheduled through a ClusterCoordinator; for links of 1 and 10 Gbit/s against the same on
unshaped links (each on fresh hosts). Prints examples per second and ratio = shaped /
unshaped: what the link costs a ps cluster, whose every step pulls the variables and pushes
the gradients.

All hosts share this machine's cores: with fewer cores than workers the figures are bound by
compute, and the ratio is what carries over to real machines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

GLOBAL_BATCH = 256
PORT = 23456
CASES = [(2, "1gbit"), (2, "10gbit"), (4, "1gbit"), (4, "10gbit")]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _round(epoch, steps: int) -> float:
    """Examples per second of one pass over the data, started together on every worker."""
    dist.barrier()
    start = time.perf_counter()
    epoch()
    dist.barrier()
    return GLOBAL_BATCH * steps / (time.perf_counter() - start)


def worker(quick: bool) -> None:
    """One worker: phalanx and DDP in alternating rounds; rank 0 prints a JSON line."""
    import phalanx

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Auto-sharding found no files")  # DATA is intended
    strategy = phalanx.MultiWorkerMirroredStrategy()
    rank, world = strategy.cluster_resolver.worker_index, strategy.num_replicas_in_sync
    steps = 4 if quick else 12
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]
    share = GLOBAL_BATCH // world
    mine = [(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for x, y in data]

    # DDP on plain gloo: the job's default group is phalanx's own (communication/group/process_group.py)
    reference = dist.new_group(backend="gloo")
    ddp_model = nn.parallel.DistributedDataParallel(_mlp(), process_group=reference)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    def ddp_epoch() -> None:
        for x, y in mine:
            nn.functional.cross_entropy(ddp_model(x), y).backward()  # DDP averages gradients
            ddp_opt.step()
            ddp_opt.zero_grad()

    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = strategy.experimental_distribute_dataset(
        data, phalanx.InputOptions(experimental_fetch_to_device=False)
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()  # summed
        optimizer.step()
        optimizer.zero_grad()

    def phalanx_epoch() -> None:
        for x, y in dataset:
            strategy.run(step, args=(x, y))

    phalanx_epoch(), ddp_epoch()  # warm up
    ours, ddp = [], []
    for _ in range(2 if quick else 4):
        ours.append(_round(phalanx_epoch, steps))
        ddp.append(_round(ddp_epoch, steps))
    if rank == 0:
        shared = strategy._group.uses_shared_memory
        print(json.dumps({"phalanx": max(ours), "ddp": max(ddp), "shared_memory": shared}), flush=True)
    strategy.close()


PS_BATCH = 128
PS_TASKS = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("ps", 1)]  # host i runs task i


def ps_task(quick: bool) -> None:
    """One task of the ps cluster: worker and ps tasks serve; the chief trains and prints a
    JSON line with its best examples per second."""
    import phalanx

    torch.set_num_threads(1)
    resolver = phalanx.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        phalanx.Server(resolver.cluster_spec(), resolver.task_type, resolver.task_id).join()
        return
    strategy = phalanx.ParameterServerStrategy(resolver)
    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def dataset_fn(ctx: object) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(PS_BATCH, 784, generator=g), torch.randint(0, 10, (PS_BATCH,), generator=g))]
        while True:
            yield from batches

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step(iterator: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        x, y = next(iterator)

        def replica_fn(x: torch.Tensor, y: torch.Tensor) -> None:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()  # the gradients go to the ps tasks, the new values come back

        strategy.run(replica_fn, args=(x, y))

    steps = 8 if quick else 24
    rates = []
    for round_ in range(3 if quick else 5):  # the first round warms up
        start = time.perf_counter()
        for _ in range(steps):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()
        if round_:
            rates.append(PS_BATCH * steps / (time.perf_counter() - start))
    print(json.dumps({"ps": max(rates)}), flush=True)
    coordinator.shutdown()
    strategy.close()


def _ps_rate(rate: str | None, quick: bool) -> float | str:
    """The ps cluster's examples per second with every link at ``rate`` (None: unshaped), or
    why it failed."""
    from multihost.cluster import start_cluster, wait_all
    from multihost.hosts import SimulatedHosts

    with SimulatedHosts(len(PS_TASKS)) as hosts:
        if rate is not None:
            for host in hosts:
                host.shape(rate)
        args = ["--ps-task"] + (["--quick"] if quick else [])
        tasks = start_cluster(
            hosts, PS_TASKS, os.path.abspath(__file__), args, PHALANX_CLUSTER_TOKEN=os.urandom(16).hex()
        )
        codes, output = wait_all([tasks["chief:0"]], timeout=600)
    if codes != [0]:
        return f"failed ({codes})\n{output}"
    return float(
        json.loads(next(line for line in output.splitlines() if '"ps"' in line).split("] ", 1)[1])["ps"]
    )


def _run_ps(rates: list[str], quick: bool) -> None:
    base = _ps_rate(None, quick)
    if isinstance(base, str):
        print(f"ParameterServer unshaped: {base}", flush=True)
        return
    label = "ParameterServer MLP 784-1024-1024-10 batch 128, chief + 2 workers + 2 ps on 5 hosts"
    print(f"{label}, links unshaped   {base:7.0f} ex/s", flush=True)
    for rate in rates:
        shaped = _ps_rate(rate, quick)
        if isinstance(shaped, str):
            print(f"ParameterServer at {rate}: {shaped}", flush=True)
            continue
        print(
            f"{label}, links {rate:>6}   {shaped:7.0f} ex/s   ratio {shaped / base:5.2f}   (shaped/unshaped)",
            flush=True,
        )


def _run_case(workers: int, rate: str, quick: bool) -> str:
    from multihost.cluster import base_env, tf_config, wait_all, worker_cluster
    from multihost.hosts import SimulatedHosts

    with SimulatedHosts(workers) as hosts:
        for host in hosts:
            host.shape(rate)
        cluster = worker_cluster(hosts)
        argv = [sys.executable, os.path.abspath(__file__), "--worker"] + (["--quick"] if quick else [])
        processes = [
            host.run(argv, base_env(TF_CONFIG=tf_config(cluster, "worker", i)), name=f"worker-{i}")
            for i, host in enumerate(hosts)
        ]
        codes, output = wait_all(processes, timeout=600)
    if codes != [0] * workers:
        return f"{workers} hosts at {rate}: failed ({codes})\n{output}"
    result = json.loads(next(line for line in output.splitlines() if '"phalanx"' in line).split("] ", 1)[1])
    assert not result["shared_memory"]  # every worker on a host of its own
    return (
        f"MLP 784-1024-1024-10 batch 256, {workers} hosts x 1 worker, links {rate:>6}   "
        f"phalanx {result['phalanx']:7.0f} ex/s   DDP {result['ddp']:7.0f} ex/s   "
        f"ratio {result['phalanx'] / result['ddp']:5.2f}   (phalanx/DDP)"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--hosts", type=int, choices=(2, 4), help="only this many hosts")
    parser.add_argument("--rate", choices=("1gbit", "10gbit"), help="only this link rate")
    parser.add_argument("--ps", action="store_true", help="ParameterServer: shaped against unshaped links")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ps-task", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.quick)
        return 0
    if args.ps_task:
        ps_task(args.quick)
        return 0
    from multihost.hosts import missing_tools

    reason = missing_tools()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    print(f"{os.cpu_count()} CPU cores shared by every simulated host", flush=True)
    if args.ps:
        _run_ps([r for r in ("1gbit", "10gbit") if args.rate in (None, r)], args.quick)
        return 0
    for workers, rate in CASES:
        if args.hosts not in (None, workers) or args.rate not in (None, rate):
            continue
        print(_run_case(workers, rate, args.quick), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
