"""gRPC between the tasks of a parameter-server cluster: generic unary methods, no codegen.

A request and a reply are one message each: `phalanx.ps.wire` (a JSON header and raw tensor
bytes), sent as ``/phalanx.Task/<method>``. The server checks the caller's token (metadata
``phalanx-token``, compared in constant time) before it looks at the method or decodes
anything. Errors come back named: a handler's exception as `RemoteError` (its type, message
and traceback), an unreachable or silent task as `TaskUnavailableError`, a refused token as
`AuthenticationError`.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, NoReturn

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
# an error's details travel percent-encoded in a trailer, and gRPC drops the whole status past 16 KiB
# of metadata: (message, traceback) characters to keep, tried in turn until the details fit
_DETAILS_BUDGET = ((2000, 6000), (1000, 2000), (300, 0))
_DETAILS_MAX = 8000
_ADDRESS = re.compile(r"(\[[0-9A-Za-z:.%]+\]|[^\s:\[\]/]+):(\d{1,5})")


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
    """A task refused this process's token (or this process sent none)."""


def _identity(data: bytes) -> bytes:
    return data


def _check_token(token: str) -> None:
    hint = "HINT: set PHALANX_CLUSTER_TOKEN to the same secret on every task, e.g. secrets.token_hex(16)."
    if not token:
        raise ValueError(f"A cluster token must not be empty. Received: {token!r}. {hint}")
    if not (token.isascii() and token.isprintable()):
        raise ValueError(
            "A cluster token must be printable ASCII: it travels as a gRPC header. Received: a token of "
            f"{len(token)} characters, some of them not printable ASCII. {hint}"
        )


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("grpc's abort raises")  # not reached


def _error_details(exc: BaseException) -> str:
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


class _Service(grpc.GenericRpcHandler):
    """Routes every ``/phalanx.Task/<method>`` to the server, known method or not, so that
    even a call to a method the task lacks is authenticated first."""

    def __init__(self, serve: Callable[[str, bytes, grpc.ServicerContext], bytes]) -> None:
        self._serve = serve

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        service, _, method = str(handler_call_details.method).lstrip("/").partition("/")
        if service != SERVICE:
            return None

        def serve(request: bytes, context: grpc.ServicerContext) -> bytes:
            return self._serve(method, request, context)

        return grpc.unary_unary_rpc_method_handler(serve, _identity, _identity)


class RpcServer:
    """Serves ``handlers`` at ``host:port`` to callers that present ``token``.

    Handlers run on the server's threads (up to ``max_workers`` at once) and must be thread-safe.
    Only ``host`` is served: all interfaces only when it is ``"0.0.0.0"`` or ``"::"``.

    Args:
        host: The address to listen at (IPv6 with or without brackets).
        port: The port; 0 picks a free one (see `port`).
        token: The cluster's shared secret.
        handlers: Method name -> handler(header, tensors) -> (header, tensors).
        name: This task, for messages (e.g. ``"ps:0 (host:2222)"``).
        max_workers: Threads serving calls at once.

    Raises:
        ValueError: An empty token, or an address that cannot be served (busy, or not this machine's).
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
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"phalanx-rpc {name}")
        self._server = grpc.server(self._executor, options=_SERVER_OPTIONS)
        self._server.add_generic_rpc_handlers((_Service(self._serve),))
        self._port = self._bind(host, port)
        self._stopped = False
        self._terminated = threading.Event()
        self._lock = threading.Lock()

    def _bind(self, host: str, port: int) -> int:
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError as exc:
            bound, reason = 0, f" ({exc})"
        else:
            reason = ""
        if bound == 0:
            self._executor.shutdown(wait=False)
            raise ValueError(
                f"{self.name} cannot listen at {address}{reason}. HINT: check that no other process uses the "
                "port (ss -ltnp) and that the host is an address of this machine."
            )
        return int(bound)

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self._port

    def _serve(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        """One call (a server thread): token, method, then the handler on the decoded request."""
        given = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_bytes, self._token):
            log.warning(
                "%s refused a call to %s from %s: wrong or missing cluster token",
                self.name,
                method,
                context.peer(),
            )
            _abort(
                context, grpc.StatusCode.UNAUTHENTICATED, f"{self.name} refused the caller's cluster token"
            )
        handler = self._handlers.get(method)
        if handler is None:
            _abort(context, grpc.StatusCode.UNIMPLEMENTED, json.dumps({"methods": sorted(self._handlers)}))
        try:
            header, tensors = wire.unpack(request)
            reply_header, reply_tensors = handler(header, tensors)
            return wire.pack(reply_header, reply_tensors)
        except Exception as exc:
            log.debug("%s on %s failed", method, self.name, exc_info=True)
            _abort(context, grpc.StatusCode.INTERNAL, _error_details(exc))

    def start(self) -> None:
        """Starts serving (returns at once)."""
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving (idempotent); calls still running get ``grace`` seconds, then are cancelled."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._server.stop(grace).wait()
        self._executor.shutdown(wait=False)  # gRPC leaves its thread pool running
        self._terminated.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until `stop` finished (True), or ``timeout`` seconds passed (False)."""
        # not gRPC's: it never returns for a server stopped before it started
        return self._terminated.wait(timeout)


