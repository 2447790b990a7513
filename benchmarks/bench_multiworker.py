"""MultiWorkerMirroredStrategy over 2 processes against raw torch.distributed (gloo) and DDP.

Run: python benchmarks/bench_multiworker.py [--quick] [--section N ...]   (N: 1-4, default all)

1. All-reduce: phalanx's cross-worker path (``strategy.cross_worker_all_reduce``, the one
   reduce/all_reduce/gradient sync use: staging, deadline and health check included) against
   raw ``torch.distributed.all_reduce`` on the same gloo group, at 4 KB, 256 KB, 4 MB, 64 MB.
   ratio = raw time / phalanx time (goal >= 0.95 from 4 MB).
2. The user's loop: MLP 784-1024-1024-10, global batch 256 (128 per worker), SGD, 2 workers x
   1 intra-op thread, written as users write it: a custom loop over
   ``strategy.experimental_distribute_dataset`` of in-memory global batches (default options,
   ``strategy.run`` per step, a final ``strategy.reduce`` of the loss), and ``Model.fit`` over
   the same batches, each against DistributedDataParallel (gloo) running its own half of each
   batch in a plain loop. Rounds of 30 and 100 steps alternate (7 repeats), each side going first in turn,
   after one warm-up round of each (first-step work: the chief's broadcast, DDP's bucket
   rebuild). A round is timed from a barrier to a barrier and includes everything the user's
   loop does in it: the distributed iterator made for the pass, ``fit``'s setup, the reduce.
   ratio = phalanx / DDP examples per second, best round (in brackets the median of the
   paired ratios: each phalanx round against the DDP round of the same repeat); goal >= 1.3
   on shared memory, >= 1.0 over gloo, for both loops and both round lengths. CPU ms per step
   of worker 0 (every thread of the process) beside it: steadier than wall time on a busy box.
3. The gradient engines alone, in a plain torch loop of that MLP (no ``run``, no iterator):
   phalanx's gradient buckets (`phalanx.communication.engine.bucketing`, over the strategy's own
   transport) against DDP's C++ reducer as DDP builds it, and as DDP with
   ``gradient_as_bucket_view`` and a summing communication hook (phalanx's convention).
   Printed as CPU ms per step of worker 0 above the same loop with no all-reduce at all, then
   where each engine's CPU goes: the training thread and the others (gloo's, the
   shared-memory transport's), from ``/proc/self/task/*/schedstat``.
4. The collective check's cost (`phalanx.communication.checks.collective_check`): 2's custom loop with
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
ROUND_STEPS = (30, 100)  # the training rounds, alternating: short and long


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


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _user_loop(strategy, batches: dict[int, list]) -> dict[int, Callable[[], object]]:
    """The custom loop a user writes, one round function per round length: the MLP and SGD made
    in the scope, ``experimental_distribute_dataset`` of in-memory global batches with its
    default options, ``strategy.run`` per step (TF's loss convention, the loss returned), and
    a final ``strategy.reduce`` of the last step's loss. Each round is one pass over its own
    distributed dataset (a fresh iterator, as ``for x, y in dataset`` makes)."""
    import phalanx

    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        loss = phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()  # gradients summed across workers (TF's convention)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    def make(data: list) -> Callable[[], object]:
        dataset = strategy.experimental_distribute_dataset(data)

        def one_round() -> object:
            per_replica = None
            for x, y in dataset:
                per_replica = strategy.run(step, args=(x, y))
            return strategy.reduce("sum", per_replica, axis=None)

        return one_round

    return {steps: make(data) for steps, data in batches.items()}


def _fit_loop(strategy, batches: dict[int, list]) -> dict[int, Callable[[], object]]:
    """``Model.fit`` over the same global batches, one round function per round length: the
    arrays of a round's batches, ``batch_size`` the global batch, one epoch, no shuffling (the
    same batches as the other sides), ``verbose=0``; its global loss logged at every step."""
    import phalanx

    with strategy.scope():
        model = phalanx.Model(_mlp())
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
            loss=phalanx.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    def make(data: list) -> Callable[[], object]:
        x, y = torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])
        return lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=1, shuffle=False, verbose=0)

    return {steps: make(data) for steps, data in batches.items()}


def _ddp_loop(reference, rank: int, batches: dict[int, list]) -> dict[int, Callable[[], object]]:
    """The DDP loop a user writes: each worker's own half of every global batch, a plain loop,
    gradients averaged by DDP's reducer on a plain gloo group."""
    half = GLOBAL_BATCH // 2
    model = nn.parallel.DistributedDataParallel(_mlp(), process_group=reference)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def make(data: list) -> Callable[[], object]:
        mine = [(x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]) for x, y in data]

        def one_round() -> object:
            loss = None
            for x, y in mine:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            return loss

        return one_round

    return {steps: make(data) for steps, data in batches.items()}


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


