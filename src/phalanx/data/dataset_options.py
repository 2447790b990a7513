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
    """Options base: only declared fields may be set, so a typo fails instead of being ignored."""

    __slots__: tuple[str, ...] = ()
    _FIELDS: tuple[str, ...] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._FIELDS and not name.startswith("_"):
            raise AttributeError(
                f"{type(self).__name__} has no option {name!r}. Options that can be set: "
                f"{list(self._FIELDS)}."
            )
        super().__setattr__(name, value)


class DistributeOptions(_Fields):
    """``Options.experimental_distribute``: how the dataset is sharded across workers.

    Attributes:
        auto_shard_policy: An `AutoShardPolicy` (default AUTO); assignments accept the enum,
            its name in any case, or its value.
    """

    __slots__ = ("_policy",)
    _FIELDS = ("auto_shard_policy",)

    def __init__(self) -> None:
        self._policy: AutoShardPolicy | None = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        """How the distribution layer splits this dataset across workers."""
        return AutoShardPolicy.AUTO if self._policy is None else self._policy

    @auto_shard_policy.setter
    def auto_shard_policy(self, value: AutoShardPolicy | str | int) -> None:
        self._policy = AutoShardPolicy.coerce(value)

    def _merged(self, outer: DistributeOptions) -> DistributeOptions:
        merged = DistributeOptions()
        merged._policy = outer._policy if outer._policy is not None else self._policy
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

    __slots__ = ("_deterministic", "_distribute")
    _FIELDS = ("deterministic", "experimental_distribute")

    def __init__(self) -> None:
        self._distribute = DistributeOptions()
        self._deterministic: bool | None = None

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

    @property
    def deterministic(self) -> bool:
        """Whether the output order must be deterministic."""
        return True if self._deterministic is None else self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"deterministic must be a bool. Received: {value!r} ({type(value).__name__}).")
        self._deterministic = value

    def merge(self, outer: Options) -> Options:
        """A new Options: these, overridden by every field ``outer`` sets."""
        merged = Options()
        merged._distribute = self._distribute._merged(outer._distribute)
        merged._deterministic = self._deterministic if outer._deterministic is None else outer._deterministic
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
