"""An impostor task: a real gRPC server at a task's address that does not hold the cluster token.

It answers every ``/phalanx.Task/<method>`` with a reply whose pickled payload writes a canary
file when unpickled, and records each call it receives (method and metadata) in a log file,
so a test can prove that no request reached it (no token, no body) and that its reply was
never unpickled (no canary). It speaks plaintext gRPC, or TLS with a certificate of its own CA
(what an attacker who cannot derive the cluster CA can present).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import pickle
import threading
from concurrent import futures
from pathlib import Path

import grpc
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from phalanx.ps import wire


class _Canary:
    """Unpickling it writes ``path``: the proof that an impostor's reply ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "the impostor's reply was unpickled"))


def own_tls_identity(host: str = "127.0.0.1") -> tuple[bytes, bytes]:
    """A self-signed certificate for ``host`` and its key (PEM): not of the cluster CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "phalanx task")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


class Impostor(grpc.GenericRpcHandler):
    """A fake task at ``address`` (``tls``: with its own certificate; else plaintext)."""

    def __init__(self, address: str, canary: Path, log: Path, tls: bool) -> None:
        self.canary, self.log = canary, log
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((self,))
        if tls:
            cert, key = own_tls_identity(address.rsplit(":", 1)[0])
            bound = self._server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = self._server.add_insecure_port(address)
        assert bound, f"the impostor could not listen at {address}"
        self._server.start()

    def service(self, handler_call_details):
        def answer(request: bytes, context) -> bytes:
            with self._lock, self.log.open("a") as out:
                pairs = context.invocation_metadata()
                metadata = [[k, v if isinstance(v, str) else v.hex()] for k, v in pairs]
                out.write(json.dumps({"method": handler_call_details.method, "metadata": metadata}) + "\n")
            payload = pickle.dumps(_Canary(str(self.canary)))
            return wire.pack({"ok": True}, [torch.frombuffer(bytearray(payload), dtype=torch.uint8)])

        return grpc.unary_unary_rpc_method_handler(answer)

    def calls(self) -> list[dict]:
        """Every call it received."""
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        self._server.stop(0).wait()
