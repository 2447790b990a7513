"""``phalanx estimate-memory``: each worker's peak memory under each strategy, from the shell.

    phalanx estimate-memory mypackage.models:build --optimizer adam --workers 4 \\
        --input-shape 2048 --per-worker-batch 16 --budget-mb 1024

The model is made by calling ``module:function`` with no arguments under
``torch.device("meta")``: nothing is allocated, whatever its size.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

__all__ = ["add_arguments", "run"]

_OPTIMIZERS = {
    "adam": "Adam",
    "adamw": "AdamW",
    "sgd": "SGD",
    "sgd-momentum": "SGD",
    "adagrad": "Adagrad",
    "rmsprop": "RMSprop",
    "none": "",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments (the caller has decided it runs: imports nothing heavy)."""
    parser.add_argument("model", help="module:function that returns the model (called on the meta device)")
    parser.add_argument(
        "--optimizer", choices=sorted(_OPTIMIZERS), default="adam", help="default: %(default)s"
    )
    parser.add_argument("--workers", type=int, required=True, help="workers in the job")
    parser.add_argument(
        "--strategy",
        choices=["multi_worker_mirrored", "fully_sharded", "model_parallel", "all"],
        default="all",
        help="one strategy kind, or all of them (default)",
    )
    parser.add_argument(
        "--mesh-shape", type=int, nargs="+", help="model_parallel: (model,) or (batch, model)"
    )
    parser.add_argument("--input-shape", type=int, nargs="+", help="one example's shape (no batch dimension)")
    parser.add_argument("--per-worker-batch", type=int, default=1, help="examples per worker (default: 1)")
    parser.add_argument("--mixed-precision", help="bfloat16 or float16: gathered parameters and activations")
    parser.add_argument("--budget-mb", type=float, help="per-worker budget in MiB: says which strategies fit")
    parser.set_defaults(func=run)


def _load_model(spec: str) -> Any:
    import torch

    module_name, sep, function = spec.partition(":")
    if not sep or not function:
        raise SystemExit(f"phalanx estimate-memory: the model is module:function. Received: {spec!r}.")
    factory = getattr(importlib.import_module(module_name), function)
    with torch.device("meta"):
        return factory()


def _optimizer(name: str) -> Any:
    import torch

    if name == "none":
        return None
    if name == "sgd-momentum":
        return (1.0, 0.0)
    return getattr(torch.optim, _OPTIMIZERS[name])


def run(args: argparse.Namespace) -> int:
    """Prints the estimate (or the plan for every strategy) and returns 0."""
    from phalanx.memory.estimate import MemoryPlan, estimate_memory, plan_memory

    model = _load_model(args.model)
    options: dict[str, Any] = {
        "sample_input": tuple(args.input_shape) if args.input_shape else None,
        "per_worker_batch": args.per_worker_batch if args.input_shape else None,
        "mixed_precision": args.mixed_precision,
    }
    budget = args.budget_mb * 2**20 if args.budget_mb is not None else None
    optimizer = _optimizer(args.optimizer)
    if args.strategy == "all":
        plan = plan_memory(
            model,
            optimizer,
            num_workers=args.workers,
            budget_bytes=budget,
            mesh_shape=args.mesh_shape,
            **options,
        )
    else:
        workers = None if args.strategy == "model_parallel" and args.mesh_shape else args.workers
        estimate = estimate_memory(
            model,
            optimizer,
            strategy=args.strategy,
            num_workers=workers,
            mesh_shape=args.mesh_shape,
            **options,
        )
        plan = MemoryPlan({args.strategy: estimate}, budget)
    print(plan)
    return 0
