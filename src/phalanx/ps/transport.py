"""gRPC between the tasks of a parameter-server cluster: generic unary methods, no codegen.

The public names of both halves: `phalanx.ps.rpc.service` (`RpcServer`) and
`phalanx.ps.rpc.client` (`RpcClient`, `PendingCall`), with what they share in
`phalanx.ps.rpc.common`.

A request and a reply are one message each: `phalanx.ps.wire` (a JSON header and raw tensor
bytes), sent as ``/phalanx.Task/<method>``. Both ends authenticate each other before a byte
of a request or reply is exchanged: mutual TLS against the cluster CA (derived from
``PHALANX_CLUSTER_TOKEN``, or the user's certificate files), or, with the plaintext opt-out
``PHALANX_INSECURE_TRANSPORT=1``, the token in metadata checked by a server interceptor
before the body is read (`phalanx.security.channels`). Every message is bounded by
``PHALANX_MAX_MESSAGE_BYTES``. Errors come back named (`phalanx.ps.rpc.errors`): a handler's
exception as `RemoteError`, an unreachable or silent task as `TaskUnavailableError`, refused
credentials as `AuthenticationError`, a peer that did not prove it holds the credentials as
`PeerAuthenticationError`, an oversized message as `MessageTooLargeError`.
"""

from __future__ import annotations

from phalanx.ps.rpc.client import PendingCall, RpcClient
from phalanx.ps.rpc.common import Handler
from phalanx.ps.rpc.errors import (
    AuthenticationError,
    MessageTooLargeError,
    PeerAuthenticationError,
    RemoteError,
    TaskUnavailableError,
)
from phalanx.ps.rpc.service import RpcServer

__all__ = [
    "AuthenticationError",
    "Handler",
    "MessageTooLargeError",
    "PeerAuthenticationError",
    "PendingCall",
    "RemoteError",
    "RpcClient",
    "RpcServer",
    "TaskUnavailableError",
]
