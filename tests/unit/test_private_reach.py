"""Modules keep out of other objects' private attributes.

A reach-in is ``x._name`` where ``x`` is neither ``self``, ``cls``, ``super()`` nor a module
(an imported name, or a chain of them such as ``torch.nn``). Names that are public by their
library's own contract despite the underscore (a namedtuple's ``_asdict`` / ``_replace`` /
``_fields``, ctypes' ``_fields_``) are not reach-ins. The few left are torch internals with no
public spelling, each read in one function of ``phalanx/_hooks.py`` (docs/architecture.md, "The
torch footprint"), a sparse tensor's entry count and torchmetrics' state reductions.
Run this file as a script to list them all.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "phalanx"

# The ceiling: lower it when a reach-in goes; never raise it (give the state a public name or a
# method on the class that owns it instead).
MAX_REACH_INS = 13

PUBLIC_BY_CONTRACT = frozenset({"_asdict", "_replace", "_fields", "_make", "_fields_"})
ALWAYS_MODULES = frozenset({"torch", "dist", "os", "sys", "nn", "np"})


def _imported_names(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _is_own_or_module(value: ast.expr, modules: set[str]) -> bool:
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "super":
        return True
    root = _root(value)
    if not isinstance(root, ast.Name):
        return False
    if value is root and root.id in ("self", "cls"):
        return True
    return root.id in modules


def reach_ins() -> Iterator[str]:
    """Yields ``path:line: expression`` for every reach-in under src/phalanx."""
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        modules = _imported_names(tree) | ALWAYS_MODULES
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            name = node.attr
            if not name.startswith("_") or name.startswith("__") or name in PUBLIC_BY_CONTRACT:
                continue
            if _is_own_or_module(node.value, modules):
                continue
            where = path.relative_to(SRC.parent)
            yield f"{where}:{node.lineno}: {ast.unparse(node)[:70]}"


def test_few_private_reach_ins() -> None:
    found = list(reach_ins())
    listing = "\n".join(found)
    assert len(found) <= MAX_REACH_INS, (
        f"{len(found)} reach-ins into private attributes (at most {MAX_REACH_INS}); give the "
        f"state a public name or a method on its class:\n{listing}"
    )


if __name__ == "__main__":
    found = list(reach_ins())
    print("\n".join(found) if "-v" in sys.argv else "")
    print(len(found))
