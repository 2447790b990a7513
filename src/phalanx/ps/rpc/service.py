"""The server half of the parameter server's gRPC (`phalanx.ps.transport` for the whole picture):
`RpcServer` serves a task's handlers to authenticated peers, and its data path beside them."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import NoReturn

import grpc

from phalanx.ps import wire
from phalanx.ps.data_path.server import DataServer, data_path_mode
from phalanx.ps.rpc.common import DATA_PATH_METHOD, SERVICE, Handler, as_is
from phalanx.ps.rpc.errors import error_details, too_large
from phalanx.security import channels as security
from phalanx.security.token import check_token

__all__ = ["RpcServer"]

log = logging.getLogger("phalanx")

# SO_REUSEPORT would let a second server share a busy port and take half of its calls
_NO_REUSEPORT = [("grpc.so_reuseport", 0)]


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

        return grpc.unary_unary_rpc_method_handler(serve, as_is, as_is)


class RpcServer:
    """Serves ``handlers`` at ``host:port`` to peers that hold the cluster's credentials.

    Handlers run on the server's threads (up to ``max_workers`` at once) and must be thread-safe.
    Only ``host`` is served: all interfaces only when it is ``"0.0.0.0"`` or ``"::"``. A peer
    is authenticated before its request is read: by the TLS handshake (its certificate must
    come from the cluster CA), or in plaintext mode by `phalanx.security.channels.TokenInterceptor`.

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
        data_methods: The methods also served on the data path (`phalanx.ps.data_path.server`):
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
        check_token(token)
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
        if not served:  # a task that serves none of them
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
