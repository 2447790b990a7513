"""The client half of the parameter server's gRPC (`phalanx.ps.transport` for the whole picture):
`RpcClient` calls one task, on its data path for the methods the task announces there."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import grpc
import torch

from phalanx.ps import wire
from phalanx.ps.data_path.client import DataClient, DataConnectError, Watch
from phalanx.ps.data_path.server import data_path_mode
from phalanx.ps.rpc.common import DATA_PATH_METHOD, DATA_PATH_METHODS, SERVICE, as_is
from phalanx.ps.rpc.errors import (
    AuthenticationError,
    RemoteError,
    TaskUnavailableError,
    client_error,
    peer_not_authenticated,
    too_large,
)
from phalanx.security import channels as security
from phalanx.security.token import check_token

__all__ = ["PendingCall", "RpcClient"]

log = logging.getLogger("phalanx")

# a task that restarts is reachable again within a second, not after gRPC's default backoff (2
# min). grpc.min_reconnect_backoff_ms is gRPC's MIN_CONNECT_TIMEOUT, the least time one attempt
# (TCP and the TLS handshake) is given: kept at gRPC's 20 s, since at 100 ms a handshake slowed
# by a loaded machine failed and read as a peer without the cluster's credentials
_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 20_000),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_ADDRESS = re.compile(r"(\[[0-9A-Za-z:.%]+\]|[^\s:\[\]/]+):(\d{1,5})")
_PROBE = "__phalanx_probe__"  # a method no task serves: its answer proves the handshake passed


class RpcClient:
    """Calls the methods of one task. Thread-safe: one client serves every thread.

    The task must prove, in the TLS handshake, that it holds the cluster's credentials and
    is the host of ``address``, before this client sends anything or reads a reply (in
    plaintext mode, nothing is proved: see `phalanx.security.channels`).

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
        check_token(token)  # 16+ printable ASCII characters
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
                    f"/{SERVICE}/{method}", request_serializer=as_is, response_deserializer=as_is
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
        return self._call(method, header, tensors, limit, wait_for_ready, None)

    def call_watched(
        self,
        method: str,
        header: Mapping[str, Any] | None,
        tensors: Sequence[torch.Tensor],
        *,
        timeout: float,
        every: float,
        on_wait: Callable[[], None],
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """`call`, with ``on_wait()`` run on this thread every ``every`` seconds until the reply
        comes (the chief's heartbeat while a worker runs a function): what it raises ends the
        call (gRPC's is cancelled, the data path's connection closed) and is raised unchanged.
        No thread is used on either path.

        Raises:
            As `call`, and what ``on_wait`` raises.
        """
        return self._call(method, header, tensors, timeout, False, (every, on_wait))

    def _call(
        self,
        method: str,
        header: Mapping[str, Any] | None,
        tensors: Sequence[torch.Tensor],
        limit: float,
        wait_for_ready: bool,
        watch: Watch | None,
    ) -> tuple[dict[str, Any], list[torch.Tensor]]:
        if not wait_for_ready and method in DATA_PATH_METHODS:
            start = time.monotonic()
            for last in (False, True):
                data = self._data if method in self._on_data_path(limit) else None
                if data is None:
                    break
                try:
                    return data.call(method, dict(header or {}), tensors, limit, watch)
                except DataConnectError:
                    if last:
                        raise
                    self._forget_data_path(data)  # restarted on another port? gRPC tells
            limit = max(limit - (time.monotonic() - start), 0.001)  # the discovery's wait counts
        if watch is not None:
            return _watched(self.start(method, header, tensors, timeout=limit), *watch)
        return self._grpc_call(method, header, tensors, limit, wait_for_ready)

    def begin(
        self,
        method: str,
        header: Mapping[str, Any] | None = None,
        tensors: Sequence[torch.Tensor] = (),
        *,
        timeout: float | None = None,
    ) -> Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]:
        """Starts `call` and returns what waits for its reply (call it once): on the data path
        the request leaves now and no thread is used, so the calls a worker makes to each ps
        task in one round go out together; elsewhere the whole call runs when its reply is
        asked for.

        Raises:
            As `call`, from this method or from what it returns.
        """
        limit = self._timeout if timeout is None else timeout
        data = self._data if method in DATA_PATH_METHODS and method in self._on_data_path(limit) else None
        if data is not None:
            try:
                finish = data.begin(method, dict(header or {}), tensors, limit)
                return lambda: finish(None)
            except DataConnectError:
                pass  # nothing was sent: `call` asks the task where its data path is now
        return lambda: RpcClient.call(self, method, header, tensors, timeout=timeout)

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


def _watched(
    call: PendingCall, every: float, on_wait: Callable[[], None]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The reply of a gRPC ``call``, running ``on_wait`` every ``every`` seconds meanwhile."""
    while True:
        try:
            return call.result(timeout=every)
        except TimeoutError:
            try:
                on_wait()
            except BaseException:
                call.cancel()
                raise


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
            waited, task = time.monotonic() - self._started, self._client
            raise client_error(task.name, task.address, self._method, exc, self._limit, waited) from None
        return wire.unpack(reply)

    def cancel(self) -> None:
        """Gives up on the call."""
        self._future.cancel()
