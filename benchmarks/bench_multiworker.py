"""MultiWorkerMirroredStrategy over 2 processes against raw torch.distributed (gloo) and DDP.

Run: python benchmarks/bench_multiworker.py [--quick]

1. All-reduce: phalanx's cross-worker path (``strategy.cross_worker_all_reduce``, the one
   reduce/all_reduce/gradient sync use: staging, deadline and health check included) against
   raw ``torch.distributed.all_reduce`` on the same gloo group, at 4 KB, 256 KB, 4 MB, 64 MB.
   ratio = raw time / phalanx time (goal >= 0.95 from 4 MB).
2. Training throughput: MLP 784-1024-1024-10, global batch 256 (128 per worker), SGD, 2
   workers x 1 intra-op thread: a phalanx custom loop (experimental_distribute_dataset,
   strategy.run, compute_average_loss, gradient buckets) against DistributedDataParallel
   (gloo) on the same per-worker batches. ratio = phalanx / DDP examples per second (goal >= 1.0).
   A round is several epochs of 25 steps (100 steps, 40 with ``--quick``): long enough that what
   builds up over seconds of training shows (2 s of gloo works held cost 25 % of a
   sustained step and none of a 25-step round). Printed: the best round of each side and, in
   brackets, the ratio of the median rounds.
3. The gradient engines alone, in a plain torch loop of that MLP (no ``run``, no iterator):
   phalanx's gradient buckets (`phalanx.communication.engine.bucketing`, over the strategy's own
   transport) against DDP's C++ reducer as DDP builds it, and as DDP with
   ``gradient_as_bucket_view`` and a summing communication hook (phalanx's convention).
   Printed as CPU ms per step of worker 0 above the same loop with no all-reduce at all, then
   where each engine's CPU goes: the training thread and the others (gloo's, the
   shared-memory transport's), from ``/proc/self/task/*/schedstat``.
4. The collective check's cost (`phalanx.communication.checks.collective_check`): the loop of 2 with
   the codes on and off in alternating rounds of the same run (skipped when the run has them
   off). ratio = examples per second on / off (goal: within noise).

Both sides of each case are timed in alternating rounds in the same processes; the best
round of each counts. Nothing is asserted: the ratios are printed. Both workers run on this
machine, so phalanx's all-reduces take the shared-memory transport
(`phalanx.communication.transports.shm.shared_memory`); run with PHALANX_SHARED_MEMORY=0 to measure its gloo
path, and add PHALANX_COLLECTIVES=tls with a PHALANX_CLUSTER_TOKEN for the mutual-TLS ring that
workers on different machines use when the job has a token (`phalanx.communication.transports.tls.ring`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

SIZES = {"4KB": 1 << 10, "256KB": 1 << 16, "4MB": 1 << 20, "64MB": 1 << 24}  # float32 elements
GLOBAL_BATCH = 256
EPOCHS, EPOCHS_QUICK = 4, 2  # of 25 steps (8 with --quick) a training round


def _round(fn: Callable[[], object], repeats: int) -> float:
    """Seconds per call over ``repeats`` calls, started together on both workers."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def _alternating(
    ours: Callable[[], object], ref: Callable[[], object], repeats: int, rounds: int
) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seconds per call of each side's rounds, and CPU seconds per call of this process (every
    thread: gloo's and the transport's too, steadier than wall time when other work shares the
    machine): ``(ours, ref, cpu_ours, cpu_ref)``, one entry per round."""
    ours(), ref()  # warm up
    times_ours, times_ref, cpu_ours, cpu_ref = [], [], [], []
    for _ in range(rounds):
        for fn, times, cpus in ((ours, times_ours, cpu_ours), (ref, times_ref, cpu_ref)):
            start = time.process_time()
            times.append(_round(fn, repeats))
            cpus.append((time.process_time() - start) / repeats)
    return times_ours, times_ref, cpu_ours, cpu_ref


def _best_alternating(
    ours: Callable[[], object],
    ref: Callable[[], object],
    repeats: int,
    rounds: int,
    cpu: list[float] | None = None,
) -> tuple[float, float]:
    """Best seconds per call of each side; with ``cpu``, appends each side's best CPU seconds."""
    times_ours, times_ref, cpu_ours, cpu_ref = _alternating(ours, ref, repeats, rounds)
    if cpu is not None:
        cpu.extend((min(cpu_ours), min(cpu_ref)))
    return min(times_ours), min(times_ref)


