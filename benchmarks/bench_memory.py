"""Peak memory per worker: MultiWorkerMirrored, FullySharded, ModelParallel 1-D and 2-D, and raw
torch (FSDP2; tensor parallelism 1-D; FSDP2 + tensor parallelism 2-D), measured and estimated.

Run: python benchmarks/bench_memory.py [--workers 2 4] [--width 2048] [--layers 4] [--steps 6]
     [--malloc default tuned] [--cap-mb 400] [--json out.json]

Each job trains an MLP (``--layers`` x ``Linear(width, width)`` + ReLU; 16.8M parameters at
the defaults) with Adam on the CPU, 1 intra-op thread per worker, global batch 64, through
``--steps`` steps and a checkpoint save, and measures each worker's peak resident memory growth
from just before the strategy is made (`phalanx.memory.PeakMeter`: VmHWM less the resident
memory then), after the imports a script makes at its top, the same for every phalanx row
(torch, phalanx, phalanx.experimental; see `_job`): what the training imports later
(torch._dynamo, which the first torch optimizer imports; torch's checkpointing at the save)
counts. The figure of a job is its largest worker's; "+imports" is the same peak counted from
before those imports. Beside it: `phalanx.experimental.estimate_memory`'s estimate of the same
peak and their ratio (goal: within 10 %), and examples per second against raw FSDP2's.

Raw torch rows run on torch's own gloo groups: ``raw_fsdp2`` shards every Linear with
``fully_shard``; ``raw_tp_1d`` is ``parallelize_module`` over a ``("tp",)`` mesh of every worker
(the Linears paired, ColwiseParallel then RowwiseParallel); ``raw_fsdp2_tp_2d`` is
torchtitan's recipe: the same plan on the ``tp`` axis of a ``("dp", "tp")`` mesh and
``fully_shard`` on ``dp`` (4 workers or more).

``--malloc default`` runs each worker with glibc's default malloc settings, as a user's process
runs; ``tuned`` sets ``MALLOC_MMAP_THRESHOLD_``/``MALLOC_TRIM_THRESHOLD_`` (large freed blocks
go back to the system at once). ``--cap-mb``: the largest width of the MLP each strategy trains
under that per-worker cap, by the estimate, then measured at that width.

Adding a strategy: one entry in ``JOBS`` (its class, how a worker makes it, its mesh) and, for
the estimate, its kind in `phalanx.memory.estimate.STRATEGY_KINDS`.

Nothing is asserted: worker 0 of each job writes its figures; this process prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 64
# what a script imports at its top besides torch (see `_job`): phalanx's, or raw torch's (FSDP2,
# tensor parallelism, DCP)
SCRIPT_IMPORTS = ("phalanx", "phalanx.experimental")
RAW_IMPORTS = ("torch.distributed.fsdp", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint")
TUNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "1048576", "MALLOC_TRIM_THRESHOLD_": "1048576"}


def mlp(width: int, layers: int, device: str = "cpu") -> nn.Module:
    """The benchmark's model (seeded: every strategy starts from the same values)."""
    torch.manual_seed(0)
    with torch.device(device):
        return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)])


def _data(steps: int, width: int, rank: int, workers: int) -> tuple[list, list]:
    g = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(GLOBAL_BATCH, width, generator=g), torch.randint(0, width, (GLOBAL_BATCH,), generator=g))
        for _ in range(steps)
    ]
    per = GLOBAL_BATCH // workers
    return data, [(x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]) for x, y in data]


def _phalanx_job(strategy: Any, cfg: dict, marks: dict, meter: Any) -> float:
    import phalanx

    marks["runtime"] = meter.growth()
    with strategy.scope():
        model = mlp(cfg["width"], cfg["layers"], "meta" if cfg["meta"] else "cpu")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    marks["built"] = meter.growth()
    strategy.run(lambda: None)  # the first run broadcasts (or shards) the model
    marks["made"] = meter.growth()
    rank, workers = strategy.cluster_resolver.task_id, strategy.num_replicas_in_sync
    data, _ = _data(cfg["steps"], cfg["width"], rank, workers)
    dataset = strategy.experimental_distribute_dataset(
        data, phalanx.InputOptions(experimental_fetch_to_device=False)
    )

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_example = nn.functional.cross_entropy(model(x), y, reduction="none")
        phalanx.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    start = None
    for i, (x, y) in enumerate(dataset):
        if i == 1:
            dist.barrier()
            start = time.perf_counter()
        strategy.run(step, args=(x, y))
        if i == 0:
            marks["first_step"] = meter.growth()
    dist.barrier()
    seconds = time.perf_counter() - start if start is not None else float("nan")
    marks["steps"] = meter.growth()
    directory = _shared_dir()
    phalanx.train.Checkpoint(model=model, optimizer=optimizer).save(os.path.join(directory, "ckpt"))
    marks["save"] = meter.growth()
    _remove(directory)
    return seconds


