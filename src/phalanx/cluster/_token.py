"""The shared secret every task of a parameter-server cluster presents (docs/security.md)."""

from __future__ import annotations

import os

__all__ = ["TOKEN_ENV", "cluster_token"]

TOKEN_ENV = "PHALANX_CLUSTER_TOKEN"  # noqa: S105 - the variable's name, not a secret


def cluster_token() -> str:
    """The cluster's shared secret from ``PHALANX_CLUSTER_TOKEN``.

    Raises:
        ValueError: It is not set.
    """
    token = os.environ.get(TOKEN_ENV, "")
    if not token:
        raise ValueError(
            f"A parameter-server cluster authenticates its tasks with a shared secret, but {TOKEN_ENV} "
            "is not set. HINT: set the same random value on every task (phalanx launch sets one), "
            "e.g. export PHALANX_CLUSTER_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(16))')."
        )
    return token
