"""The errors of the parameter-server transport, and how gRPC's statuses become them.

A handler's exception comes back as `RemoteError` (its type, message and traceback); an
unreachable or silent task as `TaskUnavailableError`; a task that refused this process's
credentials as `AuthenticationError`; a task that could not prove it holds the cluster's
credentials (an impostor at its address, or another cluster's task) as
`PeerAuthenticationError`; a message over the size limit as `MessageTooLargeError`.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

import grpc

from phalanx.security.channels import INSECURE_ENV, MAX_MESSAGE_ENV, is_handshake_failure

__all__ = [
    "AuthenticationError",
    "MessageTooLargeError",
    "PeerAuthenticationError",
    "RemoteError",
    "TaskUnavailableError",
    "client_error",
    "error_details",
    "peer_not_authenticated",
    "remote_error",
    "too_large",
]

_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
# an error's details travel percent-encoded in a trailer, and gRPC drops the whole status past 16 KiB
# of metadata: (message, traceback) characters to keep, tried in turn until the details fit
_DETAILS_BUDGET = ((2000, 6000), (1000, 2000), (300, 0))
_DETAILS_MAX = 8000


class TaskUnavailableError(RuntimeError):
    """A task could not be reached, lost its connection, or did not answer in time."""


class RemoteError(RuntimeError):
    """A task's handler raised; ``remote_type`` and ``remote_traceback`` tell what and where."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type, self.remote_traceback = remote_type, remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        # keeps the remote type and traceback when a worker sends this error on to the coordinator
        return type(self), (str(self), self.remote_type, self.remote_traceback)


class AuthenticationError(PermissionError):
    """A task refused this process's credentials (or this process presented none)."""


class PeerAuthenticationError(AuthenticationError):
    """The process at a task's address did not prove that it holds the cluster's credentials
    (the TLS handshake failed): nothing of the request was sent and nothing of it was read.

    Not a `TaskUnavailableError`: waiting for the task to come back cannot help while something
    else holds its address. ``task`` names it."""

    def __init__(self, message: str, task: str = "") -> None:
        super().__init__(message)
        self.task = task

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.task)


class MessageTooLargeError(ValueError):
    """A request or reply is larger than ``PHALANX_MAX_MESSAGE_BYTES`` allows."""


def too_large(what: str, size: int, limit: int) -> MessageTooLargeError:
    """The error for a message of ``size`` bytes over ``limit``."""
    return MessageTooLargeError(
        f"{what} is {size} bytes, more than the {limit} bytes {MAX_MESSAGE_ENV} allows. Received: a "
        f"message of {size} bytes. HINT: set {MAX_MESSAGE_ENV} higher (up to {(1 << 31) - 1}) on every "
        "task of the cluster, or split the variable over more ps tasks (a variable_partitioner)."
    )


def error_details(exc: BaseException) -> str:
    """The JSON a client turns back into a `RemoteError`, small enough for a gRPC trailer."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    message = str(exc)
    for message_chars, trace_chars in _DETAILS_BUDGET:
        details = json.dumps(
            {
                "type": type(exc).__name__,
                "message": _shorten(message, message_chars),
                "traceback": trace[-trace_chars:] if trace_chars else "",  # the innermost frames
            }
        )
        if len(details) + 2 * details.count("%") <= _DETAILS_MAX:  # JSON is ASCII: only % is encoded
            break
    return details


def _shorten(text: str, chars: int) -> str:
    return text if len(text) <= chars else f"{text[:chars]}... ({len(text) - chars} more characters)"


def client_error(
    name: str, address: str, method: str, exc: grpc.RpcError, limit: float, waited: float
) -> Exception:
    """The exception a client raises for a failed call of ``method`` on task ``name``."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(
            f"{name} refused this process's cluster token ({method}): {details}. HINT: every task "
            "of the cluster must use the same PHALANX_CLUSTER_TOKEN."
        )
    if code == grpc.StatusCode.UNAVAILABLE and is_handshake_failure(details):
        return peer_not_authenticated(name, address, method, details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        return MessageTooLargeError(
            f"{method} on {name}: a message was larger than a side's limit ({details}). HINT: set "
            f"{MAX_MESSAGE_ENV} to the same, larger value on every task of the cluster."
        )
    if code in _UNAVAILABLE:
        return _unavailable(name, address, method, code, details, limit, waited)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return _unknown_method(name, address, method, details)
    return remote_error(name, method, details, code.name if code else "Error")


def remote_error(name: str, method: str, details: str, fallback_type: str = "Error") -> Exception:
    """The exception for `error_details` JSON that task ``name`` sent back for ``method``."""
    try:
        info = json.loads(details)
        remote_type, message, trace = info["type"], info["message"], info["traceback"]
    except (ValueError, KeyError, TypeError):
        remote_type, message, trace = fallback_type, details, ""
    if remote_type == MessageTooLargeError.__name__:
        return MessageTooLargeError(f"{method} on {name} failed: {message}")
    return RemoteError(f"{method} on {name} failed: {remote_type}: {message}", remote_type, trace)


def peer_not_authenticated(name: str, address: str, method: str, details: str) -> PeerAuthenticationError:
    """The error for a server at ``address`` that failed the TLS handshake."""
    return PeerAuthenticationError(
        f"{name} did not prove that it holds this cluster's credentials ({method}), so nothing of the "
        f"request was sent and nothing of a reply was read. Received: a failed TLS handshake with "
        f"{address} ({details}). HINT: every task of the cluster needs the same PHALANX_CLUSTER_TOKEN "
        f"(or the same certificate files) and the same {INSECURE_ENV} setting; if they have them, "
        "another process listens at that task's address: stop it, and check that nothing else takes "
        "the task's port.",
        name,
    )


def _unavailable(
    name: str,
    address: str,
    method: str,
    code: grpc.StatusCode,
    details: str,
    limit: float,
    waited: float,
) -> TaskUnavailableError:
    what = (
        f"did not answer {method} within the {limit:g}s deadline"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED
        else f"is unreachable: {method} failed after {waited:.3g}s"
    )
    return TaskUnavailableError(
        f"{name} {what} ({code.name}: {details}). HINT: check that the task is running and "
        f"reachable at {address}, its address in the cluster spec; a slow call needs a longer "
        "timeout. A task that closes every connection at once may refuse this process's "
        "credentials (the same PHALANX_CLUSTER_TOKEN is needed everywhere)."
    )


def _unknown_method(name: str, address: str, method: str, details: str) -> RemoteError:
    try:
        methods = ", ".join(json.loads(details)["methods"]) or "none"
    except (ValueError, KeyError, TypeError):
        methods = f"unknown ({details})"
    return RemoteError(
        f"{method} on {name} failed: the task has no method {method!r} (it serves: {methods}). "
        f"HINT: check that {address} is the task you meant and runs the same phalanx version.",
        "UNIMPLEMENTED",
    )
