"""phalanx.data.Options: the tf.data options the distribution layer reads."""

from __future__ import annotations

from typing import Any

from phalanx.input.options import AutoShardPolicy

__all__ = ["DistributeOptions", "Options"]


class DistributeOptions:
    """``options.experimental_distribute``: how the dataset is sharded across workers."""

    def __init__(self) -> None:
        self._policy: AutoShardPolicy | None = None

    @property
    def auto_shard_policy(self) -> AutoShardPolicy:
        return self._policy if self._policy is not None else AutoShardPolicy.AUTO

    @auto_shard_policy.setter
    def auto_shard_policy(self, value: AutoShardPolicy | str | int) -> None:
        self._policy = AutoShardPolicy.coerce(value)


class Options:
    """Dataset options; ``with_options`` merges them, the outermost setting of a field winning."""

    def __init__(self) -> None:
        self.experimental_distribute = DistributeOptions()
        self._deterministic: bool | None = None

    @property
    def deterministic(self) -> bool:
        return True if self._deterministic is None else self._deterministic

    @deterministic.setter
    def deterministic(self, value: bool) -> None:
        self._deterministic = bool(value)

    def merge(self, outer: Options) -> Options:
        """These options overridden by the fields ``outer`` sets."""
        merged = Options()
        merged.experimental_distribute._policy = (
            outer.experimental_distribute._policy
            if outer.experimental_distribute._policy is not None
            else self.experimental_distribute._policy
        )
        merged._deterministic = (
            outer._deterministic if outer._deterministic is not None else self._deterministic
        )
        return merged

    def __repr__(self) -> str:
        policy = self.experimental_distribute.auto_shard_policy.name
        return f"Options(auto_shard_policy={policy}, deterministic={self.deterministic})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Options) and repr(self) == repr(other)

    __hash__ = None  # type: ignore[assignment]
