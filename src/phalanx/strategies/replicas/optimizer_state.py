"""Per-replica optimizer state: every replica keeps its own momentum, step count, ....

See docs/architecture.md, "The optimizer step".

A shared ``optimizer.state`` would let replicas clobber each other's buffers and count each
step once per replica. This mapping sends ``optimizer.state[p]`` to the calling replica's
own dict; outside a replica context it shows replica 0's, so ``optimizer.state_dict()``
taken outside ``run`` holds plain tensors, loadable without phalanx.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch

from phalanx import context

__all__ = ["PerReplicaState"]


def _copy_entry(entry: Any, source: torch.device, target: torch.device) -> Any:
    if isinstance(entry, torch.Tensor):
        out = entry.detach().clone()
        return out.to(target) if out.device == source else out
    if isinstance(entry, dict):
        return {k: _copy_entry(v, source, target) for k, v in entry.items()}
    return copy.deepcopy(entry)


class PerReplicaState(MutableMapping[Any, Any]):
    """``optimizer.state`` with one dict per local replica (see module docstring).

    Args:
        initial: The state so far (e.g. just loaded); every replica starts from a copy.
        owner: The strategy whose replica context selects the dict (compared by identity).
        devices: The owner's local replica devices; replica ``i``'s copies of tensors that
            were on ``devices[0]`` move to ``devices[i]``.
    """

    def __init__(self, initial: Mapping[Any, Any], owner: object, devices: Sequence[torch.device]) -> None:
        self.owner = owner
        home = devices[0]
        self._states: list[dict[Any, Any]] = [dict(initial)] + [
            {k: _copy_entry(v, home, device) for k, v in initial.items()} for device in devices[1:]
        ]

    def check_step_outside_run(self) -> None:
        """Refuses ``optimizer.step()`` outside the owner's `run` (called by `phalanx._hooks`).

        Raises:
            RuntimeError: always: the step would update replica 0's state only.
        """
        raise RuntimeError(
            f"optimizer.step() was called outside {self.owner!r}.run, but this optimizer keeps "
            "one state per replica (it stepped inside run before): stepping here would update "
            "replica 0's state only and the replicas would drift apart. HINT: call "
            "optimizer.step() inside strategy.run, as the training step does."
        )

    def _current(self) -> dict[Any, Any]:
        replica = context.current_replica()
        if replica is not None and replica[0] is self.owner:
            return self._states[replica[1]]
        return self._states[0]

    def __getitem__(self, key: Any) -> Any:
        state = self._current()
        try:
            return state[key]
        except KeyError:  # defaultdict(dict) semantics, as torch.optim expects
            value: dict[Any, Any] = {}
            state[key] = value
            return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._current()[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._current()[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __contains__(self, key: object) -> bool:
        return key in self._current()

    def replica_state(self, index: int) -> dict[Any, Any]:
        """The state dict of one local replica."""
        return self._states[index]
