"""phalanx's import layers hold: no module imports one of a higher layer,
and import circles stay few and out of the core.

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` (a
type-only import still ties the two files together for a reader and for the next change).
An import names the file it loads: ``from phalanx.nn import _module_tensors`` the module
``phalanx.nn._module_tensors``, ``from phalanx.nn import SyncBatchNorm`` the package
``phalanx.nn`` (its ``__init__.py``). docs/architecture.md, "Layers", explains each layer.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom to top. A module belongs to the layer of the longest prefix that names it; a module
# no prefix names is in the top layer.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "core: contexts, distributed variables and values, device names, the torch hooks",
        (
            "phalanx.context",
            "phalanx.variables",
            "phalanx.values",
            "phalanx.devices",
            "phalanx._hooks",
            "phalanx.protocols",
            "phalanx.state_views",  # which state dicts sharded modules give (a per-thread switch)
            "phalanx.timeline",
            "phalanx.settings",  # the one reader of PHALANX_* variables
        ),
    ),
    (
        "building blocks: layers that know about distribution, transports, input splitting",
        (
            "phalanx.nn",
            "phalanx.losses",  # Keras' losses and compute_average_loss (re-exported by phalanx.nn)
            "phalanx.mixed_precision",
            "phalanx.communication",
            "phalanx.cluster",
            "phalanx.config",  # tf.config's device lists (MirroredStrategy() reads the logical CPUs)
            "phalanx.input.input_options",
            "phalanx.input.splitting",
            "phalanx.security",  # the cluster token, its TLS certificates, secure gRPC channels
            "phalanx.status",  # the live status page: what tasks report, the page that shows it
            "phalanx.distribution",  # Keras 3's DeviceMesh, TensorLayout, LayoutMap (plain data)
            # where each worker writes (TF's distributed_file_utils)
            "phalanx.strategies.workers.distributed_files",
        ),
    ),
    (
        "strategies: every Strategy and what carries it (input, parameter-server machinery)",
        ("phalanx.strategies", "phalanx.input", "phalanx.ps", "phalanx.data"),
    ),
    ("libraries and the public surface: Keras, losses, metrics, checkpoints, TF1 APIs", ("phalanx",)),
)
CORE = LAYERS[0][1]
MAX_FILES_IN_CIRCLES = 0  # 51 at first; never raise it


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / "phalanx").rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(module: str, is_package: bool, source: str) -> Iterator[str]:
    """The phalanx modules that ``source`` (the text of ``module``) imports anywhere."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.name
                while name and name not in MODULES:
                    name = name.rpartition(".")[0]
                if name:
                    yield name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if not base.startswith("phalanx"):
                continue
            for alias in node.names:
                child = f"{base}.{alias.name}"
                if child in MODULES:
                    yield child
                elif base in MODULES:
                    yield base


def _with_packages(modules: set[str]) -> set[str]:
    """``modules`` and the packages Python runs first to import them, where those import
    anything (``phalanx`` itself imports nothing at run time, see its ``__init__``)."""
    out = set(modules)
    for module in modules:
        parent = module.rpartition(".")[0]
        while parent.count("."):
            if _IMPORTS_ANYTHING.get(parent, True):
                out.add(parent)
            parent = parent.rpartition(".")[0]
    return out


_IMPORTS_ANYTHING = {
    module: any(_imported(module, True, path.read_text()))
    for module, path in MODULES.items()
    if path.name == "__init__.py"
}


def _graph(packages: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports; with ``packages``, also the packages Python runs
    to import them (not the module's own: they are running already)."""
    graph = {}
    for module, path in MODULES.items():
        imported = set(_imported(module, path.name == "__init__.py", path.read_text()))
        if packages:
            imported = _with_packages(imported)
        graph[module] = {
            m for m in imported if m not in ("phalanx", module) and not module.startswith(m + ".")
        }
    return graph


def layer_of(module: str) -> int:
    best, level = -1, len(LAYERS) - 1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    return level


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_module_imports_a_higher_layer():
    # a package's __init__ runs first: `from phalanx.nn import _x` runs phalanx/nn/__init__.py
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in sorted(_graph(packages=True).items())
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_core_imports_neither_strategies_nor_nn():
    graph = _graph(packages=True)
    core = [m for m in graph if layer_of(m) == 0]
    assert set(core) >= {"phalanx.context", "phalanx.variables", "phalanx._hooks", "phalanx.values"}
    for module in core:
        assert not any(t.startswith(("phalanx.strategies", "phalanx.nn")) for t in graph[module]), module


def test_no_circle_runs_through_the_core_or_a_strategy():
    for circle in circles(_graph()):
        assert not [m for m in circle if layer_of(m) < 2 or m.startswith("phalanx.strategies")], circle


def _package_of(module: str) -> str:
    """The package a module belongs to: ``phalanx.X`` for a module under ``src/phalanx/X/``,
    else the top-level module itself."""
    parts = module.split(".")
    if len(parts) >= 2 and (SRC / "phalanx" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the packages its modules import (a package's own modules left out)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = _package_of(module)
        packages.setdefault(source, set())
        for target in targets:
            if _package_of(target) != source:
                packages[source].add(_package_of(target))
                packages.setdefault(_package_of(target), set())
    return packages


def test_no_circle_between_packages():
    # e.g. data -> input -> data: each package must sit above or below another, never both
    found = circles(package_graph(_graph()))
    assert not found, found


def test_the_package_walk_sees_a_circle():
    graph = {
        "phalanx.data.a": {"phalanx.input.b"},
        "phalanx.input.b": {"phalanx.data.c"},
        "phalanx.data.c": set(),
    }
    assert circles(package_graph(graph)) == [["phalanx.data", "phalanx.input"]]


def test_few_files_are_in_import_circles():
    found = circles(_graph())
    assert sum(map(len, found)) <= MAX_FILES_IN_CIRCLES, found


def test_the_walk_sees_every_kind_of_import():
    # the measure itself must not go blind: function-level, TYPE_CHECKING and relative imports
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from phalanx.nn import dropout\n"
        "def f():\n    import phalanx.strategies.strategy\n"
        "from . import devices\nfrom .values import ReduceOp\nfrom phalanx.nn import SyncBatchNorm\n"
    )
    assert set(_imported("phalanx.probe", False, source)) == {
        "phalanx.nn.dropout",
        "phalanx.strategies.strategy",
        "phalanx.devices",
        "phalanx.values",
        "phalanx.nn",
    }
    assert _with_packages({"phalanx.nn._module_tensors"}) == {"phalanx.nn._module_tensors", "phalanx.nn"}
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("phalanx.context") == 0
    assert layer_of("phalanx.keras.model") == len(LAYERS) - 1
