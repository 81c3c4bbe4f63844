"""The broker calls VerifyLease as itself: a service token or a TLS client certificate the engine knows.

The engine refuses VerifyLease to anyone but the broker identity; these tests show the broker presents
its identity, picks up a rotated token or certificate without a restart, and turns the engine's refusal
of its identity into a retryable UNAVAILABLE rather than a verdict on the worker's lease.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from abada_engine.api.guard import Guard
from abada_engine.api.server import ServerTls, start_grpc_server
from abada_engine.auth import CallerRegistry
from broker_support import CRM_CREDENTIAL, bundle, error_info, leased_task, running_broker, write_atomically
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@pytest.fixture(autouse=True)
def deployable(deploy_credentials, crm) -> None:
    deploy_credentials.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))


@pytest.fixture
def secrets_file(tmp_path, crm) -> Path:
    path = tmp_path / "secrets.yaml"
    path.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))
    return path


@pytest.fixture
def callers_file(tmp_path) -> tuple[Path, str]:
    """The broker's own callers: one worker pool."""
    token = "pool-token-for-identity-tests"
    path = tmp_path / "callers.yaml"
    entry = {
        "identity": "agent-pool",
        "roles": ["worker"],
        "token_sha256": hashlib.sha256(token.encode()).hexdigest(),
    }
    path.write_text(yaml.safe_dump({"callers": [entry]}))
    return path, token


def _settings(
    engine_address: str, secrets_file: Path, callers: tuple[Path, str], **more: str
) -> dict[str, str]:
    return {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(callers[0]),
        "ABADA_SECRET_BACKEND": "file",
        "ABADA_SECRETS_FILE": str(secrets_file),
        **more,
    }


async def test_a_rotated_engine_token_file_is_used_from_the_next_request_on(
    engine, engine_tokens, crm, secrets_file, callers_file, tmp_path
):
    token_file = tmp_path / "engine-token"
    token_file.write_text("a-token-the-engine-does-not-know\n")
    settings = _settings(engine.address, secrets_file, callers_file, ABADA_ENGINE_TOKEN_FILE=str(token_file))
    async with running_broker(tmp_path / "broker", settings) as broker:
        task = await leased_task(engine, bundle(crm.url))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await broker.for_task(callers_file[1], task)
        # The engine refused the broker, not the worker's lease: retryable, and says so.
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(caught.value).reason == "ENGINE_REFUSED_BROKER"

        write_atomically(token_file, engine_tokens.broker + "\n")
        assert (await broker.for_task(callers_file[1], task)).secret == crm.token
    errors = [line for line in broker.log_lines() if line["level"] == "error"]
    assert any(line.get("code") == "UNAUTHENTICATED" for line in errors)
    assert engine_tokens.broker not in broker.log_text()


# ---- mTLS ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    directory: Path
    ca_pem: bytes
    ca_key: ec.EllipticCurvePrivateKey

    def issue(self, common_name: str, *, server: bool = False) -> tuple[bytes, bytes]:
        """(certificate PEM, private key PEM) signed by the CA."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        ca = x509.load_pem_x509_certificate(self.ca_pem)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(hours=1))
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        certificate = builder.sign(self.ca_key, hashes.SHA256())
        return certificate.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


@pytest.fixture
def pki(tmp_path) -> Pki:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "abada test CA")])
    now = dt.datetime.now(dt.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory = tmp_path / "pki"
    directory.mkdir()
    ca_pem = ca.public_bytes(serialization.Encoding.PEM)
    (directory / "ca.crt").write_bytes(ca_pem)
    return Pki(directory, ca_pem, key)


@pytest.fixture
async def tls_engine(engine_core, pki, tmp_path) -> AsyncIterator[str]:
    """A second gRPC front of the same engine, mTLS only, that knows the broker by its certificate's CN."""
    callers = tmp_path / "engine-callers.yaml"
    callers.write_text(
        yaml.safe_dump(
            {"callers": [{"identity": "abada-broker", "roles": ["broker"], "certificate_cn": "abada-broker"}]}
        )
    )
    certificate, key = pki.issue("abada-engine", server=True)
    running = await start_grpc_server(
        engine_core,
        "127.0.0.1:0",
        Guard(CallerRegistry(callers)),
        ServerTls(certificate=certificate, private_key=key, client_ca=pki.ca_pem),
    )
    yield f"127.0.0.1:{running.port}"
    await running.stop(0)


def _client_files(pki: Pki, common_name: str) -> None:
    certificate, key = pki.issue(common_name)
    write_atomically(pki.directory / "tls.key", key.decode())
    write_atomically(pki.directory / "tls.crt", certificate.decode())


async def test_over_mtls_the_engine_knows_the_broker_by_its_certificate_and_a_renewed_one_is_picked_up(
    engine, tls_engine, pki, crm, secrets_file, callers_file, tmp_path
):
    _client_files(pki, "someone-else")
    settings = _settings(
        tls_engine,
        secrets_file,
        callers_file,
        ABADA_ENGINE_TLS_CA_FILE=str(pki.directory / "ca.crt"),
        ABADA_ENGINE_TLS_CERT_FILE=str(pki.directory / "tls.crt"),
        ABADA_ENGINE_TLS_KEY_FILE=str(pki.directory / "tls.key"),
    )
    async with running_broker(tmp_path / "broker", settings) as broker:
        task = await leased_task(engine, bundle(crm.url))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await broker.for_task(callers_file[1], task)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(caught.value).reason == "ENGINE_REFUSED_BROKER"

        # cert-manager renews the certificate in place: the broker's next call presents the new one.
        _client_files(pki, "abada-broker")
        issued = await broker.for_task(callers_file[1], task)
        assert issued.secret == crm.token
        assert issued.expire_time.ToDatetime(tzinfo=dt.UTC) <= task.lease_expires_at.ToDatetime(tzinfo=dt.UTC)
