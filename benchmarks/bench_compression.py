"""Fewer bytes between simulated hosts: MultiWorkerMirrored with no compression, ``"fp16"``,
`PowerSGD` and gradient accumulation beside DDP with the matching communication hook (or its
``no_sync()``), on shaped links.

Run (as root; uses tests/multihost/hosts.py):
    python benchmarks/bench_compression.py [--quick] [--rate 1gbit|10gbit] [--compression NAME]

For each link rate (1 and 10 Gbit/s, ``tc ... tbf`` both ways) and each case (none, fp16,
PowerSGD rank 2, and ``accum4``: each update's 16 examples as 4 micro-batches of 4, the first
three under ``strategy.no_sync()`` / DDP's ``no_sync()``), two hosts (network namespaces on a
private bridge) run one worker each (gloo; 1 intra-op thread), and in the same processes:

* step time: MLP 784-1024-1024-10 at global batch 16 (7.5 MB of float32 gradients a step
  for a few ms of forward and backward: link-bound at 1 Gbit/s), a phalanx custom loop
  (experimental_distribute_dataset, strategy.run, compute_average_loss, compressed gradient
  buckets) against DistributedDataParallel on the same per-worker batches with the matching
  hook (none, ``fp16_compress_hook``, ``powerSGD_hook`` at rank 2; DDP then keeps one bucket,
  since torch's hook deadlocks over gloo with two), 8 alternating rounds of 24 updates,
  each side going first in turn; the best round of each counts, and beside it the median
  of the rounds' paired ratios (each phalanx round against the DDP round beside it: a link
  shaped by a token bucket moves single steps by +-15 %, which a best round alone hides);
* bytes per step: what this host sent on its link during those rounds (``/proc/net/dev`` of the
  host's network namespace, every interface but lo), per step;
* accuracy after a fixed budget on the digits demo (`phalanx.cli.demo.DigitsCNN`, the same steps
  and batches for phalanx and DDP; test accuracy).

Times and bytes are per update (16 examples) in every case. Nothing is asserted. Prints why
and exits 0 where hosts cannot be simulated (not root, no iproute2). Both hosts share this
machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

GLOBAL_BATCH = 16  # per update: small enough that the MLP is link-bound at 1 Gbit
DIGITS_BATCH = 64
RANK, START = 2, 2  # PowerSGD rank and start iteration, for phalanx and DDP alike
COMPRESSIONS = ("none", "fp16", "powersgd", "accum4")
MICRO = 4  # micro-batches per update in the "accum4" case


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


def _options(name: str) -> Any:
    import phalanx

    compression = {
        "none": None,
        "fp16": "fp16",
        "powersgd": phalanx.experimental.PowerSGD(rank=RANK, start_iteration=START),
        "accum4": None,
    }[name]
    return phalanx.experimental.CommunicationOptions(compression=compression)


def _ddp(model: nn.Module, name: str, group: Any) -> nn.parallel.DistributedDataParallel:
    """DDP over ``group`` with the hook that matches ``name``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    # torch's powerSGD_hook waits for its second all-reduce inside a future's callback, on one of
    # gloo's two run-loop threads: with two buckets both wait and the job hangs. One bucket.
    one_bucket = {"bucket_cap_mb": 1024} if name == "powersgd" else {}
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, **one_bucket)
    if name == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(group, matrix_approximation_rank=RANK, start_powerSGD_iter=START)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _timed(epoch: Any, steps: int) -> tuple[float, float]:
    from multihost.hosts import sent_bytes

    """One pass, started together on every worker: (seconds per step, bytes sent per step)."""
    dist.barrier()
    sent, start = sent_bytes(), time.perf_counter()
    epoch()
    dist.barrier()
    return (time.perf_counter() - start) / steps, (sent_bytes() - sent) / steps