def _epochs(epoch: Callable[[], None], count: int) -> Callable[[], None]:
    """One round: ``count`` epochs back to back."""

    def run() -> None:
        for _ in range(count):
            epoch()

    return run


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _phalanx_epoch(strategy, data: list) -> Callable[[], None]:
    """One epoch of the phalanx custom loop over ``data`` (the MLP, SGD, TF's loss convention)."""
    import phalanx

    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    options = phalanx.InputOptions(experimental_fetch_to_device=False)
    dataset = strategy.experimental_distribute_dataset(data, options)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()  # summed
        optimizer.step()
        optimizer.zero_grad()

    def epoch() -> None:
        for x, y in dataset:
            strategy.run(step, args=(x, y))

    return epoch


def _batches(steps: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]


def _bench_all_reduce(strategy, reference, quick: bool) -> list[str]:
    lines = []
    for name, numel in SIZES.items():
        repeats = max(3, (10 if quick else 50) * (1 << 16) // max(numel, 1 << 16))
        ours_buf, raw_buf = torch.ones(numel), torch.ones(numel)
        ours, raw = _best_alternating(
            lambda b=ours_buf: strategy.cross_worker_all_reduce(b, "sum"),
            lambda b=raw_buf: dist.all_reduce(b, group=reference),
            repeats,
            3 if quick else 5,
        )
        lines.append(
            f"allreduce {name:<6} 2 processes   phalanx {ours * 1e3:8.3f} ms   raw gloo {raw * 1e3:8.3f} ms"
            f"   ratio {raw / ours:5.2f}   (raw/phalanx; goal >= 0.95 from 4MB)"
        )
    return lines


def _bench_training(strategy, reference, rank: int, quick: bool) -> str:
    steps = 8 if quick else 25
    data = _batches(steps, 1)
    half = GLOBAL_BATCH // 2
    mine = [(x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]) for x, y in data]

    ddp_model = nn.parallel.DistributedDataParallel(_mlp(), process_group=reference)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    def ddp_epoch() -> None:
        for x, y in mine:
            loss = nn.functional.cross_entropy(ddp_model(x), y)  # DDP averages gradients
            loss.backward()
            ddp_opt.step()
            ddp_opt.zero_grad()

    epochs = EPOCHS_QUICK if quick else EPOCHS
    phalanx_round = _epochs(_phalanx_epoch(strategy, data), epochs)
    times_ours, times_ddp, cpu_ours, cpu_ddp = _alternating(
        phalanx_round, _epochs(ddp_epoch, epochs), 1, 3 if quick else 5
    )
    steps *= epochs
    ours_rate, ddp_rate = GLOBAL_BATCH * steps / min(times_ours), GLOBAL_BATCH * steps / min(times_ddp)
    return (
        f"MLP 784-1024-1024-10 batch 256, 2 workers x 1 thread, {steps} steps a round   phalanx"
        f" {ours_rate:7.0f} ex/s   DDP {ddp_rate:7.0f} ex/s   ratio {ours_rate / ddp_rate:5.2f}"
        f" (median {_median(times_ddp) / _median(times_ours):4.2f})   (phalanx/DDP; goal >= 1.0)"
        f"   CPU ms/step of worker 0: phalanx {min(cpu_ours) / steps * 1e3:5.1f}"
        f"  DDP {min(cpu_ddp) / steps * 1e3:5.1f}"
    )


