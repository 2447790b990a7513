"""FullyShardedStrategy against MultiWorkerMirroredStrategy and raw FSDP2.

Run: python benchmarks/bench_fsdp.py [--workers 2 4] [--quick] [--save-mb 100]

1. Memory and throughput: an MLP of 16.8M parameters (4 x Linear(2048, 2048)), Adam, global
   batch 64, the same custom loop; 1 intra-op thread per worker. For each worker count, four
   jobs are launched one after another: MultiWorkerMirrored, FullyShardedStrategy (with raw
   FSDP2 beside it in the same processes), FullyShardedStrategy with the model built on the meta
   device (``meta``: initialised a layer at a time on the chief) and raw FSDP2 alone. Memory:
   each worker's peak resident memory growth (VmHWM, reset just before the model is made) over model creation
   and the timed steps; the figure is the largest worker's (printed also up to the first step:
   what building and sharding the model cost). Goals: FullyShardedStrategy's
   growth <= 0.75 x MultiWorkerMirrored's; throughput >= 0.95 x raw FSDP2's (timed in
   alternating rounds in the same processes; the best round of each counts).
2. Checkpoint saves: the time a save blocks the training loop, synchronous
   (``phalanx.train.Checkpoint.save``) against asynchronous (``save(..., blocking=False)``, which
   returns once the state is staged), on a model of ``--save-mb`` MB with Adam, 2 sharded
   workers. Goal: asynchronous <= 0.2 x synchronous.

Nothing is asserted: the figures are printed by worker 0 of each job.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

WIDTH, LAYERS, GLOBAL_BATCH = 2048, 4, 64
# glibc's malloc raises its mmap threshold after the first large free, then keeps freed
# blocks of tens of MB in its heap: the peak RSS would count the allocator's fragmentation
# (FSDP2 allocates a gathered layer per step) rather than live memory. A fixed threshold
# returns large blocks to the system when they are freed: the same for every job.
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)])


def _reset_peak() -> int:
    """Resets this process's peak resident memory (VmHWM); returns the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} is not in /proc/self/status")


def _data(steps: int, rank: int, workers: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randint(0, WIDTH, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]
    per = GLOBAL_BATCH // workers
    return data, [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in data]


def _phalanx_loop(strategy, data: list, meta: bool = False) -> Callable[[], None]:
    import phalanx

    with strategy.scope(), torch.device("meta" if meta else "cpu"):
        model = _mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    options = phalanx.InputOptions(experimental_fetch_to_device=False)
    dataset = strategy.experimental_distribute_dataset(data, options)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def epoch() -> None:
        for x, y in dataset:
            strategy.run(step, args=(x, y))

    return epoch


def _raw_fsdp_loop(mine: list) -> Callable[[], None]:
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for block in model:
        fully_shard(block[0])
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)

    def epoch() -> None:
        for x, y in mine:
            nn.functional.cross_entropy(model(x), y).backward()  # FSDP2 averages
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return epoch


