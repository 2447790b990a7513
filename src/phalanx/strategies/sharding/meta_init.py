"""Models built on the meta device, materialised one FSDP2 unit at a time (FullyShardedStrategy).

A model whose parameters alone do not fit one worker is built as FSDP2's users build it,
``with torch.device("meta"):`` inside the strategy's scope: its parameters have shapes and no
memory. Before the first run, FullyShardedStrategy shards the model unit by unit (children
before parents, `ShardingPlan`); for each unit `MetaInit.materialize` gives the unit's meta
parameters real memory on the device, and on the chief runs the ``reset_parameters()`` of
every module that owns one of them, in post-order (a child before its parent, the order in
which modules built on a real device initialise themselves: ``nn.MultiheadAttention`` zeroes
its ``out_proj``'s bias after the ``nn.Linear`` set it). The strategy then shards the unit and
scatters the chief's values: every worker holds one unit's full parameters at a time, never
the whole model.

The resets draw from the random state the chief had when the first meta parameter was made
(and the caller's own state is left as it was), so with the same seed the chief's values are
those of the model built on a real device whenever its modules initialise in the order the
units come (post-order of the module tree: true of stacks of layers and of most models; a
module that initialises its children's parameters itself gets other values of the same
distributions).

A parameter that no reset wrote, and a buffer made on the meta device whose module has no
reset, would hold garbage: they raise, naming it.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Container, Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from phalanx import _hooks

__all__ = ["MetaInit", "post_order"]


def post_order(unit: nn.Module) -> Iterator[nn.Module]:
    """The modules of ``unit`` that it shards itself, children before parents; a nested unit
    (already sharded, an `FSDPModule`) is left out with everything under it."""
    for child in unit.children():
        if not isinstance(child, FSDPModule):
            yield from post_order(child)
    yield unit


def _reset_of(module: nn.Module) -> Callable[[], None] | None:
    """``module.reset_parameters``, or torch's private ``_reset_parameters`` where a torch
    module has only that (``nn.MultiheadAttention``)."""
    for name in ("reset_parameters", "_reset_parameters"):
        reset = getattr(module, name, None)
        if callable(reset):
            return reset  # type: ignore[no-any-return]
    return None


class MetaInit:
    """What a strategy's scope made on the meta device, and the chief's random state for it.

    Args:
        device: Where the parameters get their memory (this worker's device).
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._buffers: dict[int, tuple[weakref.ref[nn.Module], list[str]]] = {}
        self._buffer_values: list[weakref.ref[torch.Tensor]] = []  # for the chief's broadcast
        self._random: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.pending = False  # meta tensors made since the strategy last sharded

    def note_parameter(self) -> None:
        """A meta parameter was made: the first one fixes the random state of the resets."""
        self.pending = True
        if self._random is None:
            cuda = torch.cuda.get_rng_state(self._device) if self._device.type == "cuda" else None
            self._random = (torch.get_rng_state(), cuda)

    def note_buffer(self, module: nn.Module, name: str, value: torch.Tensor) -> None:
        """Records that ``module`` registered buffer ``name`` on the meta device; ``value`` is
        what it got instead (zeros on the device), which the chief's reset will fill."""
        self.note_parameter()
        self._buffer_values.append(weakref.ref(value))
        entry = self._buffers.get(id(module))
        if entry is None or entry[0]() is not module:
            entry = (weakref.ref(module), [])
            self._buffers[id(module)] = entry
        entry[1].append(name)

    def take_buffers(self) -> list[weakref.ref[torch.Tensor]]:
        """The buffers made on the meta device since the last call: after `materialize`, they
        hold the chief's values, which the strategy broadcasts."""
        taken, self._buffer_values = self._buffer_values, []
        return taken

    def _buffer_names(self, module: nn.Module) -> list[str]:
        entry = self._buffers.get(id(module))
        return entry[1] if entry is not None and entry[0]() is module else []

    def materialize(self, unit: nn.Module, on_chief: bool) -> dict[int, nn.Parameter]:
        """Gives the meta parameters of ``unit`` memory on the device; on the chief, their values.

        Every meta parameter is replaced (in every module that registered it: tied weights stay
        tied) by a full `nn.Parameter`. On the chief each module of the unit that owns one of
        them, or a meta-born buffer, runs its reset (children first); the other workers' values
        stay unset: the strategy scatters the chief's after sharding.

        Returns:
            ``{id(meta parameter): its full replacement}`` (empty if the unit had none).

        Raises:
            ValueError: A module that owns a meta-born buffer or meta parameter has no
                ``reset_parameters()`` (every worker raises), or a parameter kept its unset
                value after every reset (the chief raises; the others then name it as lost).
        """
        modules = list(post_order(unit))
        metas = {id(p): p for m in modules for p in m.parameters(recurse=False) if p.is_meta}
        owners = [m for m in modules if self._buffer_names(m)]
        if not metas and not owners:
            return {}
        made = {
            key: nn.Parameter(torch.empty_like(p, device=self._device), requires_grad=p.requires_grad)
            for key, p in metas.items()
        }
        resets: list[Callable[[], None]] = []
        for module in modules:
            stored = _hooks.own_parameters(module)  # replaced as stored: no registration hooks
            own = [n for n, p in stored.items() if p is not None and id(p) in made]
            for name in own:
                stored[name] = made[id(stored[name])]
            reset = _reset_of(module)
            if (own or self._buffer_names(module)) and reset is None:
                what = [f"parameter {n}" for n in own] + [f"buffer {n}" for n in self._buffer_names(module)]
                raise ValueError(
                    f"{type(module).__name__} made {', '.join(what)} on the meta device and has no "
                    "reset_parameters() to give them their values. HINT: define reset_parameters() "
                    "(FullyShardedStrategy runs it on the chief before the first step, a layer at a "
                    "time), or make them outside `with torch.device('meta'):`."
                )
            if reset is not None and (own or self._buffer_names(module)):
                resets.append(reset)
        for module in owners:
            del self._buffers[id(module)]
        if on_chief:
            self._reset(made, resets, unit)
        return made

    def loaded_whole(self, unit: nn.Module, loaded: Container[int]) -> bool:
        """Whether a load writes every meta tensor of ``unit`` (``loaded`` holds their ``id``s:
        its meta parameters and its meta-born buffers): it then needs memory, not values."""
        modules = list(post_order(unit))
        metas = [p for m in modules for p in m.parameters(recurse=False) if p.is_meta]
        buffers = [
            b
            for m in modules
            for n in self._buffer_names(m)
            if (b := _hooks.own_buffers(m).get(n)) is not None
        ]
        tensors = [*metas, *buffers]
        return bool(tensors) and all(id(t) in loaded for t in tensors)

    def allocate(self, unit: nn.Module) -> None:
        """Gives the meta parameters of ``unit``, sharded on the meta device (``fully_shard``
        keeps them there), this worker's shard of memory on the device, without values: the
        load that asked (`loaded_whole`) writes them. Tied parameters stay one parameter. FSDP2
        adopts the new shards at its lazy initialisation or after a ``load_state_dict``."""
        made: dict[int, nn.Parameter] = {}
        for module in post_order(unit):
            stored = _hooks.own_parameters(module)  # replaced as stored: no registration hooks
            for name, p in stored.items():
                if not isinstance(p, DTensor) or not p.is_meta:
                    continue
                new = made.get(id(p))
                if new is None:
                    local = torch.empty(p.to_local().shape, dtype=p.dtype, device=self._device)
                    shard = DTensor.from_local(
                        local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                    )
                    new = made[id(p)] = nn.Parameter(shard, requires_grad=p.requires_grad)
                stored[name] = new
            self._buffers.pop(id(module), None)  # its meta-born buffers: the load writes them too

    def _reset(
        self, made: dict[int, nn.Parameter], resets: list[Callable[[], None]], unit: nn.Module
    ) -> None:
        """Runs the resets from the noted random state (continued unit after unit); floating
        parameters are NaN before, so one that no reset wrote is found."""
        devices = [self._device] if self._device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            if self._random is not None:
                torch.set_rng_state(self._random[0])
                if self._random[1] is not None:
                    torch.cuda.set_rng_state(self._random[1], self._device)
            for p in made.values():
                if p.is_floating_point():
                    p.fill_(math.nan)
            for reset in resets:
                reset()
            cuda = torch.cuda.get_rng_state(self._device) if devices else None
            self._random = (torch.get_rng_state(), cuda)
        unset = {id(p) for p in made.values() if p.is_floating_point() and bool(p.isnan().any())}
        if unset:
            names = [n for n, p in unit.named_parameters(remove_duplicate=False) if id(p) in unset]
            raise ValueError(
                f"Parameters {names} were made on the meta device and no reset_parameters() of the "
                "modules that own them gave them values. HINT: initialise every parameter a module "
                "registers in its reset_parameters(), or make them outside `with torch.device('meta'):`."
            )
