"""A throwaway PKI for mTLS tests: a CA, a server certificate for 127.0.0.1, a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _issue(
    subject: str, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey | None, is_ca: bool = False
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    if not is_ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
        )
    return key, builder.sign(signer or key, hashes.SHA256())


def _pem(key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[bytes, bytes]:
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


@dataclass
class Pki:
    ca: Path
    client_cert: Path
    client_key: Path
    server_key: bytes
    server_cert: bytes
    ca_pem: bytes


def make_pki(directory: Path, client_cn: str = "operator") -> Pki:
    ca_key, ca_cert = _issue("abada test CA", _name("abada test CA"), None, is_ca=True)
    server_key, server_cert = _pem(*_issue("engine", ca_cert.subject, ca_key))
    client_key, client_cert = _pem(*_issue(client_cn, ca_cert.subject, ca_key))
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    paths = {"ca.pem": ca_pem, "client.pem": client_cert, "client.key": client_key}
    for name, content in paths.items():
        (directory / name).write_bytes(content)
    return Pki(
        directory / "ca.pem",
        directory / "client.pem",
        directory / "client.key",
        server_key,
        server_cert,
        ca_pem,
    )
