"""gRPC between the tasks of a parameter-server cluster: generic unary methods, no codegen.

A request and a reply are one message each: `phalanx.ps.wire` (a JSON header and raw tensor
bytes). The server checks the caller's token (metadata ``phalanx-token``, compared in
constant time) before it decodes anything. Errors come back named: a handler's exception
as `RemoteError` (its type, message and traceback), an unreachable or silent task as
`TaskUnavailableError`, a refused token as `AuthenticationError`.
"""

from __future__ import annotations

import hmac
import json
import logging
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import grpc
import torch

from phalanx.ps import wire

__all__ = [
    "AuthenticationError",
    "Handler",
    "PendingCall",
    "RemoteError",
    "RpcClient",
    "RpcServer",
    "TaskUnavailableError",
]

log = logging.getLogger("phalanx")

Handler = Callable[[dict[str, Any], list[torch.Tensor]], tuple[dict[str, Any], list[torch.Tensor]]]
SERVICE = "phalanx.Task"
TOKEN_KEY = "phalanx-token"  # noqa: S105 - a metadata key, not a secret
_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# a task that restarts is reachable again within a second, not after gRPC's default backoff (2 min)
_CLIENT_OPTIONS = [
    *_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# SO_REUSEPORT would let a second server share a busy port and take half of its calls
_SERVER_OPTIONS = [*_OPTIONS, ("grpc.so_reuseport", 0)]
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}


class TaskUnavailableError(RuntimeError):
    """A task could not be reached, lost its connection, or did not answer in time."""


class RemoteError(RuntimeError):
    """A task's handler raised; ``remote_type`` and ``remote_traceback`` tell what and where."""

    def __init__(self, message: str, remote_type: str = "", remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_type, self.remote_traceback = remote_type, remote_traceback


class AuthenticationError(PermissionError):
    """A task refused this process's token (or this process sent none)."""


def _identity(data: bytes) -> bytes:
    return data


def _check_token(token: str) -> None:
    if not token:
        raise ValueError(
            "A cluster token must not be empty. HINT: set PHALANX_CLUSTER_TOKEN to the same secret "
            "on every task."
        )


class RpcServer:
    """Serves ``handlers`` at ``host:port`` to callers that present ``token``.

    Args:
        host, port: Where to listen (port 0: a free port, see `port`). Only that address.
        token: The cluster's shared secret.
        handlers: Method name -> handler(header, tensors) -> (header, tensors).
        name: This task, for messages (e.g. ``"ps:0 (host:2222)"``).
        max_workers: Threads serving calls at once.

    Raises:
        ValueError: An empty token, or an address that cannot be served.
    """

    def __init__(
        self,
        host: str,
        port: int,
        token: str,
        handlers: Mapping[str, Handler],
        *,
        name: str,
        max_workers: int = 8,
    ) -> None:
        _check_token(token)
        self.name = name
        self._token = token.encode()
        self._handlers = dict(handlers)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers), options=_SERVER_OPTIONS)
        methods = {
            m: grpc.unary_unary_rpc_method_handler(self._serve(m), _identity, _identity) for m in handlers
        }
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self._port = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ValueError(f"{name} cannot listen at {address}: {exc}. HINT: is the port free?") from None
        if self._port == 0:
            raise ValueError(
                f"{name} cannot listen at {address}. HINT: is the port free, and the host this machine's?"
            )
        self._stopped = False
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self._port

    def _serve(self, method: str) -> Callable[[bytes, grpc.ServicerContext], bytes]:
        def serve(request: bytes, context: grpc.ServicerContext) -> bytes:
            given = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
            given_bytes = given.encode() if isinstance(given, str) else bytes(given)
            if not hmac.compare_digest(given_bytes, self._token):
                context.abort(
                    grpc.StatusCode.UNAUTHENTICATED, f"{self.name} refused the caller's cluster token"
                )
            try:
                header, tensors = wire.unpack(request)
                reply_header, reply_tensors = self._handlers[method](header, tensors)
                return wire.pack(reply_header, reply_tensors)
            except Exception as exc:
                log.debug("%s on %s failed", method, self.name, exc_info=True)
                details = {
                    "type": type(exc).__name__,
                    "message": str(exc),
                    "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
                }
                context.abort(grpc.StatusCode.INTERNAL, json.dumps(details))
                raise  # not reached: abort raises

        return serve

    def start(self) -> None:
        """Starts serving."""
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving (idempotent); calls still running get ``grace`` seconds."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.stop(grace).wait()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until the server stopped; False after ``timeout`` seconds."""
        return not self._server.wait_for_termination(timeout)  # grpc answers "timed out"