def _raw_job(cfg: dict, marks: dict, meter: Any, mesh_shape: tuple[int, ...] | None) -> float:
    """Raw torch: FSDP2 over every worker (``mesh_shape`` None), or torchtitan's recipe over a
    ``(tp,)`` or ``(dp, tp)`` mesh: ``parallelize_module`` pairs the Linears (ColwiseParallel,
    then RowwiseParallel) over ``tp``, and ``fully_shard`` shards them over ``dp`` (when more
    than one worker)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import phalanx

    resolver = phalanx.cluster.resolve_cluster()
    host, _, port = resolver.chief_address().rpartition(":")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=resolver.worker_index,
        world_size=resolver.num_workers,
    )
    marks["runtime"] = meter.growth()
    model = mlp(cfg["width"], cfg["layers"], "meta" if cfg["meta"] else "cpu")
    dp_mesh, replica, replicas = None, dist.get_rank(), dist.get_world_size()
    if mesh_shape is not None:
        names = ("dp", "tp")[-len(mesh_shape) :]
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        pairs = cfg["layers"] - cfg["layers"] % 2
        plan: dict[str, Any] = {
            f"{i}.0": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(pairs)
        }
        if pairs < cfg["layers"]:  # an unpaired last Linear gathers its output
            plan[f"{pairs}.0"] = ColwiseParallel(output_layouts=Replicate())
        parallelize_module(model, mesh["tp"], plan)
        if len(mesh_shape) == 2:
            dp_mesh = mesh["dp"]
            replica, replicas = dp_mesh.get_local_rank(), mesh_shape[0]
        else:
            replica, replicas = 0, 1
    if mesh_shape is None or dp_mesh is not None:
        for block in model:
            fully_shard(block[0], mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    if cfg["meta"]:
        model.to_empty(device="cpu")
        for block in model:
            block[0].reset_parameters()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    _, mine = _data(cfg["steps"], cfg["width"], replica, replicas)
    start = None
    for i, (x, y) in enumerate(mine):
        if i == 1:
            dist.barrier()
            start = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()  # FSDP2 averages over dp
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i == 0:
            marks["first_step"] = meter.growth()
    dist.barrier()
    seconds = time.perf_counter() - start if start is not None else float("nan")
    marks["steps"] = meter.growth()
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(_shared_dir(), "ckpt")
    )
    marks["save"] = meter.growth()
    return seconds


def _shared_dir() -> str:
    shared = [tempfile.mkdtemp(prefix="bench_memory_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    return str(shared[0])


def _remove(directory: str) -> None:
    """Worker 0 removes the job's checkpoint once every worker has written its part."""
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory, ignore_errors=True)


def _mwms_class() -> Any:
    import phalanx

    return phalanx.MultiWorkerMirroredStrategy


def _fully_sharded_class() -> Any:
    from phalanx.experimental import FullyShardedStrategy

    return FullyShardedStrategy


def _model_parallel_class() -> Any:
    from phalanx.experimental import ModelParallelStrategy

    return ModelParallelStrategy


def _model_parallel_kwargs(shape: tuple[int, ...]) -> dict:
    """Every Linear split by output features over the model axis (unpaired: each gathers its
    output), sharded over the batch axis as well when the mesh has one."""
    from phalanx.experimental import DeviceMesh, LayoutMap

    layouts = LayoutMap(DeviceMesh(shape, ("batch", "model")[-len(shape) :]))
    layouts[r"\d+\.0\.weight"] = ("model", None)
    return {"layout_map": layouts, "batch_dim_name": "batch"}


def _mesh_1d(workers: int) -> tuple[int, ...] | None:
    return (workers,)


