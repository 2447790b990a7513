"""ParameterServerStrategy: phalanx against TensorFlow 2.21's, side by side in one run.

Run: python benchmarks/bench_ps_tf.py [--quick] [--case mlp:2:1 ...] [--tf-python PATH]

Each case is a local cluster on 127.0.0.1, one process per task (a chief, N workers, M ps),
one intra-op thread per process (TF's ps and workers need two inter-op threads); the chief
schedules a round of steps and joins, the best of ``--rounds`` rounds counts
(`_ps_cluster.measure`). The workloads:

* mlp: MLP 784-1024-1024-10, global batch 256 (one fixed batch), cross-entropy, SGD 0.01;
* emb: ``nn.Embedding(100_000, 32)`` + ``Linear(8 * 32, 1)``, batches of 256 x 8 ids from 64
  batches cycled per worker, loss mean(out^2), Adagrad 0.1, no partitioner;
* emb_split: the same with ``FixedShardsPartitioner(2)``.

The TensorFlow side (`_ps_tf_reference.py`) runs in its own environment: ``--tf-python``,
else ``$PHALANX_TF_PYTHON``, else ``/work/tfvenv/bin/python`` if it exists; without one the
TF column says "skipped" and only phalanx's numbers are printed. ratio = phalanx steps/s
divided by TF steps/s (> 1: phalanx is faster). "join ms" is what phalanx's ``join()`` adds to
a round once its steps finished, the median over the rounds (`_TimedRefresh`): it brings the
chief's copies up to the ps tasks' values, reading what changed since the last join (the rows
the round's row gradients wrote, every variable written whole; TF's join reads nothing), so a
round of few steps over a slow link shows it per step. Nothing is asserted.

The line under the header times each workload's model step trained alone, in one process on
one thread without any distribution (torch: forward, backward, ``optimizer.step()``, the
embedding sparse; TF: the same ``tf.function`` step on local variables): what each side's
kernels cost, so CPU per step minus that is what the distribution system costs (on an AMD
CPU torch's fp32 GEMM is about half TF's oneDNN speed, and the MLP shows it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _ps_cluster as cluster  # noqa: E402

TF_REFERENCE = HERE / "_ps_tf_reference.py"
DEFAULT_TF_PYTHON = "/work/tfvenv/bin/python"
_TOKEN = "benchmark-secret"  # noqa: S105 - a local benchmark cluster's token, not a secret
_RAISED = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit): ")
_TASK_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PHALANX_CLUSTER_TOKEN": _TOKEN}


# ---------------------------------------------------------------------- the phalanx side
def _threads() -> None:
    import torch

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(1)


def _serve(spec: dict[str, list[str]], job: str, index: int) -> None:
    import phalanx

    _threads()
    phalanx.Server(spec, job, index).join()


def _mlp_model() -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def batches():  # noqa: ANN202 - a generator on the worker: one fixed batch
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(256, 784, generator=g), torch.randint(0, 10, (256,), generator=g)
        while True:
            yield x, y

    def loss_of(batch: Any) -> Any:
        features, labels = batch
        return nn.functional.cross_entropy(model(features), labels)

    return optimizer, batches, loss_of


def _embedding_model(sparse: bool = False) -> tuple[Any, Any, Any]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100_000, 32, sparse=sparse), nn.Flatten(), nn.Linear(8 * 32, 1))
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)

    def batches():  # noqa: ANN202 - a generator on the worker: 64 batches of ids, cycled
        g = torch.Generator().manual_seed(5)
        pool = torch.randint(0, 100_000, (cluster.IDS_POOL, 256, 8), generator=g)
        while True:
            yield from pool

    def loss_of(ids: Any) -> Any:
        return model(ids).pow(2).mean()

    return optimizer, batches, loss_of


def _chief(args: Any, spec: dict[str, list[str]]) -> tuple[Any, Any]:
    import phalanx
    from phalanx.cluster.resolvers import SimpleClusterResolver

    _threads()
    partitioner = None
    if args.workload == "emb_split":
        partitioner = phalanx.partitioners.FixedShardsPartitioner(2)
    resolver = SimpleClusterResolver(spec, task_type="chief", task_id=0)
    strategy = phalanx.ParameterServerStrategy(resolver, variable_partitioner=partitioner)
    coordinator = phalanx.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        optimizer, batches, loss_of = (_mlp_model if args.workload == "mlp" else _embedding_model)()
    iterator = iter(coordinator.create_per_worker_dataset(batches))

    def step(iterator: Any) -> None:
        loss = loss_of(next(iterator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    def run_steps(n: int) -> None:
        for _ in range(n):
            coordinator.schedule(step, args=(iterator,))
        coordinator.join()

    strategy._chief.copies.refresh = _TimedRefresh(strategy._chief.copies.refresh)
    return run_steps, strategy


def _phalanx_case(args: Any) -> dict[str, Any]:
    """One case on phalanx's side, in this process as the chief."""
    os.environ.update(_TASK_ENV)
    spec = cluster.cluster_spec(args.workers, args.ps)
    tasks = cluster.start_tasks(__file__, spec, [], _TASK_ENV)
    strategy = None
    try:
        tasks.wait_until_listening()
        run_steps, strategy = _chief(args, spec)
        steps = args.steps or cluster.default_steps(args.workload, args.quick)
        rounds = 1 if args.quick else args.rounds
        result = cluster.measure(
            run_steps, tasks.pids(), steps, warmup=cluster.warmup_steps(steps, args.workers), rounds=rounds
        )
        result["join_ms"] = strategy._chief.copies.refresh.median_ms()
    finally:
        if strategy is not None:
            strategy.close()
        tasks.stop()
    return result


