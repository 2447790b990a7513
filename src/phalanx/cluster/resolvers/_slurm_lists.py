"""SLURM's compact list formats: host lists (``node[1-3,5]``) and tasks per node (``2(x3),1``)."""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expands a SLURM host list into host names, in order, zero-padding kept.

    ``"node[1-3,5],gpu-[01-02]"`` → ``["node1", "node2", "node3", "node5", "gpu-01",
    "gpu-02"]``. Several bracket groups in one name expand as a product
    (``"r[1-2]n[1-2]"`` → ``r1n1, r1n2, r2n1, r2n2``). Pure Python: no ``scontrol`` needed.

    Args:
        hostlist: The list, as in ``SLURM_JOB_NODELIST``. A blank string gives ``[]``.

    Raises:
        ValueError: Unbalanced or nested brackets, an empty name, or a bad range.
    """
    return [host for item in _split_top_level(hostlist) for host in _expand_item(item, hostlist)]


def _split_top_level(hostlist: str) -> list[str]:
    if not hostlist.strip():
        return []
    items, current, depth = [], "", 0
    for char in hostlist.strip():
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(
                f"SLURM host list {hostlist!r} has unbalanced or nested brackets. "
                "HINT: the form is 'node[1-3,5],other[01-02]'."
            )
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"SLURM host list {hostlist!r} has unbalanced brackets: a '[' is never closed.")
    return [*items, current]


def _expand_item(item: str, hostlist: str) -> list[str]:
    if not item.strip():
        raise ValueError(f"SLURM host list {hostlist!r} has an empty host name (two commas in a row?).")
    parts = re.split(r"(\[[^\]]*\])", item.strip())
    choices = [_expand_ranges(part[1:-1], hostlist) if part.startswith("[") else [part] for part in parts]
    return ["".join(combination) for combination in itertools.product(*choices)]


def _expand_ranges(body: str, hostlist: str) -> list[str]:
    names: list[str] = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item.strip())
        if not match or (match.group(2) and int(match.group(2)) < int(match.group(1))):
            raise ValueError(
                f"Bad SLURM host range {item!r} in {hostlist!r}: expected N or LOW-HIGH with LOW <= HIGH, "
                "in digits. HINT: 'node[1-3,5]'."
            )
        low, high = match.group(1), match.group(2) or match.group(1)
        names.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """Expands SLURM's tasks-per-node list: ``"2(x3),1"`` → ``[2, 2, 2, 1]``.

    Raises:
        ValueError: An item that is neither ``N`` nor ``N(xM)``.
    """
    counts: list[int] = []
    for item in text.split(","):
        match = _COUNT.fullmatch(item.strip())
        if not match:
            raise ValueError(
                f"Bad SLURM tasks-per-node list {text!r}: item {item!r} is neither N nor N(xM). "
                "HINT: the form is '2(x3),1' (three nodes with 2 tasks, then one with 1)."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
