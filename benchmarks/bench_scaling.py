"""Training throughput against the number of workers: MultiWorkerMirrored and DDP side by side.

Run: python benchmarks/bench_scaling.py [--quick] [--workers 1 2 4] [--plot out.png]

Each worker count is one local cluster of real processes (1 intra-op thread each). In every
cluster both sides train the MLP 784-1024-1024-10 on the same per-worker batches (global batch
256, SGD) in alternating rounds; the best round of each counts. Every count runs twice: with
the same-machine shared-memory transport and with ``PHALANX_SHARED_MEMORY=0`` (the gloo path
that workers on different machines take). DDP always uses gloo. More workers than cores
oversubscribe the machine: the figures say how the two compare, not how a cluster scales.
``--plot`` draws examples/s against workers (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings

import torch
import torch.distributed as dist
from bench_multiworker import _mlp  # the same MLP as the 2-worker benchmark
from torch import nn

GLOBAL_BATCH = 256


def _timed(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        best = min(best, time.perf_counter() - start)
    return best


def worker(quick: bool) -> None:
    """One task of the cluster: both sides' epochs, alternating; rank 0 prints a JSON line."""
    import phalanx

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Auto-sharding found no files")
    strategy = phalanx.MultiWorkerMirroredStrategy()
    rank, workers = strategy.cluster_resolver.worker_index, strategy.num_replicas_in_sync
    steps, rounds = (6, 3) if quick else (20, 5)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))]
    data *= steps
    if not dist.is_initialized():  # one worker: MultiWorkerMirrored needs no group, DDP does
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    share = GLOBAL_BATCH // workers
    mine = [(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for x, y in data]

    # DDP on plain gloo: the job's default group is phalanx's own (communication/group/process_group.py)
    reference = dist.new_group(backend="gloo")
    ddp_model = nn.parallel.DistributedDataParallel(_mlp(), process_group=reference)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    def ddp_epoch() -> None:
        for x, y in mine:
            nn.functional.cross_entropy(ddp_model(x), y).backward()
            ddp_optimizer.step()
            ddp_optimizer.zero_grad()

    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = strategy.experimental_distribute_dataset(
        data, phalanx.InputOptions(experimental_fetch_to_device=False)
    )

    def step(x, y):
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad()

    def phalanx_epoch() -> None:
        for x, y in dataset:
            strategy.run(step, args=(x, y))

    phalanx_epoch(), ddp_epoch()  # warm up
    ours, ddp = float("inf"), float("inf")
    for _ in range(rounds):
        ours = min(ours, _timed(phalanx_epoch, 1))
        ddp = min(ddp, _timed(ddp_epoch, 1))
    if rank == 0:
        rates = {
            "workers": workers,
            "phalanx": GLOBAL_BATCH * steps / ours,
            "ddp": GLOBAL_BATCH * steps / ddp,
        }
        print("RESULT " + json.dumps(rates), flush=True)
    strategy.close()


def _run(workers: int, shared_memory: bool, quick: bool) -> dict:
    env = {**os.environ, "PHALANX_SHARED_MEMORY": "1" if shared_memory else "0"}
    cmd = [sys.executable, "-m", "phalanx", "launch", "--workers", str(workers), __file__, "--", "--worker"]
    done = subprocess.run(
        cmd + (["--quick"] if quick else []), env=env, capture_output=True, text=True, timeout=900
    )
    lines = [line for line in done.stdout.splitlines() if "RESULT " in line]
    if done.returncode or not lines:
        raise RuntimeError(
            f"{workers} workers failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return json.loads(lines[0].split("RESULT ", 1)[1])


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for transport in ("shared memory", "gloo"):
        rows = [r for r in results if r["transport"] == transport]
        ax.plot(
            [r["workers"] for r in rows], [r["phalanx"] for r in rows], "o-", label=f"phalanx ({transport})"
        )
    rows = [r for r in results if r["transport"] == "gloo"]
    ax.plot([r["workers"] for r in rows], [r["ddp"] for r in rows], "s--", label="DDP (gloo)")
    ax.set_xlabel("workers (1 thread each)")
    ax.set_ylabel("examples / s")
    ax.set_xticks(sorted({r["workers"] for r in results}))
    ax.set_title(f"MLP 784-1024-1024-10, global batch 256, {os.cpu_count()} CPUs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--plot", help="write examples/s against workers to this PNG")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.quick)
        return 0
    results = []
    for workers in args.workers:
        for transport, shared in (("shared memory", True), ("gloo", False)):
            r = {**_run(workers, shared, args.quick), "transport": transport}
            results.append(r)
            print(
                f"MWMS vs DDP, {workers} workers, {transport:<13}  phalanx {r['phalanx']:7.0f} ex/s"
                f"   DDP {r['ddp']:7.0f} ex/s   speed ratio {r['phalanx'] / r['ddp']:5.2f}",
                flush=True,
            )
    if args.plot:
        _plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