def _step_times(strategy: Any, name: str, group: Any, quick: bool) -> dict[str, float]:
    import phalanx

    rank, world = strategy.cluster_resolver.worker_index, strategy.num_replicas_in_sync
    steps = 3 if quick else 24
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(GLOBAL_BATCH, 784, generator=g), torch.randint(0, 10, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]
    micro = MICRO if name == "accum4" else 1
    if micro > 1:  # each update's examples as `micro` global batches, in order
        data = [(x[i::micro], y[i::micro]) for x, y in data for i in range(micro)]
    share = GLOBAL_BATCH // micro // world
    mine = [(x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]) for x, y in data]
    ddp_model = _ddp(_mlp(), name, group)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)

    def ddp_epoch() -> None:
        for i, (x, y) in enumerate(mine):
            last = i % micro == micro - 1
            with contextlib.nullcontext() if last else ddp_model.no_sync():
                (nn.functional.cross_entropy(ddp_model(x), y) / micro).backward()
            if last:
                ddp_opt.step()
                ddp_opt.zero_grad()

    with strategy.scope():
        model = _mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = strategy.experimental_distribute_dataset(
        data, phalanx.InputOptions(experimental_fetch_to_device=False)
    )

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        backward(x, y)
        optimizer.step()
        optimizer.zero_grad()

    def phalanx_epoch() -> None:
        for i, (x, y) in enumerate(dataset):
            if i % micro == micro - 1:
                strategy.run(step, args=(x, y))
            else:
                with strategy.no_sync():  # only accumulates: no traffic until the update
                    strategy.run(backward, args=(x, y))

    phalanx_epoch(), ddp_epoch()  # warm up (and PowerSGD's uncompressed start iterations)
    ours, ddp = [], []
    for repeat in range(1 if quick else 8):
        sides = ((phalanx_epoch, ours), (ddp_epoch, ddp))
        for epoch, times in sides if repeat % 2 == 0 else sides[::-1]:  # each side goes first in turn
            times.append(_timed(epoch, steps))
    best_ours, best_ddp = min(ours), min(ddp)
    paired = sorted(d[0] / o[0] for o, d in zip(ours, ddp, strict=True))  # DDP / phalanx, round by round
    return {
        "phalanx_s": best_ours[0],
        "ddp_s": best_ddp[0],
        "paired_median": paired[len(paired) // 2],
        "phalanx_bytes": best_ours[1],
        "ddp_bytes": best_ddp[1],
    }


def _digits_accuracy(strategy: Any, name: str, group: Any, quick: bool) -> dict[str, float]:
    """Test accuracy after the same budget of steps for phalanx and DDP (the digits demo's CNN)."""
    import phalanx
    from phalanx.cli.demo import DigitsCNN, load_digits_split

    rank, world = strategy.cluster_resolver.worker_index, strategy.num_replicas_in_sync
    xs, ys, xt, yt = (torch.from_numpy(a) for a in load_digits_split())
    steps = 10 if quick else 200
    order = torch.randperm(len(xs), generator=torch.Generator().manual_seed(2))
    batches = [order[(i * DIGITS_BATCH) % (len(xs) - DIGITS_BATCH) :][:DIGITS_BATCH] for i in range(steps)]
    micro = MICRO if name == "accum4" else 1
    batches = [idx[i::micro] for idx in batches for i in range(micro)]  # `micro` per update
    share = DIGITS_BATCH // micro // world

    torch.manual_seed(0)
    ddp_model = _ddp(DigitsCNN(), name, group)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    for i, idx in enumerate(batches):
        mine = idx[rank * share : (rank + 1) * share]
        last = i % micro == micro - 1
        with contextlib.nullcontext() if last else ddp_model.no_sync():
            (nn.functional.cross_entropy(ddp_model(xs[mine]), ys[mine]) / micro).backward()
        if last:
            ddp_opt.step()
            ddp_opt.zero_grad()

    with strategy.scope():
        torch.manual_seed(0)
        model = DigitsCNN()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def backward(idx: torch.Tensor) -> None:
        mine = idx[rank * share : (rank + 1) * share]
        per_example = nn.functional.cross_entropy(model(xs[mine]), ys[mine], reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=DIGITS_BATCH).backward()

    def step(idx: torch.Tensor) -> None:
        backward(idx)
        optimizer.step()
        optimizer.zero_grad()

    for i, idx in enumerate(batches):
        if i % micro == micro - 1:
            strategy.run(step, args=(idx,))
        else:
            with strategy.no_sync():
                strategy.run(backward, args=(idx,))
    with torch.no_grad():
        return {
            "phalanx_acc": (model(xt).argmax(1) == yt).float().mean().item(),
            "ddp_acc": (ddp_model.module(xt).argmax(1) == yt).float().mean().item(),
        }


def worker(name: str, quick: bool) -> None:
    """One worker: step times, bytes and digits accuracy for ``name``; rank 0 prints JSON."""
    import phalanx

    torch.set_num_threads(1)
    strategy = phalanx.MultiWorkerMirroredStrategy(communication_options=_options(name))
    group = dist.new_group(backend="gloo")  # DDP on plain gloo beside phalanx's own group
    result = {**_step_times(strategy, name, group, quick), **_digits_accuracy(strategy, name, group, quick)}
    if strategy.cluster_resolver.worker_index == 0:
        print(json.dumps({"result": result}), flush=True)
    strategy.close()


def _run_case(rate: str, name: str, quick: bool) -> dict[str, float] | str:
    from multihost.cluster import base_env, tf_config, wait_all, worker_cluster
    from multihost.hosts import SimulatedHosts

    with SimulatedHosts(2) as hosts:
        for host in hosts:
            host.shape(rate)
        cluster = worker_cluster(hosts)
        argv = [sys.executable, os.path.abspath(__file__), "--worker", name] + (["--quick"] if quick else [])
        processes = [
            host.run(argv, base_env(TF_CONFIG=tf_config(cluster, "worker", i)), name=f"worker-{i}")
            for i, host in enumerate(hosts)
        ]
        codes, output = wait_all(processes, timeout=900)
    if codes != [0, 0]:
        return f"failed ({codes})\n{output}"
    line = next(line for line in output.splitlines() if '"result"' in line)
    return json.loads(line.split("] ", 1)[1])["result"]


def _report(rate: str, name: str, r: dict[str, float], base: dict[str, float] | None) -> str:
    speedup = f"{base['phalanx_s'] / r['phalanx_s']:5.2f}x" if base else "  -  "
    return (
        f"{rate:>6} {name:>9}  phalanx {1000 * r['phalanx_s']:7.1f} ms/step ({speedup} none)  "
        f"DDP {1000 * r['ddp_s']:7.1f} ms/step  phalanx/DDP {r['ddp_s'] / r['phalanx_s']:5.2f} "
        f"(paired median {r['paired_median']:4.2f})  "
        f"sent/step phalanx {r['phalanx_bytes'] / 1e6:6.2f} MB DDP {r['ddp_bytes'] / 1e6:6.2f} MB  "
        f"digits acc phalanx {r['phalanx_acc']:.3f} DDP {r['ddp_acc']:.3f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few steps: shows it works, no figures")
    parser.add_argument("--rate", choices=("1gbit", "10gbit"), help="only this link rate")
    parser.add_argument("--compression", choices=COMPRESSIONS, help="only this compression")
    parser.add_argument("--worker", choices=COMPRESSIONS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.quick)
        return 0
    from multihost.hosts import missing_tools

    reason = missing_tools()
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    print(
        f"{os.cpu_count()} CPU cores shared by both simulated hosts; "
        f"MLP 784-1024-1024-10 global batch {GLOBAL_BATCH}",
        flush=True,
    )
    for rate in ("1gbit", "10gbit"):
        if args.rate not in (None, rate):
            continue
        base = None
        for name in COMPRESSIONS:
            if args.compression not in (None, name):
                continue
            result = _run_case(rate, name, args.quick)
            if isinstance(result, str):
                print(f"{rate:>6} {name:>9}  {result}", flush=True)
                continue
            base = result if name == "none" else base
            print(_report(rate, name, result, base), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
