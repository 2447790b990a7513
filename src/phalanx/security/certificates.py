"""TLS certificates of a cluster's tasks: a cluster CA derived from the token, or the user's own.

Every task of a cluster holds the same secret (``PHALANX_CLUSTER_TOKEN``). From it, each task
derives the same *cluster CA* key (scrypt, then an ECDSA P-256 scalar) and issues itself a
fresh certificate signed by that CA, naming the host its cluster spec gives it. Mutual TLS
against that CA then proves, in the handshake and before any request byte moves, that both
ends hold the token, without the token itself ever crossing the network; nothing is written
to disk and nothing needs provisioning beyond the token (docs/security.md, *Transport*).

A site with its own PKI gives every task its files instead (``PHALANX_TLS_CA_FILE``,
``PHALANX_TLS_CERT_FILE``, ``PHALANX_TLS_KEY_FILE``, PEM): then only that CA is trusted.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from phalanx import settings

__all__ = ["CA_FILE_ENV", "CERT_FILE_ENV", "KEY_FILE_ENV", "TaskCertificate", "task_certificate"]

CA_FILE_ENV = "PHALANX_TLS_CA_FILE"
CERT_FILE_ENV = "PHALANX_TLS_CERT_FILE"
KEY_FILE_ENV = "PHALANX_TLS_KEY_FILE"
_FILE_VARS = (CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV)
# the order of P-256: the derived scalar must lie in [1, n - 1]
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
_SALT = b"phalanx cluster CA v1"
_CA_NAME = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "phalanx cluster CA")])
_EPOCH, _END = datetime.datetime(2020, 1, 1), datetime.datetime(2120, 1, 1)


@dataclass(frozen=True)
class TaskCertificate:
    """What one task presents and trusts (PEM bytes): the CA, its certificate, its key."""

    ca: bytes
    chain: bytes
    key: bytes
    source: str  # for messages: "derived from PHALANX_CLUSTER_TOKEN" or the files


@functools.lru_cache(maxsize=4)
def _cluster_ca(token: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The CA every holder of ``token`` derives alike (cached: scrypt costs ~0.1 s on purpose,
    so that a token cannot be searched for quickly from a certificate seen on the wire)."""
    seed = hashlib.scrypt(token.encode(), salt=_SALT, n=2**14, r=8, p=1, dklen=48)
    key = ec.derive_private_key(int.from_bytes(seed, "big") % (_P256_ORDER - 1) + 1, ec.SECP256R1())
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_CA_NAME)
        .issuer_name(_CA_NAME)
        .public_key(public)
        .serial_number(1)
        .not_valid_before(_EPOCH)
        .not_valid_after(_END)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _usage(cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _subject_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """IP addresses as IP entries (what TLS checks for an address), the rest as DNS names."""
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(n.strip("[]") for n in names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return entries


def _issue(token: str, names: Sequence[str]) -> TaskCertificate:
    ca_key, ca_cert = _cluster_ca(token)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "phalanx task")]))
        .issuer_name(_CA_NAME)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # a day of slack: the nodes' clocks need not agree to the second
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(cert_sign=False), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(_subject_names(names)), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return TaskCertificate(
        ca=ca_cert.public_bytes(serialization.Encoding.PEM),
        chain=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        source="the cluster CA derived from PHALANX_CLUSTER_TOKEN",
    )


def _from_files(env: Mapping[str, str]) -> TaskCertificate | None:
    """The user's certificate files, when any of the three variables is set.

    Raises:
        ValueError: Only some of the variables are set, or a file cannot be read.
    """
    given = {var: env.get(var, "") for var in _FILE_VARS}
    if not any(given.values()):
        return None
    missing = [var for var, path in given.items() if not path]
    hint = "HINT: set all three (PEM files: the CA, this task's certificate chain, its private key), or none."
    if missing:
        raise ValueError(
            f"TLS certificate files are given by {CA_FILE_ENV}, {CERT_FILE_ENV} and {KEY_FILE_ENV} together. "
            f"Received: {missing} unset. {hint}"
        )
    contents = {}
    for var, path in given.items():
        try:
            contents[var] = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(
                f"{var} names a file that cannot be read. Received: {path!r} ({exc}). {hint}"
            ) from None
    return TaskCertificate(
        ca=contents[CA_FILE_ENV],
        chain=contents[CERT_FILE_ENV],
        key=contents[KEY_FILE_ENV],
        source=f"the files of {CA_FILE_ENV}/{CERT_FILE_ENV}/{KEY_FILE_ENV}",
    )


def task_certificate(
    token: str, names: Sequence[str] = (), env: Mapping[str, str] | None = None
) -> TaskCertificate:
    """This task's TLS identity: the user's files if configured, else a fresh certificate for
    ``names`` (its host as the cluster spec spells it) signed by the token's cluster CA.

    Args:
        token: The cluster's secret (checked by the caller).
        names: Host names or IP addresses the certificate must carry (a server's address).
        env: The environment (default: ``os.environ``).

    Raises:
        ValueError: Certificate files configured only in part, or unreadable.
    """
    given = _from_files(settings.current().tls_files if env is None else env)
    return given if given is not None else _issue(token, names)
