"""A torch store whose failed calls name it: `NamedStore` turns torch's bare store errors (no
answer within the store's timeout, a broken connection) into `PeerUnavailableError` naming the
store, the task and the call, with a hint of who serves the store (used by the elastic
membership, whose store outlives the workers)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from phalanx.communication.checks.health import PeerUnavailableError

__all__ = ["NamedStore", "store_unavailable"]


def store_unavailable(where: str, bound: float, call: str, hint: str, exc: Exception) -> PeerUnavailableError:
    """The error for ``call`` on the store ``where`` that failed with ``exc``."""
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else type(exc).__name__
    return PeerUnavailableError(
        f"{where} failed a {call} ({first_line}; a call waits at most {bound:g}s for an answer). "
        f"HINT: {hint}: is it still running, and reachable from this host?"
    )


class NamedStore:
    """``store`` (a torch ``Store``, or a wrapper of one) whose methods raise `store_unavailable`'s
    error instead of torch's ``DistError``.

    Args:
        store: The store.
        where: Whose store, and its address, for messages.
        bound: The seconds one call may take (the store's timeout).
        hint: Who serves the store.
    """

    def __init__(self, store: Any, where: str, bound: float, hint: str) -> None:
        self._store, self._where, self._bound, self._hint = store, where, bound, hint

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if not callable(method):
            return method

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except dist.DistError as exc:
                raise store_unavailable(self._where, self._bound, name, self._hint, exc) from exc

        return call
