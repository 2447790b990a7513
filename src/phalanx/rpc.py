"""Calling registered functions on another process (tf.distribute.experimental.rpc).

    # the process that serves
    server = phalanx.experimental.rpc.Server.create("grpc", "127.0.0.1:5005")
    server.register("multiply", lambda a, b: a * b)
    server.start()

    # a client
    client = phalanx.experimental.rpc.Client.create("grpc", "127.0.0.1:5005")
    result = client.call("multiply", [torch.tensor(2.0), torch.tensor(3.0)])
    result.is_ok(), result.get_value()   # True, tensor(6.)
    client.multiply(torch.tensor(2.0), torch.tensor(3.0))   # the same, raising on error

Arguments and results are tensors (a result may nest them in tuples, lists and dicts), as
in TF. The calls go over phalanx's gRPC transport (`phalanx.ps.transport`): both ends prove
they hold ``PHALANX_CLUSTER_TOKEN`` in a mutual TLS handshake before any byte is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from phalanx.ps.rpc.errors import RemoteError, TaskUnavailableError
from phalanx.ps.transport import RpcClient, RpcServer
from phalanx.security.token import cluster_token

__all__ = ["Client", "Server", "StatusOrResult"]

_LIST = "__list_registered_methods"
DEFAULT_TIMEOUT_SECONDS = 600.0  # timeout_in_ms=0: TF waits forever; phalanx bounds every wait
# TF's error codes (tensorflow/core/protobuf/error_codes.proto), as get_error() reports them.
NOT_FOUND, INTERNAL, UNAVAILABLE = 5, 13, 14


def _check_layer(rpc_layer: str) -> None:
    if rpc_layer != "grpc":
        raise ValueError(f"The only rpc_layer is 'grpc' (as in TF). Received: {rpc_layer!r}.")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"An rpc address must be host:port. Received: {address!r}.")
    return host.strip("[]"), int(port)


def _flatten(value: Any, what: str) -> tuple[list[torch.Tensor], str]:
    leaves, spec = pytree.tree_flatten(value)
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"rpc {what} must be tensors (nested in tuples, lists or dicts), as in TF. "
                f"Received a {type(leaf).__name__}. HINT: wrap numbers in torch.tensor(...)."
            )
    return leaves, pytree.treespec_dumps(spec)


class StatusOrResult:
    """What `Client.call` returns: the result, or the error that prevented it."""

    def __init__(self, value: Any = None, error: tuple[int, str] | None = None) -> None:
        self._value = value
        self._error = error

    def is_ok(self) -> bool:
        """Whether the call succeeded."""
        return self._error is None

    def get_error(self) -> tuple[int, str]:
        """``(code, message)`` of the failure, with TF's error codes; ``(0, "")`` when ok."""
        return self._error or (0, "")

    def get_value(self) -> Any:
        """The function's result.

        Raises:
            RuntimeError: The call failed (its code and message are in the error).
        """
        if self._error is not None:
            code, message = self._error
            raise RuntimeError(f"The rpc failed (code {code}): {message}")
        return self._value


class Server:
    """Serves registered functions at an address (tf.distribute.experimental.rpc.Server)."""

    def __init__(self, address: str) -> None:
        self._address = address
        self._functions: dict[str, Callable[..., Any]] = {}
        self._server: RpcServer | None = None

    @staticmethod
    def create(rpc_layer: str, address: str) -> Server:
        """A server for ``address`` ("host:port"); register functions, then `start` it.

        Raises:
            ValueError: ``rpc_layer`` is not "grpc".
        """
        _check_layer(rpc_layer)
        _split(address)
        return Server(address)

    def register(self, method_name: str, func: Callable[..., Any]) -> None:
        """Makes ``func(*tensors)`` callable by clients as ``method_name``.

        Raises:
            RuntimeError: The server has started (as in TF, methods are registered before).
            TypeError: ``func`` is not callable.
        """
        if self._server is not None:
            raise RuntimeError(f"Register {method_name!r} before Server.start(): the server is serving.")
        if not callable(func):
            raise TypeError(f"register needs a callable. Received: {type(func).__name__}.")
        self._functions[method_name] = func

    def start(self) -> None:
        """Starts serving (returns at once).

        Raises:
            ValueError: ``PHALANX_CLUSTER_TOKEN`` is unset, or the address cannot be served.
        """
        if self._server is not None:
            return
        handlers: dict[str, Any] = {name: self._handler(fn) for name, fn in self._functions.items()}
        handlers[_LIST] = lambda header, tensors: ({"methods": sorted(self._functions)}, [])
        host, port = _split(self._address)
        self._server = RpcServer(host, port, cluster_token(), handlers, name=f"rpc server ({self._address})")
        self._server.start()

    def stop(self) -> None:
        """Stops serving."""
        if self._server is not None:
            self._server.stop()

    @staticmethod
    def _handler(fn: Callable[..., Any]) -> Callable[[dict[str, Any], list[torch.Tensor]], Any]:
        def handle(
            header: dict[str, Any], tensors: list[torch.Tensor]
        ) -> tuple[dict[str, Any], list[torch.Tensor]]:
            args = pytree.tree_unflatten(tensors, pytree.treespec_loads(header["args"]))
            with torch.no_grad():
                leaves, spec = _flatten(fn(*args), "results")
            return {"result": spec}, leaves

        return handle


