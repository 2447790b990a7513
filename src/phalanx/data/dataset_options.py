"""phalanx.data.Options: the tf.data options the distribution layer reads.

Every field remembers whether it was set, so that ``with_options`` can merge options along
a chain as tf.data does: a field set by an outer ``with_options`` wins over an inner one,
and a field nobody set keeps its default.
"""

from __future__ import annotations

from typing import Any

from phalanx.input.input_options import AutoShardPolicy

__all__ = ["DistributeOptions", "Options"]


class _Fields:
    """Options base: only declared fields may be set, so a typo fails instead of being ignored;
    every field remembers whether it was set (`is_set`), which is what `merge` needs."""

    __slots__ = ("_values",)
    _FIELDS: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}  # the fields set, by name (a field not here has its default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._FIELDS and not name.startswith("_"):
            raise AttributeError(self._no_such_option(name))
        super().__setattr__(name, value)

    def _no_such_option(self, name: str) -> str:
        return f"{type(self).__name__} has no option {name!r}. Options that can be set: {list(self._FIELDS)}."

    def is_set(self, name: str) -> bool:
        """Whether option ``name`` was set here: one nobody set reads as its default and gives
        way to any setting in a `merge` (tf.data's rule). Called by the ``merge`` methods.

        Raises:
            AttributeError: No option ``name``.
        """
        if name not in self._FIELDS:
            raise AttributeError(self._no_such_option(name))
        return name in self._values


class DistributeOptions(_Fields):
    """``Options.experimental_distribute``: how the dataset is sharded across workers.

    Attributes:
        auto_shard_policy: An `AutoShardPolicy` (default AUTO); assignments accept the enum,
            its name in any case, or its value.
    """

    __slots__ = ()
    _FIELDS = ("auto_shard_policy",)

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """How the distribution layer splits this dataset across workers."""
        policy: AutoShardPolicy = self._values.get("auto_shard_policy", AutoShardPolicy.AUTO)
        return policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value: AutoShardPolicy | str | int) -> None:
        self._values["auto_shard_policy"] = AutoShardPolicy.coerce(value)

    def merge(self, outer: DistributeOptions) -> DistributeOptions:
        """A new DistributeOptions: these, overridden by every field ``outer`` sets
        (`Options.merge`)."""
        merged = DistributeOptions()
        for source in (self, outer):  # outer last: what it sets wins
            if source.is_set("auto_shard_policy"):
                merged.auto_shard_policy = source.auto_shard_policy
        return merged


class Options(_Fields):
    """Dataset options (tf.data.Options), applied with `Dataset.with_options`.

    Attributes:
        experimental_distribute: `DistributeOptions` (the auto-shard policy).
        deterministic: Whether elements must come out in a deterministic order (default True).
            Every phalanx transformation is deterministic, so this is recorded for the
            distribution layer and for TF compatibility.

    Raises:
        AttributeError: Setting an option that does not exist.
    """

    __slots__ = ("_distribute",)
    _FIELDS = ("deterministic", "experimental_distribute")

    def __init__(self) -> None:
        super().__init__()
        self._distribute = DistributeOptions()

    @property
    def experimental_distribute(self) -> DistributeOptions:
        """The distribution options (`DistributeOptions`)."""
        return self._distribute

    @experimental_distribute.setter
    def experimental_distribute(self, value: DistributeOptions) -> None:
        if not isinstance(value, DistributeOptions):
            raise TypeError(
                "experimental_distribute must be a phalanx.data.DistributeOptions. Received: "
                f"{type(value).__name__}. HINT: set its fields instead: "
                "options.experimental_distribute.auto_shard_policy = ..."
            )
        self._distribute = value

    def is_set(self, name: str) -> bool:
        """Whether option ``name`` was set here (``experimental_distribute``: whether one of its
        fields was); see `_Fields.is_set`.

        Raises:
            AttributeError: No option ``name``.
        """
        if name == "experimental_distribute":
            return self._distribute.is_set("auto_shard_policy")
        return super().is_set(name)

    @property
    def deterministic(self) -> bool:
        """Whether the output order must be deterministic."""
        return bool(self._values.get("deterministic", True))

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"deterministic must be a bool. Received: {value!r} ({type(value).__name__}).")
        self._values["deterministic"] = value

    def merge(self, outer: Options) -> Options:
        """A new Options: these, overridden by every field ``outer`` sets."""
        merged = Options()
        merged.experimental_distribute = self._distribute.merge(outer.experimental_distribute)
        for source in (self, outer):  # outer last: what it sets wins
            if source.is_set("deterministic"):
                merged.deterministic = source.deterministic
        return merged

    def copy(self) -> Options:
        """An independent copy (later changes to either do not affect the other)."""
        return Options().merge(self)

    def __repr__(self) -> str:
        policy = self.experimental_distribute.auto_shard_policy.name
        return f"Options(auto_shard_policy={policy}, deterministic={self.deterministic})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and repr(self) == repr(other)

    __hash__ = None  # type: ignore[assignment]  # mutable
