"""`VariableHandle`: where a variable lives on the parameter-server tasks.

Its own module, below everything that names it (the wire messages, the sharding helpers, the
client in `phalanx.ps.variables`, which re-exports it), so none of those import each other
back to name a handle.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["VariableHandle"]


@dataclasses.dataclass(frozen=True)
class VariableHandle:
    """Where one variable lives: its name on ps task ``ps``, and what it looks like.

    ``kind`` is "parameter" (trained by optimizers, ``requires_grad`` as created) or "buffer"
    (a module's state such as BatchNorm's running statistics: workers add their changes).
    """

    name: str
    ps: int
    shape: tuple[int, ...]
    dtype: str
    kind: str = "parameter"
    requires_grad: bool = True
    shards: tuple[VariableHandle, ...] = ()  # split along axis 0 over these (see partitioners)

    def physical(self) -> tuple[VariableHandle, ...]:
        """The variables that hold it on the ps tasks: its shards, or itself."""
        return self.shards or (self,)

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype.removeprefix("torch."))
        assert isinstance(dtype, torch.dtype)
        return dtype

    def empty(self) -> torch.Tensor:
        """A local tensor of this variable's shape and dtype (values come from a read)."""
        return torch.zeros(self.shape, dtype=self.torch_dtype)
