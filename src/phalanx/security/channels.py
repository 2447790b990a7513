"""How the parameter-server transport authenticates both ends and bounds what it buffers.

* **Mutual TLS (the default).** Every server and every client presents a certificate of the
  cluster CA (`phalanx.security.certificates`: derived from ``PHALANX_CLUSTER_TOKEN``, or the
  user's files) and accepts only a peer that does, in the TLS handshake, before any request or
  reply byte is exchanged. The token never travels; a recorded connection cannot be replayed
  (TLS session keys are fresh per connection); the client checks the server's certificate
  against the address it dialled (IP addresses and names alike).
* **Plaintext (opt-out).** ``PHALANX_INSECURE_TRANSPORT=1`` drops TLS for networks where every
  host is trusted: the token then travels in clear gRPC metadata and is checked by
  `TokenInterceptor` before a handler reads the request body. Logged as a warning by every task.
* **Message size.** Every message, both ways, is bounded by ``PHALANX_MAX_MESSAGE_BYTES``
  (default 1 GiB), enforced by gRPC as it reads the length prefix.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from phalanx import settings
from phalanx.security.certificates import task_certificate
from phalanx.security.token import check_token

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "INSECURE_ENV",
    "MAX_MESSAGE_ENV",
    "TOKEN_KEY",
    "TokenInterceptor",
    "channel_credentials",
    "insecure_transport",
    "is_handshake_failure",
    "max_message_bytes",
    "server_credentials",
    "size_options",
    "warn_insecure",
]

log = logging.getLogger("phalanx")

INSECURE_ENV = "PHALANX_INSECURE_TRANSPORT"
MAX_MESSAGE_ENV = "PHALANX_MAX_MESSAGE_BYTES"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_GRPC_MAX = (1 << 31) - 1  # gRPC's lengths are signed 32-bit
TOKEN_KEY = "phalanx-token"  # noqa: S105 - a metadata key, not a secret
# what gRPC's details say when a TLS handshake or the certificate check failed
_HANDSHAKE_WORDS = ("handshake", "certificate", "hostname verification", "ssl_error", "tsi_")
_warned_clients = False


def insecure_transport() -> bool:
    """Whether ``PHALANX_INSECURE_TRANSPORT`` asks for plaintext ("1", "true", "yes").

    Raises:
        ValueError: Another value (a typo must not silently keep or drop TLS).
    """
    return settings.current().insecure_transport


def warn_insecure(who: str, server: bool) -> None:
    """Logs that ``who`` runs without TLS: every server (one per task), clients once per process."""
    global _warned_clients
    if not server:
        if _warned_clients:
            return
        _warned_clients = True
    log.warning(
        "%s uses PLAINTEXT gRPC (%s=1): the cluster token travels in clear and any host that can "
        "reach the task ports can read or impersonate this cluster's traffic. Use it only on a "
        "network where every host is trusted (docs/security.md).",
        who,
        INSECURE_ENV,
    )


def max_message_bytes() -> int:
    """The largest message a task sends or accepts, from ``PHALANX_MAX_MESSAGE_BYTES``.

    Raises:
        ValueError: Not an integer between 1 MiB and 2 GiB - 1 (gRPC's limit).
    """
    return settings.current().max_message_bytes


def size_options(limit: int) -> list[tuple[str, int]]:
    """gRPC channel/server options that bound every message to ``limit`` bytes."""
    return [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit)]


def server_credentials(token: str, names: Sequence[str]) -> grpc.ServerCredentials:
    """A server's TLS credentials: a certificate for ``names``, client certificates required."""
    cert = task_certificate(check_token(token), names)
    return grpc.ssl_server_credentials(
        [(cert.key, cert.chain)], root_certificates=cert.ca, require_client_auth=True
    )


def channel_credentials(token: str) -> grpc.ChannelCredentials:
    """A client's TLS credentials: trusts the cluster CA only and presents its own certificate."""
    cert = task_certificate(check_token(token), ())
    return grpc.ssl_channel_credentials(cert.ca, cert.key, cert.chain)


def is_handshake_failure(details: str) -> bool:
    """Whether gRPC's error details say the TLS handshake (or the server's certificate) failed."""
    lowered = details.lower()
    return any(word in lowered for word in _HANDSHAKE_WORDS)


def _refuse(message: str) -> grpc.RpcMethodHandler:
    """A handler that refuses a call without reading its request: a request-streaming handler
    receives no message until it asks, so the body is never buffered."""

    def refuse(requests: Any, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        raise AssertionError("grpc's abort raises")  # not reached

    return grpc.stream_unary_rpc_method_handler(refuse)


class TokenInterceptor(grpc.ServerInterceptor):
    """Plaintext mode: refuses a call whose ``phalanx-token`` metadata is not the token (compared
    in constant time) before any handler runs and before its body is read (logged)."""

    def __init__(self, token: str, name: str) -> None:
        self._token, self._name = token.encode(), name

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        given: Any = dict(handler_call_details.invocation_metadata or ()).get(TOKEN_KEY, "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if hmac.compare_digest(given_bytes, self._token):
            return continuation(handler_call_details)
        log.warning(
            "%s refused a call to %s: wrong or missing cluster token", self._name, handler_call_details.method
        )
        return _refuse(f"{self._name} refused the caller's cluster token")