class Client:
    """Calls a `Server`'s functions (tf.distribute.experimental.rpc.Client).

    `create` also gives the client one method per registered function, named after it:
    ``client.multiply(a, b)`` returns the result or raises.
    """

    def __init__(self, address: str, name: str = "", timeout_in_ms: int = 0) -> None:
        """Connects to the server at ``address`` and learns its methods; see `create`, TF's
        spelling (which also checks the rpc layer).

        Raises:
            ValueError: ``PHALANX_CLUSTER_TOKEN`` is unset.
            TaskUnavailableError: No server answered in time.
        """
        self._timeout = timeout_in_ms / 1000 if timeout_in_ms > 0 else DEFAULT_TIMEOUT_SECONDS
        self._rpc = RpcClient(
            address, cluster_token(), name=name or f"rpc server ({address})", timeout=self._timeout
        )
        try:
            header, _ = self._rpc.call(_LIST, wait_for_ready=True)
        except BaseException:
            self._rpc.close()
            raise
        self._methods: list[str] = list(header["methods"])
        for method in self._methods:
            if method.isidentifier() and not hasattr(self, method):
                setattr(self, method, self._bound(method))

    @staticmethod
    def create(rpc_layer: str, address: str, name: str = "", timeout_in_ms: int = 0) -> Client:
        """Connects to the server at ``address`` and learns its methods (waits for it to
        start, up to the timeout: ``timeout_in_ms``, or 600 s when 0).

        Raises:
            ValueError: ``rpc_layer`` is not "grpc", or ``PHALANX_CLUSTER_TOKEN`` is unset.
            TaskUnavailableError: No server answered in time.
        """
        _check_layer(rpc_layer)
        return Client(address, name, timeout_in_ms)

    def _bound(self, method: str) -> Callable[..., Any]:
        def call(*args: torch.Tensor) -> Any:
            return self.call(method, list(args)).get_value()

        call.__name__ = method
        return call

    def call(
        self,
        method_name: str,
        args: Sequence[Any] | None = None,
        output_specs: Any = None,
        timeout_in_ms: int = 0,
    ) -> StatusOrResult:
        """Calls ``method_name(*args)`` on the server; never raises for a failed call.

        Args:
            method_name: A registered method.
            args: The tensors to pass.
            output_specs: TF needs the result's TensorSpecs to build its graph; the result
                here describes itself, so this is accepted and not needed.
            timeout_in_ms: This call's deadline (0: the client's).
        """
        del output_specs
        if method_name not in self._methods:
            return StatusOrResult(
                error=(NOT_FOUND, f"No method {method_name!r}; the server has {self._methods}.")
            )
        leaves, spec = _flatten(list(args or ()), "arguments")
        timeout = timeout_in_ms / 1000 if timeout_in_ms > 0 else self._timeout
        try:
            header, tensors = self._rpc.call(method_name, {"args": spec}, leaves, timeout=timeout)
        except RemoteError as error:
            return StatusOrResult(error=(INTERNAL, str(error)))
        except TaskUnavailableError as error:
            return StatusOrResult(error=(UNAVAILABLE, str(error)))
        return StatusOrResult(pytree.tree_unflatten(tensors, pytree.treespec_loads(header["result"])))

    def close(self) -> None:
        """Closes the connection."""
        self._rpc.close()