def _bench_training(strategy, reference, rank: int, quick: bool) -> list[str]:
    """The user's loops against DDP's in alternating rounds of 30 and 100 steps (see the module
    docstring); one line per phalanx loop and round length."""
    batches = {steps: _batches(steps, seed) for seed, steps in enumerate(ROUND_STEPS, start=1)}
    sides = {
        "custom loop": _user_loop(strategy, batches),
        "fit": _fit_loop(strategy, batches),
        "DDP": _ddp_loop(reference, rank, batches),
    }
    for rounds in sides.values():  # warm-up: first-step work (broadcasts, DDP's bucket rebuild)
        for one_round in rounds.values():
            one_round()
    wall = {(side, steps): [] for side in sides for steps in ROUND_STEPS}
    cpu = {(side, steps): [] for side in sides for steps in ROUND_STEPS}
    order = list(sides)
    for repeat in range(2 if quick else 7):
        for steps in ROUND_STEPS:
            for side in order[repeat % 3 :] + order[: repeat % 3]:  # each side goes first in turn
                start = time.process_time()
                wall[side, steps].append(_round(sides[side][steps], 1) / steps)
                cpu[side, steps].append((time.process_time() - start) / steps)
    lines = []
    for steps in ROUND_STEPS:
        ddp_best = min(wall["DDP", steps])
        ddp_cpu = min(cpu["DDP", steps]) * 1e3
        for side in ("custom loop", "fit"):
            best = min(wall[side, steps])
            paired = _median([d / o for o, d in zip(wall[side, steps], wall["DDP", steps], strict=True)])
            lines.append(
                f"user's {side:<11} {steps:3d}-step rounds   phalanx {GLOBAL_BATCH / best:7.0f} ex/s   "
                f"DDP {GLOBAL_BATCH / ddp_best:7.0f} ex/s   ratio {ddp_best / best:5.2f} (paired median "
                f"{paired:4.2f})   (phalanx/DDP; goal >= 1.3 shm, >= 1.0 gloo)   CPU ms/step "
                f"of worker 0: phalanx {min(cpu[side, steps]) * 1e3:5.1f}  DDP {ddp_cpu:5.1f}"
            )
    return lines


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
        lambda tensor: group.all_reduce_async(tensor, may_block=True),  # as the strategy launches
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
    """The collective check's cost in one run: the user's custom loop of `_bench_training` with
    the codes on and off in alternating rounds (both workers switch at the same point)."""
    group = strategy._group
    if not group._check.enabled:
        return "collective check: off for this run (PHALANX_COLLECTIVE_CHECK=0), no A/B"

    def switch(on: bool) -> None:  # measurement only: private switches, flipped by every worker alike
        group._check.enabled = on
        group._gloo.set_checked(on)

    steps = ROUND_STEPS[0] if quick else ROUND_STEPS[-1]
    run_round = _user_loop(strategy, {steps: _batches(steps, 3)})[steps]

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


def worker(quick: bool, sections: list[int]) -> None:
    import phalanx

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Auto-sharding found no files")  # DATA is intended
    strategy = phalanx.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.worker_index
    # the references on plain gloo: the default group is phalanx's own (process_group.py)
    reference = dist.new_group(backend="gloo")
    lines: list[str] = []
    if 1 in sections:
        lines += _bench_all_reduce(strategy, reference, quick)
    if 2 in sections:
        lines += _bench_training(strategy, reference, rank, quick)
    if 3 in sections:
        lines.append(_bench_engines(strategy, reference, rank, quick))
    if 4 in sections:
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
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (about a minute)")
    parser.add_argument(
        "--section", type=int, action="append", choices=(1, 2, 3, 4), help="run only these (repeatable)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sections = args.section or [1, 2, 3, 4]
    if args.worker:
        worker(args.quick, sections)
        return 0
    from phalanx.cluster import launch

    return launch(
        os.path.abspath(__file__),
        workers=2,
        args=["--worker"] + (["--quick"] if args.quick else []) + [f"--section={n}" for n in sections],
        timeout=600,
    )


if __name__ == "__main__":
    sys.exit(main())
