"""What the TLS transport tests of the security tier share: how workers are named, and a store
that sends one worker to another address (an impostor or a relay at the address the store gives)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def worker_name(rank: int) -> str:
    """The name a test worker gives in errors."""
    return f"worker:{rank} (127.0.0.1:{2220 + rank})"


class Redirecting:
    """The job's store, except that ``key`` (an address record ``host|port|name``) reads with
    the port ``port()`` returns (None: the store as it is)."""

    def __init__(self, store: Any, key: str, port: Callable[[], int] | None) -> None:
        self._store, self._key, self._port = store, key, port

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        if key == self._key and self._port is not None:
            host, _, named = value.decode().split("|")
            return f"{host}|{self._port()}|{named}".encode()
        return value
