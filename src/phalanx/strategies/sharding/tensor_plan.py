"""Which torch tensor-parallel style each layer of a model gets, from a `LayoutMap`.

`ModelParallelStrategy` reads a model's layouts here (Keras 3 lays out any variable; torch's
tensor parallelism is per layer): an ``nn.Linear`` whose ``weight`` is split on dimension 0
(output features) is torch's ``ColwiseParallel``, on dimension 1 (input features)
``RowwiseParallel``; an ``nn.Embedding`` split on dimension 0 (rows) is ``RowwiseParallel``,
on dimension 1 ``ColwiseParallel``. A bias follows its weight (a column split's bias is split
with it, a row split's is replicated); a layout given for it must say the same.

Between layers, torchtitan's pairing (wq/wk/wv then wo; w1/w3 then w2): a column-split
Linear hands a row-split Linear of the same block its local part of the features, with no
communication in between; the row-split one sums the partial results (one all-reduce). The
same block means the same parent module; in an ``nn.Sequential`` a column split pairs with
the next split Linear when that one is row-split. A column split with no partner gathers its
output (every worker then holds the whole of it); a row split with no partner takes the whole
input and keeps its part. Code between two paired layers sees local features: a reshape into
heads must leave the head count to torch (``view(batch, seq, -1, head_dim)``), as torchtitan
writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from phalanx.distribution.layouts import LayoutMap, TensorLayout

__all__ = ["LayerSplit", "layouts_of", "plan_layers"]


@dataclass(frozen=True)
class LayerSplit:
    """One layer's split: ``"colwise"`` or ``"rowwise"`` in torch's sense, for its kind."""

    module: nn.Module
    name: str  # the layer's name in the model, for messages
    style: str


def layouts_of(
    root: nn.Module, layout_map: LayoutMap, batch_axis: str
) -> dict[str, tuple[nn.Parameter, TensorLayout]]:
    """Every parameter of ``root`` that a key matches, by name, with its layout, checked
    against the mesh (replicated layouts too: a bias's must agree with its weight's).

    Raises:
        ValueError: Two keys match one name, a layout has not one entry per dimension, names
            the batch axis, or splits a dimension its axis does not divide.
    """
    mesh = layout_map.device_mesh
    found: dict[str, tuple[nn.Parameter, TensorLayout]] = {}
    for name, param in root.named_parameters(remove_duplicate=False):
        layout = layout_map.get(name)
        if layout is None:
            continue
        if len(layout.axes) != param.dim():
            raise ValueError(
                f"The layout of {name!r} has {len(layout.axes)} entries; the parameter has "
                f"{param.dim()} dimensions {tuple(param.shape)}. Received: {layout.axes}. HINT: one "
                "entry per dimension, in torch's order (nn.Linear.weight is out_features x in_features)."
            )
        if batch_axis in layout.axes:
            raise ValueError(
                f"The layout of {name!r} splits it along the batch axis {batch_axis!r}. Received: "
                f"{layout.axes}. HINT: name only the model axis in layouts; ModelParallelStrategy "
                "already shards every weight along the batch axis with FSDP2."
            )
        for dim, axis in enumerate(layout.axes):
            if axis is not None and param.shape[dim] % mesh.axis_size(axis):
                raise ValueError(
                    f"Dimension {dim} of {name!r} ({param.shape[dim]}) is not divisible by the "
                    f"{mesh.axis_size(axis)} workers of mesh axis {axis!r}. Received: layout "
                    f"{layout.axes} for shape {tuple(param.shape)}. HINT: pick sizes the axis divides, "
                    "or leave that dimension unsplit (None)."
                )
        found[name] = (param, layout)
    return found


def _owner(root: nn.Module, name: str) -> tuple[str, nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return path, root.get_submodule(path), leaf


def _style_of(name: str, module: nn.Module, leaf: str, layout: TensorLayout) -> str:
    split = [d for d, a in enumerate(layout.axes) if a is not None]
    if isinstance(module, nn.Linear | nn.Embedding) and leaf == "weight" and len(split) == 1:
        row_split = split[0] == 0
        if isinstance(module, nn.Linear):
            return "colwise" if row_split else "rowwise"
        return "rowwise" if row_split else "colwise"
    raise ValueError(
        f"ModelParallelStrategy splits the weights of nn.Linear and nn.Embedding along one "
        f"dimension (torch's tensor parallelism). Received: layout {layout.axes} for {name!r} "
        f"({type(module).__name__}.{leaf}). HINT: split an nn.Linear or nn.Embedding weight on "
        "dimension 0 or 1 (its bias follows it), and leave other parameters replicated (None)."
    )


def _check_bias(path: str, module: nn.Module, style: str, layouts: Mapping[str, TensorLayout]) -> None:
    name = f"{path}.bias" if path else "bias"
    layout = layouts.get(name)
    if layout is None or not isinstance(module, nn.Linear):
        return
    weight = layouts[f"{path}.weight" if path else "weight"]
    expected = (weight.axes[0],) if style == "colwise" else (None,)
    if layout.axes != expected:
        raise ValueError(
            f"The bias of {path or 'the model'} must follow its weight's {style} split: {expected}. "
            f"Received: {layout.axes}. HINT: give the bias layout {expected}, or no layout."
        )


def plan_layers(root: nn.Module, split: Mapping[str, tuple[nn.Parameter, TensorLayout]]) -> list[LayerSplit]:
    """The split layers of ``root``, from the layouts of its parameters (`layouts_of`).

    Raises:
        ValueError: A split parameter is not an nn.Linear's or nn.Embedding's weight (or its
            bias, with its weight's split), or splits more than one dimension.
    """
    layouts = {name: layout for name, (_, layout) in split.items()}
    layers: dict[int, LayerSplit] = {}
    for name, (_, layout) in split.items():
        if layout.is_replicated:
            continue
        path, module, leaf = _owner(root, name)
        if isinstance(module, nn.Linear) and leaf == "bias":
            weight = layouts.get(f"{path}.weight" if path else "weight")
            if weight is None or weight.is_replicated:
                raise ValueError(
                    f"{name!r} is split but its weight is not. Received: layout {layout.axes}. HINT: "
                    "split the weight (the bias follows it), or leave the bias replicated."
                )
            continue
        style = _style_of(name, module, leaf, layout)
        _check_bias(path, module, style, layouts)
        layers[id(module)] = LayerSplit(module, path, style)
    return list(layers.values())


def _partners(root: nn.Module, layers: list[LayerSplit]) -> set[int]:
    """The ids of the split Linears that pass local features to (or take them from) a partner."""
    by_id = {id(s.module): s for s in layers if isinstance(s.module, nn.Linear)}
    paired: set[int] = set()
    for parent in root.modules():
        children = [by_id[id(c)] for c in parent.children() if id(c) in by_id]
        if isinstance(parent, nn.Sequential):
            for a, b in zip(children, children[1:], strict=False):
                if (a.style, b.style) == ("colwise", "rowwise"):
                    paired.update((id(a.module), id(b.module)))
            continue
        styles = {c.style for c in children}
        if styles == {"colwise", "rowwise"}:
            paired.update(id(c.module) for c in children)
    return paired


def check_loss_parallel(root: nn.Module, layers: list[LayerSplit], name: str) -> None:
    """Checks that layer ``name`` can keep its output split for torch's loss parallel: an
    ``nn.Linear`` split by columns, with no row-split partner.

    Raises:
        ValueError: It is not such a layer (what it is instead is named).
    """
    layer = next((s for s in layers if s.name == name), None)
    partnered = layer is not None and id(layer.module) in _partners(root, layers)
    if (
        layer is not None
        and isinstance(layer.module, nn.Linear)
        and layer.style == "colwise"
        and not partnered
    ):
        return
    found = dict(root.named_modules()).get(name)
    if found is None:
        what = "no such module"
    elif layer is None:
        what = f"{type(found).__name__}, not split"
    elif layer.style != "colwise":
        what = f"{type(found).__name__}, {layer.style} split"
    else:
        what = f"{type(found).__name__}, split by columns and paired with a row split"
    raise ValueError(
        "loss_parallel names the output nn.Linear whose logits stay split over the classes: "
        f"split by columns, ('model', None), with no row-split partner. Received: {name!r} "
        f"({what}). HINT: name the output layer as model.named_modules() does and give its "
        "weight the layout ('model', None), or leave loss_parallel unset."
    )


def parallel_styles(
    root: nn.Module, layers: list[LayerSplit], loss_parallel: str | None = None
) -> dict[int, ParallelStyle]:
    """torch's style for each split layer (by module id), with the inputs and outputs the
    pairing gives (see the module doc); layer ``loss_parallel`` returns its logits as a
    DTensor split over the classes (for ``F.cross_entropy`` under torch's ``loss_parallel``)."""
    paired = _partners(root, layers)
    styles: dict[int, ParallelStyle] = {}
    for layer in layers:
        inner = id(layer.module) in paired
        if layer.name == loss_parallel:
            styles[id(layer.module)] = ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
            )
        elif layer.style == "colwise":
            styles[id(layer.module)] = ColwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(-1) if inner else Replicate()
            )
        else:
            styles[id(layer.module)] = RowwiseParallel(
                input_layouts=Shard(-1) if inner else Replicate(), output_layouts=Replicate()
            )
    return styles


