"""Transport security settings: message limits, the user's own certificates, the cluster CA."""

from __future__ import annotations

import datetime
import os
import stat

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from phalanx.ps.transport import MessageTooLargeError, PeerAuthenticationError, RpcClient, RpcServer
from phalanx.security import certificates as _certificates
from phalanx.security.certificates import CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV, task_certificate
from phalanx.security.channels import DEFAULT_MAX_MESSAGE_BYTES, MAX_MESSAGE_ENV, max_message_bytes

TOKEN = "test-secret-0123456789"
MIB = 1 << 20


class Handlers:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def methods(self):
        return {"echo": self.echo, "grow": self.grow}

    def echo(self, header, tensors):
        self.calls.append("echo")
        return {}, tensors

    def grow(self, header, tensors):
        self.calls.append("grow")
        return {}, [torch.zeros(header["bytes"], dtype=torch.uint8)]


@pytest.fixture
def handlers():
    return Handlers()


def serve(handlers, token=TOKEN, **kwargs):
    server = RpcServer("127.0.0.1", 0, token, handlers.methods(), name="ps:0 (test)", **kwargs)
    server.start()
    return server


def test_the_message_limit_defaults_to_one_gib_and_is_configurable(monkeypatch):
    monkeypatch.delenv(MAX_MESSAGE_ENV, raising=False)
    assert max_message_bytes() == DEFAULT_MAX_MESSAGE_BYTES == 1 << 30
    monkeypatch.setenv(MAX_MESSAGE_ENV, str(3 * MIB))
    assert max_message_bytes() == 3 * MIB


@pytest.mark.parametrize("value", ["0", "-5", "1k", "4096", str(1 << 31)])
def test_a_message_limit_out_of_range_is_refused(value, monkeypatch):
    monkeypatch.setenv(MAX_MESSAGE_ENV, value)
    with pytest.raises(ValueError, match=rf"{MAX_MESSAGE_ENV} must be a number of bytes .* Received: "):
        RpcClient("127.0.0.1:1", TOKEN, name="x")


def test_a_request_over_the_limit_is_refused_before_it_is_sent(handlers, monkeypatch):
    monkeypatch.setenv(MAX_MESSAGE_ENV, str(MIB))
    server = serve(handlers)
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    with pytest.raises(MessageTooLargeError, match=rf"request of echo to ps:0 \(test\) .* {MAX_MESSAGE_ENV}"):
        client.call("echo", {}, [torch.zeros(MIB, dtype=torch.uint8)])
    with pytest.raises(MessageTooLargeError, match=MAX_MESSAGE_ENV):
        client.start("echo", {}, [torch.zeros(MIB, dtype=torch.uint8)], timeout=5)
    client.call("echo", {}, [torch.zeros(MIB - 1000, dtype=torch.uint8)])  # under the limit: fine
    client.close()
    server.stop(grace=0)
    assert handlers.calls == ["echo"]


def test_a_reply_over_the_limit_names_the_setting(handlers, monkeypatch):
    monkeypatch.setenv(MAX_MESSAGE_ENV, str(MIB))
    server = serve(handlers)
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    with pytest.raises(MessageTooLargeError, match=rf"reply of grow on ps:0 \(test\) .* {MAX_MESSAGE_ENV}"):
        client.call("grow", {"bytes": 2 * MIB})
    client.close()
    server.stop(grace=0)


def test_a_server_with_a_smaller_limit_refuses_the_request_by_its_length(handlers, monkeypatch):
    monkeypatch.setenv(MAX_MESSAGE_ENV, str(MIB))
    server = serve(handlers)
    monkeypatch.setenv(MAX_MESSAGE_ENV, str(8 * MIB))
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    with pytest.raises(MessageTooLargeError, match=rf"larger than .*{MAX_MESSAGE_ENV}"):
        client.call("echo", {}, [torch.zeros(4 * MIB, dtype=torch.uint8)])
    client.close()
    server.stop(grace=0)
    assert handlers.calls == []


# ---------------------------------------------------------------------- certificates
def _write_pki(folder, host="127.0.0.1"):
    """A CA of the user's own and a certificate for ``host``, as PEM files (key 0600)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(7)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "task")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(8)
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(__import__("ipaddress").ip_address(host))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        CA_FILE_ENV: folder / "ca.pem",
        CERT_FILE_ENV: folder / "task.pem",
        KEY_FILE_ENV: folder / "task.key",
    }
    paths[CA_FILE_ENV].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[CERT_FILE_ENV].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(paths[KEY_FILE_ENV], os.O_WRONLY | os.O_CREAT, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
    return {var: str(path) for var, path in paths.items()}


def test_the_users_certificate_files_replace_the_derived_ca(handlers, tmp_path, monkeypatch):
    for var, path in _write_pki(tmp_path).items():
        monkeypatch.setenv(var, path)
    assert stat.S_IMODE(os.stat(os.environ[KEY_FILE_ENV]).st_mode) == 0o600
    server = serve(handlers)
    client = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")
    assert client.call("echo", {}, [torch.ones(2)])[1][0].tolist() == [1.0, 1.0]
    for var in (CA_FILE_ENV, CERT_FILE_ENV, KEY_FILE_ENV):
        monkeypatch.delenv(var)
    derived = RpcClient(f"127.0.0.1:{server.port}", TOKEN, name="ps:0 (test)")  # the token's CA only
    with pytest.raises(PeerAuthenticationError, match="TLS handshake"):
        derived.call("echo")
    client.close()
    derived.close()
    server.stop(grace=0)
    assert handlers.calls == ["echo"]


def test_certificate_files_given_in_part_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(CA_FILE_ENV, str(tmp_path / "ca.pem"))
    unset = rf"together. Received: \['{CERT_FILE_ENV}', '{KEY_FILE_ENV}'\] unset"
    with pytest.raises(ValueError, match=unset):
        RpcClient("127.0.0.1:1", TOKEN, name="x")


def test_an_unreadable_certificate_file_is_named(tmp_path, monkeypatch):
    paths = _write_pki(tmp_path)
    paths[KEY_FILE_ENV] = str(tmp_path / "missing.key")
    for var, path in paths.items():
        monkeypatch.setenv(var, path)
    with pytest.raises(ValueError, match=rf"{KEY_FILE_ENV} names a file that cannot be read.*missing.key"):
        RpcClient("127.0.0.1:1", TOKEN, name="x")


def test_every_holder_of_a_token_derives_the_same_ca_and_others_another():
    first, second = task_certificate(TOKEN, ["10.0.0.1"], env={}), task_certificate(TOKEN, ["n"], env={})
    assert first.ca == second.ca
    assert first.key != second.key  # a fresh key per task
    other = task_certificate("another-secret-0123456789", [], env={})
    assert other.ca != first.ca
    assert TOKEN.encode() not in first.ca + first.chain + first.key


def test_a_task_certificate_names_its_ips_and_host_names():
    cert = x509.load_pem_x509_certificate(
        task_certificate(TOKEN, ["127.0.0.1", "[::1]", "ps-0.svc"], env={}).chain
    )
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "::1"]
    assert names.get_values_for_type(x509.DNSName) == ["ps-0.svc"]
    ca_key, _ = _certificates._cluster_ca(TOKEN)
    ca_key.public_key().verify(cert.signature, cert.tbs_certificate_bytes, ec.ECDSA(hashes.SHA256()))