def _timed(fn: Callable[[], None]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _memory_job(mode: str, quick: bool) -> None:
    """One job: ``mode`` (mwms, fsdp, meta or raw) trained; worker 0 prints the largest peak growth."""
    import phalanx
    from phalanx.experimental import FullyShardedStrategy

    torch.set_num_threads(1)
    strategy: phalanx.Strategy | None = None
    if mode == "mwms":
        strategy = phalanx.MultiWorkerMirroredStrategy()
    elif mode in ("fsdp", "meta"):
        strategy = FullyShardedStrategy()
    else:
        resolver = phalanx.cluster.resolve_cluster()
        host, _, port = resolver.chief_address().rpartition(":")
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=resolver.worker_index,
            world_size=resolver.num_workers,
        )
    rank, workers = dist.get_rank(), dist.get_world_size()
    steps = 3 if quick else 8
    data, mine = _data(steps, rank, workers)
    base = _reset_peak()
    epoch = _phalanx_loop(strategy, data, mode == "meta") if strategy is not None else _raw_fsdp_loop(mine)
    if strategy is not None:  # the model made and sharded (the first run shards it), no step yet
        strategy.run(lambda: None)
        made = torch.tensor([float(_status("VmHWM") - base)])
        dist.all_reduce(made, op=dist.ReduceOp.MAX)
        if rank == 0:
            growth_mib = made.item() / 2**20
            print(f"{workers} workers  {mode:<5} peak memory growth to the first step {growth_mib:6.1f} MiB")
    seconds = min(_timed(epoch) for _ in range(2 if quick else 3))
    growth = torch.tensor([float(_status("VmHWM") - base)])
    dist.all_reduce(growth, op=dist.ReduceOp.MAX)
    rate = GLOBAL_BATCH * steps / seconds
    if rank == 0:
        print(
            f"{workers} workers  {mode:<5} peak memory growth {growth.item() / 2**20:8.1f} MiB"
            f"  {rate:7.0f} ex/s",
            flush=True,
        )
    if mode == "fsdp":  # raw FSDP2 beside it in the same processes, alternating rounds
        raw = _raw_fsdp_loop(mine)
        ours_s, raw_s = [], []
        for _ in range(2 if quick else 4):
            ours_s.append(_timed(epoch))
            raw_s.append(_timed(raw))
        if rank == 0:
            ratio = min(raw_s) / min(ours_s)
            print(
                f"{workers} workers  throughput FullySharded / raw FSDP2 (same processes) {ratio:5.3f}"
                "  (goal >= 0.95)",
                flush=True,
            )
    if strategy is not None:
        strategy.close()
    else:
        dist.destroy_process_group()


def _save_job(megabytes: int, quick: bool) -> None:
    """Blocking time of a synchronous and an asynchronous sharded save (2 workers)."""
    import phalanx
    from phalanx.experimental import FullyShardedStrategy

    torch.set_num_threads(1)
    strategy = FullyShardedStrategy()
    width = int((megabytes * 2**20 / 4 / 3 / 4) ** 0.5)  # 4 layers; Adam: parameters x 3
    with strategy.scope():
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(4)])
        optimizer = torch.optim.Adam(model.parameters())

    def step() -> None:
        model(torch.ones(2, width)).sum().backward()
        optimizer.step()

    strategy.run(step)
    checkpoint = phalanx.train.Checkpoint(model=model, optimizer=optimizer)
    shared = [tempfile.mkdtemp(prefix="bench_fsdp_") if strategy.is_chief else None]
    dist.broadcast_object_list(shared, src=0)
    directory = str(shared[0])
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 if quick else 4):
        for blocking in (True, False):
            dist.barrier()
            start = time.perf_counter()
            future = checkpoint.save(os.path.join(directory, f"ckpt-{i}-{blocking}"), blocking=blocking)
            times[blocking].append(time.perf_counter() - start)
            if not blocking:
                future.result()
    if strategy.is_chief:
        sync, asyn = min(times[True]), min(times[False])
        print(
            f"save {megabytes} MB state (2 sharded workers): synchronous blocks {sync * 1e3:8.1f} ms, "
            f"asynchronous {asyn * 1e3:8.1f} ms  ratio {asyn / sync:5.3f}  (goal <= 0.2)",
            flush=True,
        )
    strategy.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 4], help="none: save only")
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument(
        "--save-mb", type=int, default=100, help="model + Adam state size for the save case (0: skip)"
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job == "save":
        _save_job(args.save_mb, args.quick)
        return 0
    if args.job:
        _memory_job(args.job, args.quick)
        return 0
    from phalanx.cluster import launch

    quick = ["--quick"] if args.quick else []
    status = 0
    for workers in args.workers:
        for job in ("mwms", "fsdp", "meta", "raw"):
            job_args = ["--job", job, *quick]
            status |= launch(
                os.path.abspath(__file__), workers=workers, args=job_args, env=MALLOC, timeout=1200
            )
    if args.save_mb:
        save = ["--job", "save", "--save-mb", str(args.save_mb), *quick]
        status |= launch(os.path.abspath(__file__), workers=2, args=save, timeout=1200)
    return status


if __name__ == "__main__":
    sys.exit(main())
