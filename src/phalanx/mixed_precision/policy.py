"""TF's mixed-precision dtype policies (``tf.keras.mixed_precision.Policy``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["Policy", "global_policy", "set_global_policy"]

_COMPUTE = {"float32": torch.float32, "mixed_float16": torch.float16, "mixed_bfloat16": torch.bfloat16}


class Policy:
    """A dtype policy: the dtype layers compute in and the dtype variables are stored in.

    ``"mixed_float16"`` and ``"mixed_bfloat16"`` keep variables in float32 and compute in
    float16 / bfloat16 (through ``torch.autocast``, which also keeps the numerically
    sensitive operations, such as losses and softmax, in float32); ``"float32"`` changes
    nothing. float16 needs loss scaling against underflowing gradients (`GradScaler`,
    `LossScaleOptimizer`); bfloat16 does not.

    Args:
        name: ``"float32"``, ``"mixed_float16"`` or ``"mixed_bfloat16"``.

    Raises:
        ValueError: Another name.
    """

    def __init__(self, name: str) -> None:
        if name not in _COMPUTE:
            raise ValueError(
                f"A mixed-precision policy is one of {sorted(_COMPUTE)}. Received: {name!r}. "
                'HINT: Policy("mixed_bfloat16") on CPUs and recent GPUs, "mixed_float16" '
                "with loss scaling on older GPUs."
            )
        self._name = name

    @property
    def name(self) -> str:
        """The policy's name."""
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype layers compute in, as TF names it (``"float16"``)."""
        return str(_COMPUTE[self._name]).removeprefix("torch.")

    @property
    def variable_dtype(self) -> str:
        """The dtype variables are stored in: always ``"float32"``."""
        return "float32"

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        """`compute_dtype` as a ``torch.dtype``."""
        return _COMPUTE[self._name]

    @property
    def needs_loss_scaling(self) -> bool:
        """Whether gradients may underflow without loss scaling (float16 compute)."""
        return self._name == "mixed_float16"

    @contextlib.contextmanager
    def autocast(self, device_type: str = "cpu") -> Iterator[None]:
        """Runs the block with ``torch.autocast`` in the compute dtype (nothing for float32).

        Args:
            device_type: ``"cpu"`` or ``"cuda"``: where the computation runs.
        """
        enabled = self._name != "float32"
        with torch.autocast(device_type, dtype=_COMPUTE[self._name], enabled=enabled):
            yield

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other.name == self._name

    def __hash__(self) -> int:
        return hash(self._name)

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'


_lock = threading.Lock()
_global = Policy("float32")


def set_global_policy(policy: Policy | str) -> None:
    """Sets the policy `Model.fit`, `evaluate` and `predict` compute with (process-wide).

    Raises:
        ValueError: An unknown policy name.
        TypeError: Neither a `Policy` nor a name.
    """
    global _global
    if isinstance(policy, str):
        policy = Policy(policy)
    if not isinstance(policy, Policy):
        raise TypeError(
            "set_global_policy takes a Policy or its name. Received: "
            f"{type(policy).__name__}. HINT: set_global_policy('mixed_bfloat16')."
        )
    with _lock:
        _global = policy


def global_policy() -> Policy:
    """The process-wide policy (``Policy("float32")`` until `set_global_policy`)."""
    return _global
