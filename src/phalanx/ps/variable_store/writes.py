"""What a ps task's `VariableStore` wrote since a reader last looked (`Writes`): the version of
each variable's last write and, for a table only row gradients wrote since it was last written
whole, the version of each row, so `VariableStore.changes_since` (the chief's ``read_since``)
sends the rows a round trained instead of the table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["Writes"]


class Writes:
    """The versions of a store's writes, by variable and, for tables written by rows, by row
    (8 bytes a row). Not thread-safe: the store calls it under its lock."""

    def __init__(self) -> None:
        self._written: dict[str, int] = {}
        self._rows: dict[str, torch.Tensor] = {}

    def whole(self, names: Sequence[str], version: int) -> None:
        """Variables ``names`` were written whole at ``version``."""
        for name in names:
            self._written[name] = version
            self._rows.pop(name, None)

    def rows(self, name: str, table: torch.Tensor, rows: torch.Tensor, version: int) -> None:
        """Only rows ``rows`` of ``name`` (``table``) were written, at ``version``."""
        versions = self._rows.get(name)
        if versions is None:
            versions = torch.full((table.shape[0],), self._written.get(name, 0), dtype=torch.int64)
            self._rows[name] = versions
        versions[rows] = version
        self._written[name] = version

    def changes(
        self, variables: Mapping[str, torch.Tensor], names: Sequence[str], since: Sequence[int]
    ) -> tuple[list[str], list[torch.Tensor]]:
        """Per name ``"same"`` (not written after version ``since``), ``"rows"`` (the row
        numbers written since and those rows: a table only rows wrote since, while they and
        their numbers are fewer bytes than it) or ``"whole"`` (the variable itself, a view)."""
        kinds: list[str] = []
        tensors: list[torch.Tensor] = []
        for name, known in zip(names, since, strict=True):
            variable = variables[name]
            if self._written[name] <= known:  # a write is version 1 or later; never read is -1
                kinds.append("same")
                continue
            versions = self._rows.get(name)
            if versions is not None and known >= 0:
                rows = (versions > known).nonzero().flatten()
                row_bytes = variable[0].numel() * variable.element_size() + rows.element_size()
                if rows.numel() * row_bytes < variable.numel() * variable.element_size():
                    kinds.append("rows")
                    tensors += [rows, variable.index_select(0, rows)]
                    continue
            kinds.append("whole")
            tensors.append(variable)
        return kinds, tensors