class RpcClient:
    """Calls the methods of one task. Thread-safe.

    Args:
        address: ``host:port`` of the task.
        token: The cluster's shared secret.
        name: The task, for messages (e.g. ``"ps:0 (host:2222)"``).
        timeout: Default deadline of a call, in seconds.
    """

    def __init__(self, address: str, token: str, *, name: str, timeout: float = 60.0) -> None:
        _check_token(token)
        self.name, self.address, self._timeout = name, address, timeout
        self._metadata = ((TOKEN_KEY, token),)
        self._channel = grpc.insecure_channel(address, options=_CLIENT_OPTIONS)
        self._stubs: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _stub(self, method: str) -> Any:
        with self._lock:
            stub = self._stubs.get(method)
            if stub is None:
                stub = self._channel.unary_unary(
                    f"/{SERVICE}/{method}", request_serializer=_identity, response_deserializer=_identity
                )
                self._stubs[method] = stub
            return stub

    def call(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float | None = None,
        wait_for_ready: bool = False,
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """Calls ``method`` with a header and tensors; returns the reply's.

        ``wait_for_ready``: wait (within the deadline) for a task that is not reachable yet,
        instead of failing at once.

        Raises:
            TaskUnavailableError: The task is unreachable, or no answer within the deadline.
            AuthenticationError: The task refused our token.
            RemoteError: The task's handler raised (or it has no such method).
        """
        limit = self._timeout if timeout is None else timeout
        request = wire.pack(dict(header or {}), tensors)
        start = time.monotonic()
        try:
            reply = self._stub(method)(
                request, timeout=limit, metadata=self._metadata, wait_for_ready=wait_for_ready
            )
        except grpc.RpcError as exc:
            raise self._error(method, exc, time.monotonic() - start) from None
        return wire.unpack(reply)

    def start(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
    ) -> PendingCall:
        """Starts a call without waiting for it (no thread is used); see `PendingCall`."""
        request = wire.pack(dict(header or {}), tensors)
        future = self._stub(method).future(request, timeout=timeout, metadata=self._metadata)
        return PendingCall(self, method, future)

    def _error(self, method: str, exc: grpc.RpcError, waited: float) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(
                f"{self.name} refused this process's cluster token ({method}). HINT: every task of the "
                "cluster must use the same PHALANX_CLUSTER_TOKEN."
            )
        if code in _UNAVAILABLE:
            what = (
                f"did not answer {method} within {waited:.3g}s"
                if code == grpc.StatusCode.DEADLINE_EXCEEDED
                else f"is unreachable: {method} failed after {waited:.3g}s"
            )
            return TaskUnavailableError(
                f"{self.name} {what} ({code}: {details}). HINT: check that the task is running and "
                "reachable at its address in the cluster spec."
            )
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return RemoteError(
                f"{method} on {self.name} failed: the task has no method {method!r}.", "UNIMPLEMENTED"
            )
        try:
            info = json.loads(details or "")
            remote_type, message, trace = info["type"], info["message"], info["traceback"]
        except (ValueError, KeyError, TypeError):
            remote_type, message, trace = code.name if code else "Error", details or "", ""
        return RemoteError(f"{method} on {self.name} failed: {remote_type}: {message}", remote_type, trace)

    def wait_until_ready(self, timeout: float) -> None:
        """Returns once the task accepts connections.

        Raises:
            TaskUnavailableError: Not within ``timeout`` seconds (the task is named).
        """
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TaskUnavailableError(
                f"{self.name} was not reachable within {timeout:g}s. HINT: start every task of the cluster "
                "and check its address in TF_CONFIG."
            ) from None

    def close(self) -> None:
        """Closes the connection (calls still running are cancelled)."""
        self._channel.close()


class PendingCall:
    """A call started by `RpcClient.start`."""

    def __init__(self, client: RpcClient, method: str, future: Any) -> None:
        self._client, self._method, self._future = client, method, future
        self._started = time.monotonic()

    def result(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The reply, once it came.

        Raises:
            TimeoutError: Not within ``timeout`` seconds (the call goes on).
            TaskUnavailableError, AuthenticationError, RemoteError: As `RpcClient.call`.
        """
        try:
            reply = self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"{self._method} on {self._client.name} is still running") from None
        except grpc.RpcError as exc:
            raise self._client._error(self._method, exc, time.monotonic() - self._started) from None
        return wire.unpack(reply)

    def cancel(self) -> None:
        """Gives up on the call."""
        self._future.cancel()