class RpcClient:
    """Calls the methods of one task. Thread-safe: one client serves every thread.

    Args:
        address: ``host:port`` of the task (``[::1]:port`` for IPv6).
        token: The cluster's shared secret.
        name: The task, for messages (e.g. ``"ps:0 (host:2222)"``).
        timeout: Default deadline of a call, in seconds.

    Raises:
        ValueError: An empty token, or an address that is not ``host:port``.
    """

    def __init__(self, address: str, token: str, *, name: str, timeout: float = 60.0) -> None:
        _check_token(token)
        if not _ADDRESS.fullmatch(address):
            raise ValueError(
                f"A task's address must be 'host:port' ('[::1]:port' for IPv6). Received: {address!r} for "
                f"{name}. HINT: write the port, e.g. '127.0.0.1:2222', in the cluster spec."
            )
        self.name, self.address, self._timeout = name, address, timeout
        self._metadata = ((TOKEN_KEY, token),)
        self._channel = grpc.insecure_channel(address, options=_CLIENT_OPTIONS)
        self._stubs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _closed_error(self, method: str) -> TaskUnavailableError:
        return TaskUnavailableError(
            f"{self.name} cannot be called ({method}): this process closed its connection. HINT: make "
            "every call before RpcClient.close (or the strategy's close)."
        )

    def _stub(self, method: str) -> Any:
        with self._lock:
            if self._closed:
                raise self._closed_error(method)
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
        """Calls ``method`` with a header and tensors; returns the reply's (any thread).

        Args:
            method: The handler's name on the task.
            header, tensors: The request (see `phalanx.ps.wire.pack`).
            timeout: The call's deadline in seconds (default: the client's).
            wait_for_ready: Wait, within the deadline, for a task that is not reachable yet
                (default: fail at once).

        Raises:
            TaskUnavailableError: The task is unreachable, the connection was lost or closed,
                or no answer within the deadline.
            AuthenticationError: The task refused our token.
            RemoteError: The task's handler raised (or it has no such method).
        """
        limit = self._timeout if timeout is None else timeout
        request = wire.pack(dict(header or {}), tensors)
        stub = self._stub(method)
        start = time.monotonic()
        try:
            reply = stub(request, timeout=limit, metadata=self._metadata, wait_for_ready=wait_for_ready)
        except grpc.RpcError as exc:
            raise self._error(method, exc, limit, time.monotonic() - start) from None
        except ValueError:  # gRPC: "Cannot invoke RPC on closed channel!" (closed meanwhile)
            if self._closed:
                raise self._closed_error(method) from None
            raise
        return wire.unpack(reply)

    def start(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float,
    ) -> PendingCall:
        """Starts a call without waiting for it (no thread is used); see `PendingCall`.

        Raises:
            TaskUnavailableError: This client was closed.
        """
        request = wire.pack(dict(header or {}), tensors)
        stub = self._stub(method)
        try:
            future = stub.future(request, timeout=timeout, metadata=self._metadata)
        except ValueError:  # closed meanwhile, as in `call`
            if self._closed:
                raise self._closed_error(method) from None
            raise
        return PendingCall(self, method, future, timeout)

    def _error(self, method: str, exc: grpc.RpcError, limit: float, waited: float) -> Exception:
        code = exc.code() if hasattr(exc, "code") else None
        details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return AuthenticationError(
                f"{self.name} refused this process's cluster token ({method}): {details}. HINT: every task "
                "of the cluster must use the same PHALANX_CLUSTER_TOKEN."
            )
        if code in _UNAVAILABLE:
            return self._unavailable(method, code, details, limit, waited)
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return self._unknown_method(method, details)
        try:
            info = json.loads(details)
            remote_type, message, trace = info["type"], info["message"], info["traceback"]
        except (ValueError, KeyError, TypeError):
            remote_type, message, trace = code.name if code else "Error", details, ""
        return RemoteError(f"{method} on {self.name} failed: {remote_type}: {message}", remote_type, trace)

    def _unavailable(
        self, method: str, code: grpc.StatusCode, details: str, limit: float, waited: float
    ) -> TaskUnavailableError:
        what = (
            f"did not answer {method} within the {limit:g}s deadline"
            if code == grpc.StatusCode.DEADLINE_EXCEEDED
            else f"is unreachable: {method} failed after {waited:.3g}s"
        )
        return TaskUnavailableError(
            f"{self.name} {what} ({code.name}: {details}). HINT: check that the task is running and "
            f"reachable at {self.address}, its address in the cluster spec; a slow call needs a longer "
            "timeout."
        )

    def _unknown_method(self, method: str, details: str) -> RemoteError:
        try:
            methods = ", ".join(json.loads(details)["methods"]) or "none"
        except (ValueError, KeyError, TypeError):
            methods = f"unknown ({details})"
        return RemoteError(
            f"{method} on {self.name} failed: the task has no method {method!r} (it serves: {methods}). "
            f"HINT: check that {self.address} is the task you meant and runs the same phalanx version.",
            "UNIMPLEMENTED",
        )

    def wait_until_ready(self, timeout: float) -> None:
        """Returns once the task accepts connections (the token is not checked).

        Raises:
            TaskUnavailableError: Not within ``timeout`` seconds (the task is named), or closed.
        """
        if self._closed:
            raise self._closed_error("wait_until_ready")
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TaskUnavailableError(
                f"{self.name} was not reachable within {timeout:g}s at {self.address}. HINT: start every "
                "task of the cluster and check its address in the cluster spec (TF_CONFIG)."
            ) from None

    def close(self) -> None:
        """Closes the connection (idempotent); calls still running are cancelled."""
        with self._lock:
            self._closed = True
        self._channel.close()


class PendingCall:
    """A call started by `RpcClient.start`."""

    def __init__(self, client: RpcClient, method: str, future: Any, limit: float) -> None:
        self._client, self._method, self._future, self._limit = client, method, future, limit
        self._started = time.monotonic()

    def result(self, timeout: float) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The reply, once it came.

        Raises:
            TimeoutError: Not within ``timeout`` seconds (the call goes on).
            TaskUnavailableError: As `RpcClient.call`, or the call was cancelled.
            AuthenticationError, RemoteError: As `RpcClient.call`.
        """
        try:
            reply = self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"{self._method} on {self._client.name} is still running") from None
        except grpc.FutureCancelledError:
            raise TaskUnavailableError(
                f"{self._method} on {self._client.name} was cancelled (by PendingCall.cancel or "
                "RpcClient.close)."
            ) from None
        except grpc.RpcError as exc:
            waited = time.monotonic() - self._started
            raise self._client._error(self._method, exc, self._limit, waited) from None
        return wire.unpack(reply)

    def cancel(self) -> None:
        """Gives up on the call."""
        self._future.cancel()
