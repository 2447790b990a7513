"""What each worker of a strategy will hold at its peak, before anything is allocated.

`estimate_memory` takes a model (built on the meta device is enough: only shapes and dtypes
are read), an optimizer (its class, or an instance), a strategy kind and its size, and gives
each worker's peak resident memory growth from the strategy's creation, broken down by what
holds it; `plan_memory` does it for every kind and says which fit a per-worker budget. Called
on any one process (nothing communicates).

The rule (docs/big_models.md, "Memory per worker"), with ``P`` the model's parameter bytes,
``W`` the workers and ``U`` the bytes of the largest FSDP2 unit (a module's own parameters):

* ``multi_worker_mirrored``: every worker holds ``P`` parameters, ``P`` gradients (in their
  all-reduce buckets), the optimizer state (Adam: ``2P``), the optimizer step's temporaries
  (Adam's ``foreach`` kernels: ``P``) and the gradient engine's staged buckets (``0.6P`` at
  the peak: fitted, `REDUCTION_SHARE`).
* ``fully_sharded``: each worker holds ``1/W`` of the parameters, gradients, optimizer state
  and step temporaries, or, where the backward's peak is higher, the units gathered then
  (``3.5U`` in place of the gradients and the step's temporaries, fitted, `GATHERED_UNITS`:
  the unit computed, its unsharded gradients, part of the time the reduce-scatter's input,
  and the gradient shards reduced so far). Mixed precision gathers parameters in
  ``param_dtype``.
* ``model_parallel`` (mesh ``(batch, model)``): as ``fully_sharded`` over ``batch x model``
  workers for the state, with units gathered only along the batch axis (``3.5U / model``,
  none when ``batch`` is 1), and what the batch axis's subgroups hold of their newest works
  (`SUBGROUP_WORKS_UNITS`); the rule assumes the layout splits every large weight along the
  model axis, and counts the activations unsplit (an upper bound: tensor parallelism splits
  some). ``raw_torch=True``: torch's own ``parallelize_module`` and ``fully_shard`` (torch's
  gloo groups, glibc's defaults).
* every kind: the runtime (`BASE_RUNTIME_BYTES`: threads, the pages of kernels run for the
  first time, the step's Python objects, and torch._dynamo, which making the first torch
  optimizer imports; and phalanx's same-host transport maps shared-memory segments once
  ``W > 1``, `_transport_bytes`) and the activations the forward keeps for backward
  (measured by running the forward on the meta device with
  `torch.autograd.graph.saved_tensors_hooks`, plus the largest of them again for backward's
  transient gradient).

The constants were fitted to `benchmarks/bench_memory.py`'s measurements (CPU, glibc's default
malloc settings, FullySharded with its default ``release_memory``, MLPs of 66k to 17M
parameters; every row of its table at 2 and 4 workers within 10 %): a model of phalanx's
engines as they are; a change to them (bucket sizes, retained works, the transport's
segments) changes the figures, and the benchmark shows by how much (its estimate/measured
column).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from phalanx import _hooks

__all__ = [
    "STRATEGY_KINDS",
    "MemoryEstimate",
    "MemoryPlan",
    "activation_bytes",
    "estimate_memory",
    "optimizer_factors",
    "plan_memory",
]

STRATEGY_KINDS = ("multi_worker_mirrored", "fully_sharded", "model_parallel")
MiB = 1 << 20
# what a worker adds from the strategy's creation whatever the model: threads, the pages of
# torch's kernels run for the first time, the step's Python objects (measured with the
# benchmark's MLP, less its tensors and segments: 19-22 MiB per worker), and the modules the
# training imports after a script's imports of torch, phalanx and phalanx.experimental:
# making the first torch optimizer imports torch._dynamo (`TRAINING_IMPORTS_BYTES`, whatever
# the strategy, on one device too)
TRAINING_IMPORTS_BYTES = 26 * MiB
BASE_RUNTIME_BYTES = 20 * MiB + TRAINING_IMPORTS_BYTES
# FSDP2 at the peak of backward: the unit computed, its unsharded gradients (for a moment with
# the reduce-scatter's input they are copied into), the next unit where FSDP2 prefetches it
# (not on CPUs under FullySharded), and the gradient shards reduced so far; counted in place of
# the gradients and the step's temporaries, which the backward peak exceeds only when units
# are large against a worker's share (fitted)
GATHERED_UNITS = 3.5
# release_memory=False: FSDP2 keeps each unit's reduce-scatter input through the next unit's
# backward, and glibc's heap keeps the gathered units it served (fitted to the benchmark's
# raw FSDP2 on gloo, 6 Adam steps, three runs at 2 and 4 workers: 27-34 units, from run to
# run; it grows with the steps)
KEPT_INPUT_UNITS = 1
RETAINED_HEAP_UNITS = 30
# MultiWorkerMirrored's gradient engine: buckets staged for their all-reduce at the peak (fitted)
REDUCTION_SHARE = 0.6
# model_parallel with a batch axis of more than one worker: its mesh's subgroups carry FSDP2's
# collectives over gloo, and each subgroup holds its 2 newest works
# (`phalanx.communication.group.recent_works.SUBGROUP_KEEP_WORKS_COUNT`): an all-gather's work
# keeps what it gathered (a unit) and, in backward, FSDP2's all-gather buffer (its input is a
# view of it; forward frees that buffer, `phalanx.strategies.sharding.all_gather`). Fitted to
# the benchmark's (2, 2) mesh at widths 2048 and 3584, in units of the batch axis's unit
SUBGROUP_WORKS_UNITS = 2.5
# raw tensor parallelism (``raw_torch``, no FSDP2) under glibc's defaults: the heap keeps the
# last step's gradients and Adam's step temporaries (fitted to the benchmark's 1-D rows at 2
# and 4 workers, in parameter shares ``P / W``)
RAW_TP_HEAP_SHARES = 2
# phalanx's same-host transport: an all-reduce's slots hold 4 MiB of float32 each
# (transports/shm/shared_memory.py: 2 buffer sets x W slots); broadcasts, all-gathers and
# reduce-scatters share one 8 MiB set between the workers
SHM_SLOT_BYTES = 4 * MiB
SHM_SET_BYTES = 8 * MiB
_PARTS = (
    "runtime",
    "parameters",
    "gradients",
    "optimizer_state",
    "optimizer_step",
    "reduction",
    "gathered_units",
    "activations",
    "allocator",
    "whole_model",
)

# optimizer class name -> (state tensors per parameter, temporaries of the step per parameter)
_OPTIMIZERS: dict[str, tuple[float, float]] = {
    "Adam": (2, 1),
    "AdamW": (2, 1),
    "NAdam": (2, 1),
    "RAdam": (2, 1),
    "Adamax": (2, 1),
    "Adagrad": (1, 1),
    "Adadelta": (2, 1),
    "RMSprop": (1, 1),
    "SGD": (0, 0),
}


def optimizer_factors(optimizer: Any) -> tuple[float, float]:
    """(optimizer state, step temporaries) in parameter-sized tensors, for a torch optimizer
    class or instance: Adam keeps two moments (2) and its step makes one parameter-sized
    temporary (1); SGD keeps a momentum buffer only with ``momentum`` (1, else 0); RMSprop adds
    one with ``momentum`` and one when ``centered``.

    Raises:
        ValueError: An optimizer this rule does not know (it names the ones it knows).
    """
    cls = optimizer if isinstance(optimizer, type) else type(optimizer)
    defaults: Mapping[str, Any] = (
        getattr(optimizer, "defaults", {}) if not isinstance(optimizer, type) else {}
    )
    known = next((c.__name__ for c in cls.__mro__ if c.__name__ in _OPTIMIZERS), None)
    if known is None:
        raise ValueError(
            "estimate_memory knows the state of torch's optimizers "
            f"({', '.join(sorted(_OPTIMIZERS))}). Received: {cls.__name__}. HINT: pass "
            "optimizer=(state, step) in parameter-sized tensors, e.g. (2, 1) for an Adam-like one."
        )
    state, step = _OPTIMIZERS[known]
    if known == "SGD" and defaults.get("momentum", 0):
        state = 1
    if known == "RMSprop":
        state += int(bool(defaults.get("momentum", 0))) + int(bool(defaults.get("centered", False)))
    return float(state), float(step)


def _meta_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: torch.empty_like(p, device="meta").requires_grad_(p.requires_grad)
        for name, p in model.named_parameters()
    }


def activation_bytes(model: nn.Module, sample_input: Any, dtype: torch.dtype | None = None) -> int:
    """Bytes the forward of ``model`` on ``sample_input`` keeps for backward, plus the largest
    kept tensor once more (backward's gradient of it). The forward runs on the meta device:
    nothing is computed or allocated, and the model's own parameters are not touched.

    Args:
        model: Any module (on the meta device or not).
        sample_input: One worker's input: a tensor, a shape (a tuple of ints: a float32
            tensor), or a tuple of those (the forward's positional arguments).
        dtype: The compute dtype under mixed precision (floating tensors are counted at its
            size); None counts them as they are.
    """
    from torch.func import functional_call

    args = (
        sample_input if isinstance(sample_input, tuple) and not _is_shape(sample_input) else (sample_input,)
    )
    meta_args = tuple(_meta_input(a) for a in args)
    params = _meta_parameters(model)
    skip = {_hooks.storage_key(p) for p in params.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _hooks.storage_key(t)
        if key not in skip:
            size = t.untyped_storage().nbytes()
            if dtype is not None and t.is_floating_point():
                size = size // t.element_size() * torch.empty((), dtype=dtype).element_size()
            saved[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        functional_call(model, params, meta_args)
    return sum(saved.values()) + max(saved.values(), default=0)


def _is_shape(value: Any) -> bool:
    return isinstance(value, tuple | torch.Size) and all(isinstance(d, int) for d in value)


def _meta_input(value: Any) -> Any:
    if _is_shape(value):
        return torch.empty(tuple(value), device="meta")
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    return value


def _unit_bytes(model: nn.Module, dtype: torch.dtype | None) -> int:
    """The largest FSDP2 unit: a module's own parameters (FullyShardedStrategy's units)."""
    largest = 0
    for module in model.modules():
        own = 0
        for p in module.parameters(recurse=False):
            size = p.element_size() if dtype is None or not p.is_floating_point() else _itemsize(dtype)
            own += p.numel() * size
        largest = max(largest, own)
    return largest


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """One worker's estimated peak resident memory growth under one strategy (bytes by part).

    Attributes:
        strategy: The strategy kind (one of `STRATEGY_KINDS`).
        num_workers: Workers in the job.
        parts: Bytes by what holds them: runtime, parameters, gradients, optimizer_state,
            optimizer_step (the step's temporaries), reduction (staged gradients),
            gathered_units (FSDP2's gathered layers), activations.
    """

    strategy: str
    num_workers: int
    parts: Mapping[str, int]

    @property
    def peak(self) -> int:
        """The worker's estimated peak, in bytes: the sum of the parts."""
        return sum(self.parts.values())

    def fits(self, budget_bytes: float) -> bool:
        """Whether the peak is within ``budget_bytes`` per worker."""
        return self.peak <= budget_bytes

    def breakdown_mib(self) -> dict[str, float]:
        """The parts in MiB (rounded to 0.1), the peak as ``"peak"``."""
        return {**{k: round(v / MiB, 1) for k, v in self.parts.items()}, "peak": round(self.peak / MiB, 1)}

    def __str__(self) -> str:
        rows = [f"{self.strategy} ({self.num_workers} workers): peak {self.peak / MiB:.1f} MiB per worker"]
        rows += [f"  {name:<16}{size / MiB:10.1f} MiB" for name, size in self.parts.items() if size]
        return "\n".join(rows)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Estimates for several strategies and which fit a per-worker budget.

    Attributes:
        estimates: One `MemoryEstimate` per strategy kind.
        budget_bytes: The per-worker budget (None: none given).
    """

    estimates: Mapping[str, MemoryEstimate]
    budget_bytes: float | None = None

    @property
    def fitting(self) -> list[str]:
        """The kinds whose peak fits the budget (every kind when there is none)."""
        budget = self.budget_bytes
        return [kind for kind, e in self.estimates.items() if budget is None or e.fits(budget)]

    def __str__(self) -> str:
        text = "\n".join(str(e) for e in self.estimates.values())
        if self.budget_bytes is not None:
            fits = ", ".join(self.fitting) or "none"
            text += f"\nfits {self.budget_bytes / MiB:.0f} MiB per worker: {fits}"
        return text


def _mixed_dtype(mixed_precision: Any) -> tuple[torch.dtype | None, torch.dtype | None]:
    """(param_dtype, reduce_dtype) from None, a dtype, its name or FSDP2's MixedPrecisionPolicy."""
    if mixed_precision is None:
        return None, None
    if isinstance(mixed_precision, str):
        dtype = getattr(torch, mixed_precision.removeprefix("mixed_"), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                "mixed_precision names a floating dtype ('bfloat16', 'float16', 'mixed_bfloat16'). "
                f"Received: {mixed_precision!r}. HINT: or pass a torch.dtype or a MixedPrecisionPolicy."
            )
        return dtype, dtype
    if isinstance(mixed_precision, torch.dtype):
        return mixed_precision, mixed_precision
    param = getattr(mixed_precision, "param_dtype", None)
    return param, getattr(mixed_precision, "reduce_dtype", None) or param


def _shares(strategy: str, num_workers: int | None, mesh_shape: Sequence[int] | None) -> tuple[int, int, int]:
    """(workers, state share divisor, gather divisor) for a kind and its size; the divisor is 0
    where nothing is gathered (replicas, or tensor parallelism alone)."""
    if strategy not in STRATEGY_KINDS:
        raise ValueError(f"strategy must be one of {STRATEGY_KINDS}. Received: {strategy!r}.")
    if strategy == "model_parallel":
        if mesh_shape is None or len(mesh_shape) not in (1, 2) or any(int(d) < 1 for d in mesh_shape):
            raise ValueError(
                "model_parallel needs mesh_shape=(model,) or (batch, model), positive sizes. "
                f"Received: mesh_shape={mesh_shape!r}. HINT: e.g. mesh_shape=(2, 2) for 4 workers."
            )
        batch, model = (
            (1, int(mesh_shape[0])) if len(mesh_shape) == 1 else (int(mesh_shape[0]), int(mesh_shape[1]))
        )
        workers = batch * model
        if num_workers is not None and num_workers != workers:
            raise ValueError(
                f"mesh_shape {tuple(mesh_shape)} has {workers} workers, but num_workers={num_workers}. "
                "HINT: give the mesh only, or a mesh whose sizes multiply to num_workers."
            )
        return workers, workers, model if batch > 1 else 0
    if num_workers is None or num_workers < 1:
        raise ValueError(f"{strategy} needs num_workers >= 1. Received: num_workers={num_workers!r}.")
    if strategy == "fully_sharded":
        return num_workers, num_workers, 1 if num_workers > 1 else 0
    return num_workers, 1, 0


def estimate_memory(
    model: nn.Module,
    optimizer: Any = torch.optim.Adam,
    *,
    strategy: str = "fully_sharded",
    num_workers: int | None = None,
    mesh_shape: Sequence[int] | None = None,
    sample_input: Any = None,
    per_worker_batch: int | None = None,
    mixed_precision: Any = None,
    runtime_bytes: int | None = None,
    built_whole: bool = False,
    release_memory: bool = True,
    raw_torch: bool = False,
) -> MemoryEstimate:
    """One worker's peak resident memory growth under ``strategy``, broken down (any process).

    Args:
        model: The model; built on the meta device is enough.
        optimizer: A torch optimizer class or instance, or ``(state, step)`` in
            parameter-sized tensors (see `optimizer_factors`); None: no optimizer.
        strategy: ``"multi_worker_mirrored"``, ``"fully_sharded"`` or ``"model_parallel"``.
        num_workers: Workers in the job (``model_parallel``: implied by ``mesh_shape``).
        mesh_shape: ``model_parallel`` only: ``(model,)`` or ``(batch, model)``.
        sample_input: One worker's batch: a tensor (meta is enough), a shape, or a tuple of
            them (the forward's arguments); None counts no activations.
        per_worker_batch: With it, ``sample_input`` is one example (no batch dimension) and
            each input gets this batch dimension in front; None: ``sample_input`` is the batch.
        mixed_precision: None, a dtype (or its name, ``"bfloat16"``), or FSDP2's
            ``MixedPrecisionPolicy``: parameters are gathered and activations kept in it.
        runtime_bytes: What the strategy holds before any model (default: phalanx's
            transport and threads, see the module docstring).
        built_whole: ``fully_sharded``/``model_parallel``: the model is made whole on every
            worker's device in the scope (not on the meta device), and sharded at the first
            run: the worker then holds it whole plus its shards for a moment (``whole_model``:
            what that adds above the training peak). MultiWorkerMirrored always holds it whole.
        release_memory: False: FSDP2 and glibc as they are (raw FSDP2, or
            ``FullyShardedStrategy(release_memory=False)``): the kept reduce-scatter input
            and what glibc's heap keeps of the gathered units (``allocator``, fitted to the
            benchmark's 6 steps).
        raw_torch: The same parallelism written with torch alone (``fully_shard``,
            ``parallelize_module``, torch's gloo groups; `benchmarks/bench_memory.py`'s raw
            rows): no phalanx transport segment or subgroup works, and FSDP2 and glibc as
            they are (``release_memory=False`` is implied).

    Returns:
        The `MemoryEstimate` (its ``peak`` and ``parts``).

    Raises:
        ValueError: An unknown strategy or optimizer, a missing or contradicting size, or a
            bad ``mixed_precision`` (each says what to pass).
    """
    workers, share, gather_split = _shares(strategy, num_workers, mesh_shape)
    param_dtype, _ = _mixed_dtype(mixed_precision)
    if optimizer is None:
        state, step = 0.0, 0.0
    else:
        state, step = optimizer if isinstance(optimizer, tuple) else optimizer_factors(optimizer)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    whole_unit = _unit_bytes(model, param_dtype)
    unit = whole_unit // gather_split if gather_split else 0
    release_memory = release_memory and not raw_torch
    if runtime_bytes is None:
        transport = 0 if raw_torch else _transport_bytes(strategy, workers, trained, unit)
        runtime_bytes = BASE_RUNTIME_BYTES + transport
    sharded = strategy != "multi_worker_mirrored"
    parts = {
        "runtime": runtime_bytes,
        "parameters": params // share,
        "gradients": trained // share,
        "optimizer_state": int(state * trained) // share,
        "optimizer_step": int(step * trained) // share,
        "reduction": 0 if sharded or workers == 1 else int(REDUCTION_SHARE * trained),
        "activations": _activations(model, sample_input, per_worker_batch, param_dtype),
    }
    units = GATHERED_UNITS + (0 if release_memory else KEPT_INPUT_UNITS)
    parts["gathered_units"] = max(0, int(units * unit) - parts["gradients"] - parts["optimizer_step"])
    parts["allocator"] = 0 if release_memory or not unit else int(RETAINED_HEAP_UNITS * unit)
    if strategy == "model_parallel" and gather_split and not raw_torch:
        parts["allocator"] += int(SUBGROUP_WORKS_UNITS * unit)
    if strategy == "model_parallel" and not gather_split and not release_memory and workers > 1:
        parts["allocator"] += int(RAW_TP_HEAP_SHARES * trained) // share
    training = sum(v for k, v in parts.items() if k != "runtime")
    # sharding a model made whole: all of it, this worker's shards, and one unit in transit
    building = params + params // share + whole_unit if sharded and built_whole else 0
    parts["whole_model"] = max(0, building - training)
    return MemoryEstimate(strategy, workers, {name: int(parts[name]) for name in _PARTS})


def _transport_bytes(strategy: str, workers: int, trained: int, unit: int) -> int:
    """The shared-memory segments a worker maps and reads (phalanx's same-host transport; none
    for one worker): MultiWorkerMirrored's all-reduces fill every slot of 2 sets of ``W`` up to
    4 MiB slots, its broadcasts (initial values) the chief's slot of the sets broadcasts,
    all-gathers and reduce-scatters share; FSDP2's per-unit collectives fill those sets; a
    model_parallel job broadcasts whole units from the chief (its axes' subgroups: gloo)."""
    if workers < 2:
        return 0
    part = _power_of_two(max(1024, SHM_SET_BYTES // 4 // workers), down=True) * 4  # float32 slot
    if strategy == "fully_sharded":
        return 2 * workers * min(part, _power_of_two(max(1, unit // 4 // workers)) * 4)
    broadcasts = 2 * part
    if strategy == "model_parallel":
        return broadcasts
    bucket = min(trained, 25 * MiB) // 4  # the gradient engine's buckets, float32
    slot = min(SHM_SLOT_BYTES, _power_of_two(max(1024, bucket)) * 4)
    return 2 * workers * slot + (broadcasts if part != slot else 0)  # same size: one segment


def _power_of_two(n: int, down: bool = False) -> int:
    """The power of two at or above ``n`` (``down``: at or below)."""
    return 1 << (n.bit_length() - 1) if down else 1 << (n - 1).bit_length()


def _activations(model: nn.Module, sample: Any, batch: int | None, dtype: torch.dtype | None) -> int:
    if sample is None:
        return 0
    if batch is not None:
        args = sample if isinstance(sample, tuple) and not _is_shape(sample) else (sample,)
        shapes = [
            tuple(a) if _is_shape(a) else tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args
        ]
        sample = tuple((batch, *s) if isinstance(s, tuple) else s for s in shapes)
        sample = sample if len(sample) > 1 else sample[0]
    return activation_bytes(model, sample, dtype)


def plan_memory(
    model: nn.Module,
    optimizer: Any = torch.optim.Adam,
    *,
    num_workers: int,
    budget_bytes: float | None = None,
    mesh_shape: Sequence[int] | None = None,
    **kwargs: Any,
) -> MemoryPlan:
    """`estimate_memory` for every strategy kind on ``num_workers`` workers, and which fit
    ``budget_bytes`` per worker (``model_parallel`` with ``mesh_shape``, default
    ``(1, num_workers)``: the model split over every worker). Any process; nothing communicates.

    Raises:
        ValueError: As `estimate_memory`.
    """
    estimate: Callable[..., MemoryEstimate] = estimate_memory
    mesh = tuple(mesh_shape) if mesh_shape is not None else (1, num_workers)
    estimates = {
        kind: estimate(
            model,
            optimizer,
            strategy=kind,
            num_workers=num_workers,
            mesh_shape=mesh if kind == "model_parallel" else None,
            **kwargs,
        )
        for kind in STRATEGY_KINDS
    }
    return MemoryPlan(estimates, budget_bytes)