def replicated_blocks(root: nn.Module, layers: list[LayerSplit]) -> list[nn.Module]:
    """The largest submodules of ``root`` with parameters and no split layer: their parameters
    become DTensors replicated over the model axis, and their inputs and outputs cross between
    DTensors and plain tensors at their border (torch's ``distribute_module``), so that every
    parameter is a DTensor on one mesh (clipping's norm, optimizers and checkpoints need that).

    Raises:
        ValueError: A module holds parameters of its own and split layers below it (its
            forward would mix its DTensor parameters with its layers' plain outputs).
    """
    split = {id(layer.module) for layer in layers}
    has_split = {id(m) for m in root.modules() if any(id(s) in split for s in m.modules())}
    blocks: list[nn.Module] = []

    def visit(module: nn.Module, path: str) -> None:
        if id(module) not in has_split:
            if any(True for _ in module.parameters()):
                blocks.append(module)
            return
        own = [n for n, _ in module.named_parameters(recurse=False, remove_duplicate=False)]
        if own and id(module) not in split:
            raise ValueError(
                f"{path or 'The model'} ({type(module).__name__}) holds parameters {own} of its own and "
                "split layers below it; its forward would mix its replicated parameters with its "
                "layers' outputs. HINT: move those parameters into a submodule of their own "
                "(an nn.Embedding for a position table), or leave the layers below it unsplit."
            )
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(root, "")
    return blocks
