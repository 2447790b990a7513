"""The shared secret every task of a parameter-server cluster presents (docs/security.md)."""

from __future__ import annotations

import secrets

from phalanx import settings

__all__ = [
    "MIN_TOKEN_LENGTH",
    "TOKEN_ENV",
    "check_token",
    "cluster_token",
    "missing_token_error",
    "new_token",
]

TOKEN_ENV = "PHALANX_CLUSTER_TOKEN"  # noqa: S105 - the variable's name, not a secret
MIN_TOKEN_LENGTH = 16
_GENERATE = "python -c 'import secrets; print(secrets.token_hex(16))'"
_HOW = (
    f"`phalanx launch` sets one by itself for a local cluster (--workers/--ps). A cluster across "
    f"nodes (per-node mode with --tf-config, Kubernetes, SLURM) needs the same secret on every "
    f"node: generate it once with {_GENERATE}, distribute it as a secret (e.g. a Kubernetes "
    f"Secret, a file readable only by you), and export {TOKEN_ENV}=<that value> on every node "
    "before its tasks start."
)


def new_token() -> str:
    """A fresh random token (32 hex characters, 128 bits)."""
    return secrets.token_hex(16)


def missing_token_error() -> ValueError:
    """The error for a parameter-server cluster without ``PHALANX_CLUSTER_TOKEN``."""
    return ValueError(
        f"A parameter-server cluster authenticates its tasks with a shared secret, but {TOKEN_ENV} "
        f"is not set. HINT: {_HOW}"
    )


def check_token(token: str) -> str:
    """Returns ``token`` if it is usable as the cluster's secret.

    Raises:
        ValueError: Fewer than `MIN_TOKEN_LENGTH` characters, or characters that are not
            printable ASCII (it travels as a gRPC header).
    """
    if len(token) < MIN_TOKEN_LENGTH:
        raise ValueError(
            f"{TOKEN_ENV} must be at least {MIN_TOKEN_LENGTH} characters: it is the only thing that "
            "tells the cluster's tasks apart from anyone else who reaches their ports, and the tasks "
            "run code sent by whoever presents it, so a short one could be guessed by trying values. "
            f"Received: a token of {len(token)} characters. HINT: {_HOW}"
        )
    if not (token.isascii() and token.isprintable()):
        raise ValueError(
            f"{TOKEN_ENV} must be printable ASCII: it travels as a gRPC header. Received: a token of "
            f"{len(token)} characters, some of them not printable ASCII. HINT: {_HOW}"
        )
    return token


def cluster_token() -> str:
    """The cluster's shared secret from ``PHALANX_CLUSTER_TOKEN``.

    Raises:
        ValueError: It is not set, too short, or not printable ASCII.
    """
    token = settings.current().cluster_token
    if not token:
        raise missing_token_error()
    return check_token(token)