class _TimedRefresh:
    """The chief's ``LocalCopies.refresh``, timed: what each ``join()`` adds once the steps
    finished (the first, which reads every variable whole, is left out of the median)."""

    def __init__(self, refresh: Any) -> None:
        self._refresh = refresh
        self.seconds: list[float] = []

    def __call__(self) -> None:
        start = time.perf_counter()
        self._refresh()
        self.seconds.append(time.perf_counter() - start)

    def median_ms(self) -> float:
        return statistics.median(self.seconds[1:] or self.seconds or [0.0]) * 1e3


def _kernel_ms(workload: str) -> float:
    """ms per step of ``workload``'s model trained alone here (one process, one thread, no
    distribution): torch's forward, backward and optimizer step (the embedding sparse, so
    Adagrad updates only the looked-up rows, as on the ps tasks)."""
    _threads()
    optimizer, batches, loss_of = _mlp_model() if workload == "mlp" else _embedding_model(sparse=True)
    data = batches()

    def step() -> None:
        loss = loss_of(next(data))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return cluster.time_kernel(step)


# ---------------------------------------------------------------------- side by side
def _run_side(python: str, script: Path, case: tuple[str, int, int], args: Any) -> dict[str, Any] | str:
    """Runs one case in ``python script --json``; its RESULT, or why there is none."""
    workload, workers, ps = case
    cmd = [python, str(script), "--json", "--workload", workload, "--workers", str(workers), "--ps", str(ps)]
    cmd += ["--rounds", str(args.rounds)] + (["--quick"] if args.quick else [])
    cmd += ["--steps", str(args.steps)] if args.steps else []
    if script == Path(__file__).resolve():
        cmd.append("--phalanx-side")
    cmd = cluster.in_host("chief:0") + cmd  # on its simulated host, if any (bench_ps_scaling --links)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **_TASK_ENV})
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    lines = done.stderr.strip().splitlines()
    # the traceback's last line names the cause; the gRPC "Connection refused" lines that follow
    # it are the teardown of a cluster whose tasks were already stopped
    raised = [line for line in lines if _RAISED.match(line)]
    errors = raised or [line for line in lines if "Error" in line] or lines
    return f"failed (exit {done.returncode}): {errors[-1][:300] if errors else ''}"


def _kernels_line(workloads: list[str], tf_python: str | None) -> str:
    """One line: each workload's model step trained alone (one process, one thread, no
    distribution) in torch and in TF, so a reader sees how much of each side's CPU per step
    is the model's kernels and how much the distribution system (emb_split's model is emb's)."""
    models = list(dict.fromkeys("emb" if w == "emb_split" else w for w in workloads))
    sides = [("torch", sys.executable, Path(__file__).resolve())]
    sides += [("TF", tf_python, TF_REFERENCE)] if tf_python else []
    timed: dict[str, dict[str, float] | str] = {}
    for side, python, script in sides:
        cmd = [str(python), str(script), "--kernels", ",".join(models)]
        env = {**os.environ, **_TASK_ENV}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        timed[side] = json.loads(found[-1][len("RESULT ") :]) if found else f"failed (exit {done.returncode})"
    parts = []
    for model in models:
        each = [
            f"{side} {ms[model]:.2f}" if isinstance(ms, dict) else f"{side} {ms}"
            for side, ms in timed.items()
        ]
        parts.append(f"{model} " + ", ".join(each))
    return "# the model's step alone (one process, one thread, no distribution), ms: " + "; ".join(parts)


