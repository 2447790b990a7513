"""The Metric base: additive state that distributes as SUM sync-on-read variables."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phalanx.losses._utils import dtype_name, resolve_dtype, to_snake_case
from phalanx.variables import set_aggregation

__all__ = ["Metric"]


class Metric(nn.Module):
    """Base of Keras-style metrics, usable in `Model.fit` and in custom training loops.

    A metric's state is a set of additive totals and counts made by `add_state`. Created in
    a strategy scope, each becomes a SUM sync-on-read variable: ``update_state`` inside
    ``strategy.run`` adds to the replica's own copy, and ``result()`` outside reads the sum
    over every replica and worker — so results are count-weighted global values (1 correct
    of 25 is 0.04 however the 25 were split). Hence the rules for subclasses: state holds
    only sums, ``result()`` derives the value from them, and updates are in place.

    ``metric(...)`` is ``update_state(...)`` then ``result()``, as in Keras (not
    ``nn.Module.forward``).

    Args:
        dtype: Floating dtype of the state (default float32, as Keras).
        name: Name in logs (default: the class name in snake case).

    Attributes:
        direction: ``"up"`` or ``"down"``: which way is better (None: not known), read by the
            callbacks' ``mode="auto"`` (`phalanx.callbacks.MonitorCallback`).

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype.
    """

    direction: str | None = None

    def __init__(self, dtype: torch.dtype | str | None = None, name: str | None = None) -> None:
        super().__init__()
        self.name = name or to_snake_case(type(self).__name__)
        self.dtype: torch.dtype = resolve_dtype(dtype, torch.float32) or torch.float32
        self._state_names: list[str] = []

    def add_state(
        self,
        name: str,
        shape: tuple[int, ...] = (),
        dtype: torch.dtype | str | None = None,
        initializer: str = "zeros",
    ) -> torch.Tensor:
        """Creates a zero state tensor that sums across replicas and workers, and registers it.

        Args:
            name: Attribute name of the state.
            shape: Its shape.
            dtype: Its dtype (default: the metric's).
            initializer: Must be "zeros": a summed state starts at zero everywhere.

        Returns:
            The registered buffer (a distributed variable inside a strategy scope).

        Raises:
            ValueError: Another initializer, or a non-floating dtype.
        """
        if initializer != "zeros":
            raise ValueError(
                f"Metric state {name!r} must start at 'zeros': states are totals summed across "
                f"replicas and workers. Received: initializer={initializer!r}. HINT: keep sums "
                "and counts in the state and derive the value in result()."
            )
        tensor = torch.zeros(shape, dtype=resolve_dtype(dtype, self.dtype))
        # The strategy's buffer hook reads this mark: a SUM sync-on-read variable.
        set_aggregation(tensor, "sum")
        self.register_buffer(name, tensor, persistent=True)
        self._state_names.append(name)
        return getattr(self, name)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        """Adds a batch to the totals (inside ``strategy.run``, or anywhere without a strategy).

        Raises:
            NotImplementedError: The subclass does not implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement update_state(...).")

    def result(self) -> torch.Tensor:
        """The value from the totals (read outside ``strategy.run``: the global value).

        Raises:
            NotImplementedError: The subclass does not implement it.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement result().")

    def reset_state(self) -> None:
        """Zeroes every state in place (the buffer objects stay the same)."""
        with torch.no_grad():
            for name in self._state_names:
                getattr(self, name).fill_(0)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """``update_state(*args, **kwargs)``, then ``result()``."""
        self.update_state(*args, **kwargs)
        return self.result()

    def _add(self, state: torch.Tensor, value: torch.Tensor | float) -> None:
        """Adds ``value`` to ``state`` in place, on the state's device and dtype."""
        with torch.no_grad():
            state.add_(torch.as_tensor(value).to(device=state.device, dtype=state.dtype))

    def _read(self, *names: str) -> tuple[torch.Tensor, ...]:
        """Plain copies of the named states (each distributed state is read, and reduced, once)."""
        return tuple(getattr(self, name).detach().clone() for name in names)

    def get_config(self) -> dict[str, Any]:
        """The constructor arguments (JSON-able)."""
        return {"name": self.name, "dtype": dtype_name(self.dtype)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Metric:
        """The metric `get_config` describes (with fresh state)."""
        return cls(**config)

    def extra_repr(self) -> str:
        return f"name={self.name!r}"