def _thread_ns() -> dict[str, int]:
    """CPU nanoseconds of each thread of this process, by thread id (Linux; empty elsewhere)."""
    found = {}
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                found[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return found


def _split(before: dict[str, int], after: dict[str, int], steps: int) -> tuple[float, float]:
    """ms per step on this process's main thread and on all its other threads."""
    main = str(os.getpid())
    spent = {tid: ns - before.get(tid, 0) for tid, ns in after.items()}
    ours = spent.get(main, 0)
    return ours / steps / 1e6, (sum(spent.values()) - ours) / steps / 1e6


def _bench_engines(strategy, reference, rank: int, quick: bool) -> str:
    """CPU per step of each gradient engine: phalanx's buckets on the job's transport, DDP's on plain gloo."""
    from phalanx.communication.engine.bucketing import GradientBuckets

    steps = 8 if quick else 20
    g = torch.Generator().manual_seed(2 + rank)
    half = GLOBAL_BATCH // 2
    batches = [(torch.randn(half, 784, generator=g), torch.randint(0, 10, (half,), generator=g))]
    batches *= steps

    def loop(model: nn.Module) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def epoch() -> None:
            for x, y in batches:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()

        return epoch

    def summing_hook(state, bucket):  # no annotations: DDP checks them against dist.GradBucket
        work = dist.all_reduce(bucket.buffer(), group=reference, async_op=True)
        assert work is not None
        return work.get_future().then(lambda fut: fut.value()[0])

    group = strategy._group
    ours = _mlp()
    buckets = GradientBuckets(
        group.all_reduce_async,
        group.wait,
        workers=2,
        announce=lambda specs: group.announce_all_reduces(specs, tail=group.announced_tail),
        announce_tail=group.announced_tail,
    )
    for p in ours.parameters():
        buckets.add(p)
    view = nn.parallel.DistributedDataParallel(_mlp(), process_group=reference, gradient_as_bucket_view=True)
    view.register_comm_hook(None, summing_hook)
    cases = {
        "none": loop(_mlp()),
        "phalanx buckets": loop(ours),
        "DDP": loop(nn.parallel.DistributedDataParallel(_mlp(), process_group=reference)),
        "DDP view+sum hook": loop(view),
    }
    cpu = {name: 1e9 for name in cases}
    threads = {name: (0.0, 0.0) for name in cases}  # of the best round: main, the others
    for fn in cases.values():
        fn()  # warm up
    for _ in range(3 if quick else 5):
        for name, fn in cases.items():
            dist.barrier()
            before, start = _thread_ns(), time.process_time()
            fn()
            spent = (time.process_time() - start) / steps * 1e3
            if spent < cpu[name]:
                cpu[name], threads[name] = spent, _split(before, _thread_ns(), steps)
            dist.barrier()
    buckets.close()
    extra = "   ".join(f"{name} +{cpu[name] - cpu['none']:4.2f}" for name in cases if name != "none")
    alone = cpu["none"]
    where = "   ".join(f"{name} {main:4.1f} + {other:4.1f}" for name, (main, other) in threads.items())
    return (
        f"gradient engines, CPU ms/step of worker 0 above a loop without all-reduce ({alone:.1f}): {extra}"
        f"\n  by thread, ms/step (training thread + the others): {where}"
    )


def _bench_check(strategy, rank: int, quick: bool) -> str:
    """The collective check's cost in one run: the training loop of `_bench_training` with the
    codes on and off in alternating rounds (both workers switch at the same point)."""
    group = strategy._group
    if not group._check.enabled:
        return "collective check: off for this run (PHALANX_COLLECTIVE_CHECK=0), no A/B"

    def switch(on: bool) -> None:  # measurement only: private switches, flipped by every worker alike
        group._check.enabled = on
        group._gloo.set_checked(on)

    epochs = EPOCHS_QUICK if quick else EPOCHS
    steps = (8 if quick else 25) * epochs
    run_round = _epochs(_phalanx_epoch(strategy, _batches(steps // epochs, 3)), epochs)

    def rounds(on: bool) -> None:
        switch(on)
        run_round()

    cpu: list[float] = []
    on, off = _best_alternating(lambda: rounds(True), lambda: rounds(False), 1, 3 if quick else 5, cpu)
    switch(True)
    return (
        f"collective check, same MLP loop   on {GLOBAL_BATCH * steps / on:7.0f} ex/s   off "
        f"{GLOBAL_BATCH * steps / off:7.0f} ex/s   ratio {off / on:5.2f}   (on/off; goal: within noise)"
        f"   CPU ms/step of worker 0: on {cpu[0] / steps * 1e3:5.1f}  off {cpu[1] / steps * 1e3:5.1f}"
    )


def worker(quick: bool) -> None:
    import phalanx

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Auto-sharding found no files")  # DATA is intended
    strategy = phalanx.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.worker_index
    # the references on plain gloo: the default group is phalanx's own (process_group.py)
    reference = dist.new_group(backend="gloo")
    lines = _bench_all_reduce(strategy, reference, quick)
    lines.append(_bench_training(strategy, reference, rank, quick))
    lines.append(_bench_engines(strategy, reference, rank, quick))
    lines.append(_bench_check(strategy, rank, quick))
    if rank == 0:
        group = strategy._group
        transport = "shared memory (same machine)" if group.uses_shared_memory else "gloo"
        transport = "mutual-TLS ring" if group.uses_tls and not group.uses_shared_memory else transport
        lines.insert(
            0,
            f"phalanx cross-worker transport: {transport}; PHALANX_SHARED_MEMORY=0 forces gloo, and with "
            "PHALANX_COLLECTIVES=tls PHALANX_CLUSTER_TOKEN=<secret> the TLS ring machines use",
        )
        print("\n".join(lines), flush=True)
    strategy.close()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (under a minute)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.quick)
        return 0
    from phalanx.cluster import launch

    return launch(
        os.path.abspath(__file__),
        workers=2,
        args=["--worker"] + (["--quick"] if args.quick else []),
        timeout=600,
    )


if __name__ == "__main__":
    sys.exit(main())