def _tf_python(args: Any) -> str | None:
    for candidate in (args.tf_python, os.environ.get("PHALANX_TF_PYTHON"), DEFAULT_TF_PYTHON):
        if candidate and Path(candidate).exists():
            return str(candidate)
    return None


def _tf_version(python: str) -> str:
    code = "import os; os.environ['TF_CPP_MIN_LOG_LEVEL']='2'; import tensorflow as tf; print(tf.__version__)"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
    return done.stdout.strip() or "unavailable"


def _header(tf_python: str | None) -> str:
    import torch

    import phalanx

    tf = (
        f"TensorFlow {_tf_version(tf_python)} ({tf_python})"
        if tf_python
        else "TensorFlow skipped (none found)"
    )
    return (
        f"# {cluster.host_line()}\n# Python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"phalanx {getattr(phalanx, '__version__', '?')}, {tf}\n"
        "# threads: 1 intra-op per task (torch.set_num_threads(1); TF ConfigProto intra 1, inter 2 on ps and "
        "workers as 1 deadlocks TF 2.21); "
        "steps/s = best round, CPU = ms per step summed over all tasks"
    )


def _cpu(result: dict[str, Any] | str) -> str:
    if isinstance(result, str):
        return "-"
    return f"{sum(result['cpu_ms_per_step'].values()):.1f}"


def _row(case: tuple[str, int, int], ours: dict[str, Any] | str, ref: dict[str, Any] | str | None) -> str:
    workload, workers, ps = case
    name = f"{workload}, {workers} workers, {ps} ps"
    mine = f"{ours['steps_per_s']:8.1f}" if isinstance(ours, dict) else f"{'failed':>8}"
    theirs = (
        f"{ref['steps_per_s']:8.1f}"
        if isinstance(ref, dict)
        else f"{'skipped' if ref is None else 'failed':>8}"
    )
    ratio = "-"
    if isinstance(ours, dict) and isinstance(ref, dict):
        ratio = f"{ours['steps_per_s'] / ref['steps_per_s']:.2f}"
    join = f"{ours['join_ms']:.1f}" if isinstance(ours, dict) and "join_ms" in ours else "-"
    cpu = f"{_cpu(ours):>10}  {_cpu(ref) if ref else '-':>10}"
    return f"{name:<28} {mine}  {theirs}  {ratio:>6}  {cpu}  {join:>9}"


def _parse() -> Any:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--case", action="append", default=[], help="WORKLOAD:WORKERS:PS (default: all)")
    parser.add_argument("--tf-python", default=None, help="a Python with tensorflow-cpu installed")
    parser.add_argument("--phalanx-side", action="store_true", help="(internal) run one case of phalanx")
    args, _ = parser.parse_known_args()
    common = cluster.parse_common()
    for key, value in vars(common).items():
        setattr(args, key, value)
    return args


def main() -> None:
    args = _parse()
    if args.serve:
        _serve(json.loads(args.cluster), args.serve[0], int(args.serve[1]))
        return
    if args.kernels:
        print("RESULT " + json.dumps({w: _kernel_ms(w) for w in args.kernels.split(",")}), flush=True)
        return
    if args.phalanx_side:
        print("RESULT " + json.dumps(_phalanx_case(args)), flush=True)
        return
    cases = [(w, int(n), int(p)) for w, n, p in (c.split(":") for c in args.case)] or cluster.CASES
    tf_python = _tf_python(args)
    print(_header(tf_python), flush=True)
    print(_kernels_line([w for w, _, _ in cases], tf_python), flush=True)
    print(
        f"{'case (steps/s)':<28} {'phalanx':>8}  {'TF':>8}  {'ratio':>6}  "
        f"{'CPU ms ph':>10}  {'CPU ms TF':>10}  {'join ms':>9}"
    )
    for case in cases:
        ours = _run_side(sys.executable, Path(__file__).resolve(), case, args)
        ref = _run_side(tf_python, TF_REFERENCE, case, args) if tf_python else None
        print(_row(case, ours, ref), flush=True)
        for side, result in (("phalanx", ours), ("TF", ref)):
            if isinstance(result, str):
                print(f"    {side}: {result}", flush=True)


if __name__ == "__main__":
    main()
