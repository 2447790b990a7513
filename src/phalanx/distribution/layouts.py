"""`TensorLayout` and `LayoutMap`: how each weight is split over a `DeviceMesh` (Keras 3's names).

A layout gives, for each dimension of a tensor in torch's order, the mesh axis it is split
along or ``None`` (not split): ``TensorLayout(("model", None))`` splits an ``nn.Linear``'s
``weight`` (``out_features x in_features``) by rows over the ``model`` axis. A `LayoutMap`
maps parameter names to layouts; its keys are regular expressions matched in full against the
names ``module.named_parameters()`` gives (``"layers\\.\\d+\\.attention\\.wq\\.weight"``).
Looking a name up (Keras' rules): a key equal to the name wins; otherwise the one key whose
expression matches the whole name; two such keys are an error; no key means the parameter is
replicated.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, MutableMapping, Sequence

from phalanx.distribution.mesh import DeviceMesh

__all__ = ["LayoutMap", "TensorLayout"]


class TensorLayout:
    """The mesh axis (or ``None``) each dimension of a tensor is split along.

    Args:
        axes: One entry per dimension, in torch's order: a mesh axis name or ``None``.
        device_mesh: The mesh the axes name; a `LayoutMap` sets its own when none is given.

    Raises:
        ValueError: An entry is neither a string nor ``None``, or an axis is named twice.
    """

    def __init__(self, axes: Sequence[str | None], device_mesh: DeviceMesh | None = None) -> None:
        axes = tuple(axes)
        if not all(a is None or isinstance(a, str) for a in axes):
            raise ValueError(f"A layout's axes are mesh axis names or None. Received: {axes}.")
        named = [a for a in axes if a is not None]
        if len(set(named)) != len(named):
            raise ValueError(
                f"A tensor is split along a mesh axis at most once. Received: {axes}. HINT: name "
                "each axis in one dimension only."
            )
        self._axes = axes
        self._mesh = device_mesh
        if device_mesh is not None:
            self._check_axes(device_mesh)

    @property
    def axes(self) -> tuple[str | None, ...]:
        """The axis (or ``None``) of each dimension."""
        return self._axes

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh the axes name."""
        return self._mesh

    @device_mesh.setter
    def device_mesh(self, mesh: DeviceMesh) -> None:
        self._check_axes(mesh)
        self._mesh = mesh

    @property
    def is_replicated(self) -> bool:
        """Whether no dimension is split."""
        return all(a is None for a in self._axes)

    def _check_axes(self, mesh: DeviceMesh) -> None:
        missing = [a for a in self._axes if a is not None and a not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"A layout names mesh axes {missing} that the mesh does not have. Received: layout "
                f"{self._axes} on {mesh!r}. HINT: use the mesh's axis names {list(mesh.axis_names)}, "
                "or None for a dimension that is not split."
            )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorLayout) and self._axes == other.axes

    def __hash__(self) -> int:
        return hash(self._axes)

    def __repr__(self) -> str:
        return f"TensorLayout(axes={self._axes}, device_mesh={self._mesh!r})"


class LayoutMap(MutableMapping[str, TensorLayout]):
    """Parameter-name patterns -> `TensorLayout` over one `DeviceMesh` (Keras 3's ``LayoutMap``).

    ``layout_map["mlp\\.0\\.weight"] = ("model", None)``: a tuple becomes a `TensorLayout` on
    this map's mesh. ``layout_map[name]`` answers for a parameter name (see the module doc).

    Args:
        device_mesh: The mesh every layout of the map is on.
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        if not isinstance(device_mesh, DeviceMesh):
            raise TypeError(
                f"LayoutMap needs a phalanx.experimental.DeviceMesh. Received: {type(device_mesh).__name__}."
            )
        self._mesh = device_mesh
        self._layouts: dict[str, TensorLayout] = {}
        self._patterns: dict[str, re.Pattern[str]] = {}

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh every layout is on."""
        return self._mesh

    def __setitem__(self, key: str, layout: TensorLayout | Sequence[str | None]) -> None:
        """Sets the layout of the parameters whose names ``key`` matches in full.

        Raises:
            ValueError: ``key`` is set already, is not a valid regular expression, or the
                layout names an axis the mesh lacks.
        """
        if key in self._layouts:
            raise ValueError(
                f"LayoutMap already has a layout for {key!r}: {self._layouts[key]}. HINT: delete it "
                "first (del layout_map[key]) to replace it."
            )
        try:
            pattern = re.compile(key)
        except re.error as error:
            raise ValueError(
                f"LayoutMap keys are regular expressions. Received: {key!r} ({error})."
            ) from None
        if not isinstance(layout, TensorLayout):
            if isinstance(layout, str):
                raise ValueError(f"A layout is a tuple of axis names or None. Received: {layout!r}.")
            layout = TensorLayout(layout)
        if layout.device_mesh is None:
            layout.device_mesh = self._mesh
        elif layout.device_mesh != self._mesh:
            raise ValueError(
                f"A layout of this LayoutMap is on another mesh. Received: {layout.device_mesh!r}, the "
                f"map's: {self._mesh!r}. HINT: give the layout no device_mesh; the map sets its own."
            )
        self._layouts[key] = layout
        self._patterns[key] = pattern

    def __getitem__(self, name: str) -> TensorLayout:
        """The layout of parameter ``name``.

        Raises:
            KeyError: No key matches ``name`` (the parameter is replicated; `get` gives None).
            ValueError: More than one key's expression matches ``name`` in full.
        """
        layout = self._lookup(name)
        if layout is None:
            raise KeyError(name)
        return layout

    def _lookup(self, name: str) -> TensorLayout | None:
        if name in self._layouts:
            return self._layouts[name]
        keys = [k for k, p in self._patterns.items() if p.fullmatch(name)]
        if len(keys) > 1:
            raise ValueError(
                f"Parameter {name!r} matches more than one LayoutMap key: {keys}. HINT: make the "
                "expressions exclusive, or add the exact name as a key (an exact key wins)."
            )
        return self._layouts[keys[0]] if keys else None

    def get(self, name: str, default: TensorLayout | None = None) -> TensorLayout | None:  # type: ignore[override]
        """The layout of parameter ``name``, or ``default`` when no key matches."""
        layout = self._lookup(name)
        return default if layout is None else layout

    def matching_keys(self, names: Sequence[str]) -> set[str]:
        """The keys that match (or equal) at least one of ``names``."""
        return {k for k, p in self._patterns.items() if any(k == n or p.fullmatch(n) for n in names)}

    def __delitem__(self, key: str) -> None:
        del self._layouts[key]
        del self._patterns[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layouts)

    def __len__(self) -> int:
        return len(self._layouts)

    def __repr__(self) -> str:
        return f"LayoutMap({self._mesh!r}, {dict(self._layouts)!r})"
