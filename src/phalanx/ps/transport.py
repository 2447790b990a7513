"""gRPC between the tasks of a parameter-server cluster: generic unary methods, no codegen.

A request and a reply are one message each: `phalanx.ps.wire` (a JSON header and raw tensor
bytes), sent as ``/phalanx.Task/<method>``. Both ends authenticate each other before a byte
of a request or reply is exchanged: mutual TLS against the cluster CA (derived from
``PHALANX_CLUSTER_TOKEN``, or the user's certificate files), or, with the plaintext opt-out
``PHALANX_INSECURE_TRANSPORT=1``, the token in metadata checked by a server interceptor
before the body is read (`phalanx.ps.channel_security`). Every message is bounded by
``PHALANX_MAX_MESSAGE_BYTES``. Errors come back named (`phalanx.ps.rpc_errors`): a handler's
exception as `RemoteError`, an unreachable or silent task as `TaskUnavailableError`, refused
credentials as `AuthenticationError`, a peer that did not prove it holds the credentials as
`PeerAuthenticationError`, an oversized message as `MessageTooLargeError`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any, NoReturn

import grpc
import torch

from phalanx.cluster._token import check_token
from phalanx.ps import channel_security as security
from phalanx.ps import wire
from phalanx.ps.data_client import DataClient, DataConnectError
from phalanx.ps.data_server import DataServer, data_path_mode
from phalanx.ps.rpc_errors import (
    AuthenticationError,
    MessageTooLargeError,
    PeerAuthenticationError,
    RemoteError,
    TaskUnavailableError,
    client_error,
    error_details,
    peer_not_authenticated,
    too_large,
)

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

log = logging.getLogger("phalanx")

Handler = Callable[
    [dict[str, Any], list[torch.Tensor]], tuple[dict[str, Any], list[torch.Tensor]] | wire.Packed
]
SERVICE = "phalanx.Task"
# a task that restarts is reachable again within a second, not after gRPC's default backoff (2 min)
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# SO_REUSEPORT would let a second server share a busy port and take half of its calls
_NO_REUSEPORT = [("grpc.so_reuseport", 0)]
_ADDRESS = re.compile(r"(\[[0-9A-Za-z:.%]+\]|[^\s:\[\]/]+):(\d{1,5})")
_PROBE = "__phalanx_probe__"  # a method no task serves: its answer proves the handshake passed
DATA_PATH_METHOD = "__data_path__"  # where a task's data path listens, and for which methods
# the methods a client asks a task's data path for (a ps task's reads and writes)
DATA_PATH_METHODS = frozenset(
    {"read", "read_if_newer", "read_rows", "apply_gradients", "assign", "assign_add", "create"}
)


def _identity(data: bytes) -> bytes:
    return data


def _check_token(token: str) -> None:
    check_token(token)  # the same rules as PHALANX_CLUSTER_TOKEN: 16+ printable ASCII characters


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("grpc's abort raises")  # not reached


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
    """Serves ``handlers`` at ``host:port`` to peers that hold the cluster's credentials.

    Handlers run on the server's threads (up to ``max_workers`` at once) and must be thread-safe.
    Only ``host`` is served: all interfaces only when it is ``"0.0.0.0"`` or ``"::"``. A peer
    is authenticated before its request is read: by the TLS handshake (its certificate must
    come from the cluster CA), or in plaintext mode by `channel_security.TokenInterceptor`.

    Args:
        host: The address to listen at (IPv6 with or without brackets).
        port: The port; 0 picks a free one (see `port`).
        token: The cluster's shared secret.
        handlers: Method name -> handler(header, tensors) -> (header, tensors), or the reply
            already packed (`phalanx.ps.wire.Packed`).
        name: This task, for messages (e.g. ``"ps:0 (host:2222)"``).
        max_workers: Threads serving calls at once.
        names: The host names or addresses clients dial this task by, which its TLS
            certificate carries (default: ``host``).
        data_methods: The methods also served on the data path (`phalanx.ps.data_server`):
            tensor bytes without gRPC's copies, unless ``PHALANX_PS_DATA_PATH=grpc``.

    Raises:
        ValueError: A token shorter than 16 characters or not printable ASCII, bad
            ``PHALANX_INSECURE_TRANSPORT``/``PHALANX_MAX_MESSAGE_BYTES`` values, or an address
            that cannot be served (busy, or not this machine's).
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
        names: Sequence[str] | None = None,
        data_methods: Sequence[str] = (),
    ) -> None:
        _check_token(token)
        self.name = name
        self._handlers = dict(handlers)
        self._limit = security.max_message_bytes()
        insecure = security.insecure_transport()
        self._data = self._data_server(host, token, names or [host], data_methods, insecure)
        interceptors = (security.TokenInterceptor(token, name),) if insecure else ()
        self._executor = futures.ThreadPoolExecutor(max_workers, thread_name_prefix=f"phalanx-rpc {name}")
        self._server = grpc.server(
            self._executor,
            options=[*security.size_options(self._limit), *_NO_REUSEPORT],
            interceptors=interceptors,
        )
        self._server.add_generic_rpc_handlers((_Service(self._serve),))
        credentials = None if insecure else security.server_credentials(token, names or [host])
        self._port = self._bind(host, port, credentials)
        if insecure:
            security.warn_insecure(name, server=True)
        self._stopped = False
        self._terminated = threading.Event()
        self._lock = threading.Lock()

    def _data_server(
        self, host: str, token: str, names: Sequence[str], methods: Sequence[str], insecure: bool
    ) -> DataServer | None:
        """The data path for ``methods`` (announced by the ``__data_path__`` method), if any."""
        if not methods or data_path_mode() == "grpc":
            return None
        served = {m: self._handlers[m] for m in methods if m in self._handlers}
        if not served:  # a worker task: its calls are small, and gRPC's (docs/performance.md)
            return None
        data = DataServer(host, token, names, served, name=self.name, limit=self._limit, insecure=insecure)
        announce = {"port": data.port, "methods": sorted(served)}
        self._handlers[DATA_PATH_METHOD] = lambda header, tensors: (announce, [])
        return data

    def _bind(self, host: str, port: int, credentials: grpc.ServerCredentials | None) -> int:
        address = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        try:
            if credentials is None:
                bound = self._server.add_insecure_port(address)
            else:
                bound = self._server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            bound, reason = 0, f" ({exc})"
        else:
            reason = ""
        if bound == 0:
            self._executor.shutdown(wait=False)
            if self._data is not None:
                self._data.stop()
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
        """One call from an authenticated peer (a server thread): method, then the handler on
        the decoded request."""
        handler = self._handlers.get(method)
        if handler is None:
            _abort(context, grpc.StatusCode.UNIMPLEMENTED, json.dumps({"methods": sorted(self._handlers)}))
        try:
            header, tensors = wire.unpack(request)
            result = handler(header, tensors)
            reply = result.data if isinstance(result, wire.Packed) else wire.pack(*result)
            if len(reply) > self._limit:
                raise too_large(f"The reply of {method} on {self.name}", len(reply), self._limit)
            return bytes(reply)  # a handler packs into new bytes here (no reply destination)
        except Exception as exc:
            log.debug("%s on %s failed", method, self.name, exc_info=True)
            _abort(context, grpc.StatusCode.INTERNAL, error_details(exc))

    def start(self) -> None:
        """Starts serving (returns at once)."""
        self._server.start()
        if self._data is not None:
            self._data.start()

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving (idempotent); calls still running get ``grace`` seconds, then are cancelled."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if self._data is not None:
            self._data.stop()
        self._server.stop(grace).wait()
        self._executor.shutdown(wait=False)  # gRPC leaves its thread pool running
        self._terminated.set()

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until `stop` finished (True), or ``timeout`` seconds passed (False)."""
        # not gRPC's: it never returns for a server stopped before it started
        return self._terminated.wait(timeout)


class RpcClient:
    """Calls the methods of one task. Thread-safe: one client serves every thread.

    The task must prove, in the TLS handshake, that it holds the cluster's credentials and
    is the host of ``address``, before this client sends anything or reads a reply (in
    plaintext mode, nothing is proved: see `phalanx.ps.channel_security`).

    Args:
        address: ``host:port`` of the task (``[::1]:port`` for IPv6).
        token: The cluster's shared secret.
        name: The task, for messages (e.g. ``"ps:0 (host:2222)"``).
        timeout: Default deadline of a call, in seconds.

    Raises:
        ValueError: A token shorter than 16 characters or not printable ASCII, bad
            ``PHALANX_INSECURE_TRANSPORT``/``PHALANX_MAX_MESSAGE_BYTES`` values, or an
            address that is not ``host:port``.
    """

    def __init__(self, address: str, token: str, *, name: str, timeout: float = 60.0) -> None:
        _check_token(token)
        if not _ADDRESS.fullmatch(address):
            raise ValueError(
                f"A task's address must be 'host:port' ('[::1]:port' for IPv6). Received: {address!r} for "
                f"{name}. HINT: write the port, e.g. '127.0.0.1:2222', in the cluster spec."
            )
        self.name, self.address, self._timeout = name, address, timeout
        self._limit = security.max_message_bytes()
        options = [*security.size_options(self._limit), *_RECONNECT]
        if security.insecure_transport():
            security.warn_insecure(f"This process's connection to {name}", server=False)
            self._metadata: tuple[tuple[str, str], ...] = ((security.TOKEN_KEY, token),)
            self._channel = grpc.insecure_channel(address, options=options)
        else:  # the token stays here: the certificate proves we hold it
            self._metadata = ()
            self._channel = grpc.secure_channel(address, security.channel_credentials(token), options=options)
        self._stubs: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._token = token
        self._data: DataClient | None = None
        self._data_methods: frozenset[str] | None = None if data_path_mode() != "grpc" else frozenset()
        self._data_lock = threading.Lock()

    def _pack(self, method: str, header: Mapping[str, Any] | None, tensors: Sequence[torch.Tensor]) -> bytes:
        request = wire.pack(dict(header or {}), tensors)
        if len(request) > self._limit:
            raise too_large(f"The request of {method} to {self.name}", len(request), self._limit)
        return request

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
            AuthenticationError: The task refused our credentials.
            PeerAuthenticationError: The process at the task's address failed the TLS handshake
                (nothing was sent, nothing is read).
            MessageTooLargeError: The request or the reply exceeds ``PHALANX_MAX_MESSAGE_BYTES``.
            RemoteError: The task's handler raised (or it has no such method).
        """
        limit = self._timeout if timeout is None else timeout
        if not wait_for_ready and method in DATA_PATH_METHODS:
            start = time.monotonic()
            for last in (False, True):
                data = self._data if method in self._on_data_path(limit) else None
                if data is None:
                    break
                try:
                    return data.call(method, dict(header or {}), tensors, limit)
                except DataConnectError:
                    if last:
                        raise
                    self._forget_data_path(data)  # restarted on another port? gRPC tells
            limit = max(limit - (time.monotonic() - start), 0.001)  # the discovery's wait counts
        return self._grpc_call(method, header, tensors, limit, wait_for_ready)

    def _forget_data_path(self, data: DataClient) -> None:
        """Asks the task again where its data path listens, at the next call."""
        with self._data_lock:
            if self._data is data:
                self._data, self._data_methods = None, None
        data.close()

    def _grpc_call(
        self,
        method: str,
        header: Mapping[str, Any] | None,
        tensors: Sequence[torch.Tensor],
        limit: float,
        wait_for_ready: bool,
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        request = self._pack(method, header, tensors)
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

    def _on_data_path(self, timeout: float) -> frozenset[str]:
        """The methods the task serves on its data path (asked once, through gRPC; a task that
        cannot be asked now gets the call on gRPC, which names its error, and is asked again
        at the next call)."""
        methods = self._data_methods
        if methods is not None:
            return methods
        with self._data_lock:
            if self._data_methods is None:
                try:
                    self._data_methods = self._discover(timeout)
                except (TaskUnavailableError, AuthenticationError):
                    return frozenset()
            return self._data_methods

    def _discover(self, timeout: float) -> frozenset[str]:
        try:
            header, _ = self._grpc_call(DATA_PATH_METHOD, None, (), timeout, False)
        except RemoteError as exc:
            if exc.remote_type == "UNIMPLEMENTED":  # a task without a data path
                return frozenset()
            raise
        port: Any = header.get("port")
        methods: Any = header.get("methods")
        if not _announcement_ok(port, methods):  # not a phalanx task of this version
            log.warning(
                "%s announced no usable data path (%s answered %r); its calls stay on gRPC.",
                self.name,
                DATA_PATH_METHOD,
                header,
            )
            return frozenset()
        host = _ADDRESS.fullmatch(self.address).group(1)  # type: ignore[union-attr]
        self._data = DataClient(
            host,
            int(port),
            self._token,
            name=self.name,
            address=self.address,
            limit=self._limit,
            insecure=security.insecure_transport(),
            segments=data_path_mode() == "auto",
        )
        return frozenset(methods)

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
            MessageTooLargeError: The request exceeds ``PHALANX_MAX_MESSAGE_BYTES``.
        """
        request = self._pack(method, header, tensors)
        stub = self._stub(method)
        try:
            future = stub.future(request, timeout=timeout, metadata=self._metadata)
        except ValueError:  # closed meanwhile, as in `call`
            if self._closed:
                raise self._closed_error(method) from None
            raise
        return PendingCall(self, method, future, timeout)

    def _error(self, method: str, exc: grpc.RpcError, limit: float, waited: float) -> Exception:
        return client_error(self.name, self.address, method, exc, limit, waited)

    def wait_until_ready(self, timeout: float) -> None:
        """Returns once the task accepts connections and (with TLS) proved that it holds the
        cluster's credentials; an impostor at its address is reported at once.

        Raises:
            TaskUnavailableError: Not within ``timeout`` seconds (the task is named), or closed.
            PeerAuthenticationError: What listens at the address failed the TLS handshake.
        """
        if self._closed:
            raise self._closed_error("wait_until_ready")
        deadline = time.monotonic() + timeout
        ready = grpc.channel_ready_future(self._channel)
        try:
            while True:
                try:
                    ready.result(timeout=max(min(deadline - time.monotonic(), 0.5), 0.001))
                    return
                except grpc.FutureTimeoutError:
                    self._raise_if_impostor()
                if time.monotonic() >= deadline:
                    raise TaskUnavailableError(
                        f"{self.name} was not reachable within {timeout:g}s at {self.address}. HINT: start "
                        "every task of the cluster and check its address in the cluster spec (TF_CONFIG)."
                    )
        finally:
            ready.cancel()  # no-op once it matured; else stops watching the channel

    def _raise_if_impostor(self) -> None:
        """Raises `PeerAuthenticationError` if the channel's last connection attempt failed in the
        TLS handshake (a call on a failing channel fails at once with that attempt's error)."""
        try:
            self._stub(_PROBE)(b"", timeout=0.5, metadata=self._metadata)
        except grpc.RpcError as exc:
            details = (exc.details() if hasattr(exc, "details") else None) or ""
            if exc.code() == grpc.StatusCode.UNAVAILABLE and security.is_handshake_failure(details):
                raise peer_not_authenticated(self.name, self.address, "wait_until_ready", details) from None

    def close(self) -> None:
        """Closes the connection (idempotent); calls still running are cancelled."""
        with self._lock:
            self._closed = True
        if self._data is not None:
            self._data.close()
        self._channel.close()


def _announcement_ok(port: Any, methods: Any) -> bool:
    """Whether a ``__data_path__`` reply names a port and a list of method names."""
    return (
        isinstance(port, int)
        and 0 < port < 65536
        and isinstance(methods, list)
        and all(isinstance(m, str) for m in methods)
    )


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
            AuthenticationError, MessageTooLargeError, RemoteError: As `RpcClient.call`.
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