def _mesh_2d(workers: int) -> tuple[int, ...] | None:
    return (2, workers // 2) if workers >= 4 and workers % 2 == 0 else None


@dataclasses.dataclass(frozen=True)
class Job:
    """One row kind of the table: its estimate kind, the strategy's class (imported before the
    meter starts, as a user's script imports it at its top; None: raw torch), the arguments a
    worker makes it with for ``workers``, and its mesh (None where it has no such mesh: skipped)."""

    kind: str
    strategy_class: Callable[[], Any] | None
    kwargs: Callable[[int], dict] = lambda workers: {}
    mesh: Callable[[int], tuple[int, ...] | None] | None = None


JOBS: dict[str, Job] = {
    "multi_worker_mirrored": Job("multi_worker_mirrored", _mwms_class),
    "fully_sharded": Job("fully_sharded", _fully_sharded_class),
    "model_parallel_1d": Job(
        "model_parallel",
        _model_parallel_class,
        lambda w: _model_parallel_kwargs(_mesh_1d(w) or ()),
        _mesh_1d,
    ),
    "model_parallel_2d": Job(
        "model_parallel",
        _model_parallel_class,
        lambda w: _model_parallel_kwargs(_mesh_2d(w) or ()),
        _mesh_2d,
    ),
    "raw_fsdp2": Job("fully_sharded", None),
    "raw_tp_1d": Job("model_parallel", None, mesh=_mesh_1d),
    "raw_fsdp2_tp_2d": Job("model_parallel", None, mesh=_mesh_2d),
}


def _runs(name: str, workers: int) -> bool:
    """Whether the job has a mesh for ``workers`` (2-D needs 4 or more, an even number)."""
    mesh = JOBS[name].mesh
    return mesh is None or mesh(workers) is not None


def _replicas(job: Job, workers: int) -> int:
    """Data-parallel replicas: the batch axis of a mesh, else every worker."""
    if job.mesh is None:
        return workers
    shape = job.mesh(workers) or (workers,)
    return shape[0] if len(shape) == 2 else 1


def _job(name: str, cfg: dict, result_path: str) -> None:
    """One job (every worker): trains, saves, and worker 0 writes the largest worker's figures."""
    # as a user measures: the script's imports first, then the meter, just before the strategy
    # is made. Every job's script imports the same modules (torch, phalanx and
    # phalanx.experimental, which brings torch's DTensor and FSDP2 in; a raw torch script its
    # FSDP2, tensor parallelism and DCP), so that no row's figure differs from another's by
    # modules one imported before its meter and the other after; what the training imports
    # later (torch._dynamo at the optimizer's creation, torch's checkpointing at the save) is
    # each job's. ``imports``: what those imports added (the meter's "with imports" figure).
    from phalanx.cluster import resolve_cluster
    from phalanx.memory import PeakMeter

    torch.set_num_threads(1)
    job = JOBS[name]
    workers = resolve_cluster().num_workers
    from_imports = PeakMeter()
    cls = job.strategy_class() if job.strategy_class is not None else None
    for module in SCRIPT_IMPORTS if cls is not None else RAW_IMPORTS:
        importlib.import_module(module)
    imports = from_imports.now()
    meter = PeakMeter(reset=False)
    marks: dict[str, int] = {}
    marks["imports"] = imports
    strategy = cls(**job.kwargs(workers)) if cls is not None else None
    seconds = (
        _phalanx_job(strategy, cfg, marks, meter)
        if strategy is not None
        else _raw_job(cfg, marks, meter, job.mesh(workers) if job.mesh is not None else None)
    )
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"marks": marks, "seconds": seconds, "reset_ok": from_imports.reset_ok})
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(every, f)
    if strategy is not None:
        strategy.close()
    else:
        dist.destroy_process_group()
        # raw torch has no RecentWorks: a gloo thread may drop the last reference to a tensor
        # parallelism collective's work while the interpreter finalizes, which aborts the
        # process ("terminate called without an active exception"); everything is written
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _estimate(name: str, cfg: dict, workers: int) -> Any:
    from phalanx.experimental import estimate_memory

    job = JOBS[name]
    return estimate_memory(
        mlp(cfg["width"], cfg["layers"], "meta"),
        torch.optim.Adam,
        strategy=job.kind,
        num_workers=workers,
        mesh_shape=job.mesh(workers) if job.mesh is not None else None,
        sample_input=(cfg["width"],),
        per_worker_batch=GLOBAL_BATCH // _replicas(job, workers),
        built_whole=not cfg.get("meta", False),
        raw_torch=job.strategy_class is None,  # torch's gloo groups, FSDP2 and glibc as they are
    )


def run_job(name: str, cfg: dict, workers: int, malloc: str) -> dict:
    """Launches one job on ``workers`` local processes; returns its figures and the estimate."""
    from phalanx.cluster import launch

    env = dict(TUNED_MALLOC) if malloc == "tuned" else {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        args = ["--job", name, "--config", json.dumps(cfg), "--result", path]
        status = launch(os.path.abspath(__file__), workers=workers, args=args, env=env, timeout=1800)
        if status != 0:
            return {"job": name, "workers": workers, "malloc": malloc, "failed": status}
        with open(path) as f:
            every = json.load(f)
    peak = max(w["marks"]["save"] for w in every)
    seconds = max(w["seconds"] for w in every)
    estimate = _estimate(name, cfg, workers)
    return {
        "job": name,
        "workers": workers,
        "malloc": malloc,
        "width": cfg["width"],
        "peak_mib": peak / 2**20,
        "with_imports_mib": max(w["marks"]["save"] + w["marks"]["imports"] for w in every) / 2**20,
        "by_worker_mib": [w["marks"]["save"] / 2**20 for w in every],
        "marks_mib": {k: max(w["marks"][k] for w in every) / 2**20 for k in every[0]["marks"]},
        "estimate_mib": estimate.peak / 2**20,
        "estimate": estimate.breakdown_mib(),
        "examples_per_s": GLOBAL_BATCH * (cfg["steps"] - 1) / seconds,
        "vmhwm_reset": all(w["reset_ok"] for w in every),
    }


def _print_rows(rows: list[dict]) -> None:
    """The table: peak per worker, the estimate beside it, memory against MultiWorkerMirrored's
    and examples per second against raw FSDP2's (same workers, malloc and width)."""
    print(
        f"{'job':<22}{'workers':>8}{'malloc':>9}{'width':>7}{'peak MiB':>10}{'estimate':>10}"
        f"{'est/meas':>9}{'vs mwms':>9}{'+imports':>10}{'vs mwms':>9}{'ex/s':>8}{'vs raw':>8}"
    )
    done = [r for r in rows if "failed" not in r]

    def same(job: str, r: dict) -> dict | None:
        key = (r["workers"], r["malloc"], r["width"])
        return next(
            (o for o in done if o["job"] == job and (o["workers"], o["malloc"], o["width"]) == key), None
        )

    for r in rows:
        if "failed" in r:
            print(f"{r['job']:<22}{r['workers']:>8}{r['malloc']:>9}  failed ({r['failed']})")
            continue
        mwms, raw = same("multi_worker_mirrored", r), same("raw_fsdp2", r)
        memory = f"{r['peak_mib'] / mwms['peak_mib']:9.2f}" if mwms else f"{'':>9}"
        with_imports = f"{r['with_imports_mib']:10.1f}" + (
            f"{r['with_imports_mib'] / mwms['with_imports_mib']:9.2f}" if mwms else f"{'':>9}"
        )
        speed = f"{r['examples_per_s'] / raw['examples_per_s']:8.2f}" if raw else f"{'':>8}"
        print(
            f"{r['job']:<22}{r['workers']:>8}{r['malloc']:>9}{r['width']:>7}{r['peak_mib']:10.1f}"
            f"{r['estimate_mib']:10.1f}{r['estimate_mib'] / r['peak_mib']:9.3f}{memory}{with_imports}"
            f"{r['examples_per_s']:8.0f}{speed}"
            + (f"  (cap {r['cap_mib']:.0f} MiB)" if "cap_mib" in r else "")
        )


def largest_width(job: str, cap_bytes: int, workers: int, layers: int) -> int:
    """The widest MLP (a multiple of 64) whose estimated peak per worker fits ``cap_bytes``."""
    low = 64
    while _estimate(job, {"width": low * 2, "layers": layers}, workers).peak <= cap_bytes:
        low *= 2
    high = low * 2
    while high - low > 64:
        mid = (low + high) // 2 // 64 * 64
        fits = _estimate(job, {"width": mid, "layers": layers}, workers).peak <= cap_bytes
        low, high = (mid, high) if fits else (low, mid)
    return low


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--meta", action="store_true", help="build the model on the meta device")
    parser.add_argument("--malloc", nargs="*", default=["default"], choices=["default", "tuned"])
    parser.add_argument("--jobs", nargs="*", default=list(JOBS), choices=list(JOBS))
    parser.add_argument(
        "--cap-mb", type=float, default=0, help="per-worker cap for the largest model (0: skip)"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        _job(args.job, json.loads(args.config), args.result)
        return 0
    cfg = {"width": args.width, "layers": args.layers, "steps": args.steps, "meta": args.meta}
    rows = [
        run_job(name, cfg, workers, malloc)
        for malloc in args.malloc
        for workers in args.workers
        for name in args.jobs
        if _runs(name, workers)
    ]
    if args.cap_mb:
        cap = int(args.cap_mb * 2**20)
        for workers in args.workers:
            for name in (n for n in args.jobs if _runs(n, workers)):
                width = largest_width(name, cap, workers, args.layers)
                row = run_job(name, {**cfg, "width": width}, workers, args.malloc[0])
                row["cap_mib"] = args.cap_mb
                rows.append(row)
    _print_rows(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
