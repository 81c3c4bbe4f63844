"""The broker's listener over TLS and mTLS, its plaintext health-only port, and its clients dialing TLS.

Tool secrets cross the pod network on this port: with TLS configured nothing may reach them in clear
text, and with a client CA nothing without a certificate may reach them at all.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx2
import pytest
import yaml
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada_engine.definitions.tool_contracts import BrokerCredentials, credentials_from_env
from abada_engine.errors import Category, EngineError
from abada_sdk.connection import BearerToken
from abada_worker.broker_client import BrokerClient, broker_channel_for
from abada_worker.dependencies import BROKER, DependencyDown
from abada_worker.engine_client import LeaseRef
from abada_worker.settings import WorkerSettings
from broker_support import (
    CRM_CREDENTIAL,
    WORKER,
    BrokerProcess,
    broker_environment,
    bundle,
    leased_task,
    running_broker,
)
from certificates import Pki, make_pki
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(frozen=True)
class BrokerPki:
    pki: Pki
    server_cert: Path
    server_key: Path


@pytest.fixture(autouse=True)
def deployable(deploy_credentials, crm) -> None:
    deploy_credentials.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))


@pytest.fixture(scope="module")
def broker_pki(tmp_path_factory: pytest.TempPathFactory) -> BrokerPki:
    directory = tmp_path_factory.mktemp("broker-pki")
    pki = make_pki(directory, client_cn="agent-pool")
    server_cert, server_key = directory / "broker.pem", directory / "broker.key"
    server_cert.write_bytes(pki.server_cert)
    server_key.write_bytes(pki.server_key)
    return BrokerPki(pki, server_cert, server_key)


def _settings(engine_channel, vault, dev_tokens, engine_tokens) -> dict[str, str]:
    _, engine_address = engine_channel
    return {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_ENGINE_TOKEN": engine_tokens.broker,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(dev_tokens.callers_file),
        "ABADA_SECRET_BACKEND": "vault",
        "VAULT_ADDR": vault.url,
        "VAULT_TOKEN": vault.create_token(ttl=3600, policies=["abada-broker"]),
        "ABADA_BROKER_HEALTH_INTERVAL_SECONDS": "0.2",
    }


@pytest.fixture(scope="module")
async def tls_broker(
    engine_channel, vault, dev_tokens, engine_tokens, broker_pki: BrokerPki, tmp_path_factory
) -> AsyncIterator[BrokerProcess]:
    settings = {
        **_settings(engine_channel, vault, dev_tokens, engine_tokens),
        "ABADA_BROKER_TLS_CERT_FILE": str(broker_pki.server_cert),
        "ABADA_BROKER_TLS_KEY_FILE": str(broker_pki.server_key),
        "ABADA_BROKER_HEALTH_ADDRESS": "127.0.0.1:0",
        "ABADA_BROKER_HTTP_ADDRESS": "127.0.0.1:0",
    }
    credentials = grpc.ssl_channel_credentials(root_certificates=broker_pki.pki.ca_pem)
    async with running_broker(
        tmp_path_factory.mktemp("tls-broker"), settings, channel_credentials=credentials
    ) as process:
        yield process


@pytest.fixture(scope="module")
async def mtls_broker(
    engine_channel, vault, dev_tokens, engine_tokens, broker_pki: BrokerPki, tmp_path_factory
) -> AsyncIterator[BrokerProcess]:
    pki = broker_pki.pki
    settings = {
        **_settings(engine_channel, vault, dev_tokens, engine_tokens),
        "ABADA_BROKER_TLS_CERT_FILE": str(broker_pki.server_cert),
        "ABADA_BROKER_TLS_KEY_FILE": str(broker_pki.server_key),
        "ABADA_BROKER_TLS_CLIENT_CA_FILE": str(pki.ca),
        "ABADA_BROKER_HTTP_ADDRESS": "127.0.0.1:0",
    }
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca_pem,
        private_key=pki.client_key.read_bytes(),
        certificate_chain=pki.client_cert.read_bytes(),
    )
    async with running_broker(
        tmp_path_factory.mktemp("mtls-broker"), settings, channel_credentials=credentials
    ) as process:
        yield process


def _worker_settings(address: str, **tls: Path) -> WorkerSettings:
    return WorkerSettings(broker_address=address, worker_id=WORKER, **tls)


async def _worker_credential(settings: WorkerSettings, token: str, task) -> str:
    channel = broker_channel_for(settings)
    try:
        client = BrokerClient(channel, settings.worker_id, BearerToken(token), timeout_seconds=5)
        secret = await client.tool_credential(LeaseRef(task.id, task.lease_token, task.attempt), "crm")
        BrokerClient.forget(secret)
        return secret.reveal()
    finally:
        await channel.close()


async def test_a_worker_gets_its_credential_from_a_tls_broker(
    engine, tls_broker, broker_pki, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    settings = _worker_settings(tls_broker.address, broker_tls_ca_file=broker_pki.pki.ca)
    assert await _worker_credential(settings, dev_tokens.worker_token, task) == crm.token


async def test_a_worker_without_the_ca_cannot_reach_a_tls_broker(engine, tls_broker, crm, dev_tokens):
    task = await leased_task(engine, bundle(crm.url))
    # No CA: the worker dials in plaintext, which the TLS port does not answer: to the worker, the
    # broker is out of reach (an outage it waits out and reports, naming the broker).
    with pytest.raises(DependencyDown) as caught:
        await _worker_credential(_worker_settings(tls_broker.address), dev_tokens.worker_token, task)
    assert caught.value.dependency == BROKER
    assert crm.token not in str(caught.value)


async def test_a_worker_trusting_another_ca_refuses_the_broker(
    engine, tls_broker, crm, dev_tokens, tmp_path
) -> None:
    stranger = make_pki(tmp_path)
    task = await leased_task(engine, bundle(crm.url))
    settings = _worker_settings(tls_broker.address, broker_tls_ca_file=stranger.ca)
    with pytest.raises(DependencyDown) as caught:
        await _worker_credential(settings, dev_tokens.worker_token, task)
    assert caught.value.dependency == BROKER


async def test_the_engine_gets_a_deploy_credential_from_a_tls_broker(tls_broker, broker_pki, crm, dev_tokens):
    source = credentials_from_env(
        {
            "ABADA_BROKER_ADDRESS": tls_broker.address,
            "ABADA_BROKER_TOKEN_FILE": str(dev_tokens.directory / "engine-token"),
            "ABADA_BROKER_TLS_CA_FILE": str(broker_pki.pki.ca),
        }
    )
    assert isinstance(source, BrokerCredentials)
    assert await source.secret(CRM_CREDENTIAL, "crm", crm.url, "ops") == crm.token


def test_the_engine_refuses_a_client_certificate_without_the_broker_ca(tmp_path) -> None:
    env = {"ABADA_BROKER_ADDRESS": "127.0.0.1:1", "ABADA_BROKER_TLS_CERT_FILE": str(tmp_path / "c.pem")}
    with pytest.raises(ValueError, match="ABADA_BROKER_TLS_KEY_FILE"):
        credentials_from_env(env)
    env["ABADA_BROKER_TLS_KEY_FILE"] = str(tmp_path / "c.key")
    with pytest.raises(ValueError, match="ABADA_BROKER_TLS_CA_FILE"):
        credentials_from_env(env)


async def test_the_health_port_answers_in_plaintext_and_serves_nothing_else(tls_broker):
    assert tls_broker.health_address is not None
    async with grpc.aio.insecure_channel(tls_broker.health_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "abada.broker.v1.CredentialService", "liveness"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == SERVING, service
        credentials = credential_pb2_grpc.CredentialServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await credentials.GetDeployCredential(
                credential_pb2.GetDeployCredentialRequest(credential=CRM_CREDENTIAL, server="crm"), timeout=5
            )
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
        # The stream is opened without a request: a server without the method ends it at once, and a
        # request sent into the ended stream would fail on the client's side (INTERNAL), not the server's.
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        assert await reflection.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_the_tls_port_still_serves_health_and_reflection(tls_broker):
    assert await tls_broker.health() == SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(tls_broker.channel)
    names: list[str] = []
    async for reply in reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    ):
        names = [service.name for service in reply.list_services_response.service]
    assert "abada.broker.v1.CredentialService" in names


async def test_with_mtls_a_worker_presenting_its_certificate_gets_its_credential(
    engine, mtls_broker, broker_pki, crm, dev_tokens
):
    pki = broker_pki.pki
    task = await leased_task(engine, bundle(crm.url))
    settings = _worker_settings(
        mtls_broker.address,
        broker_tls_ca_file=pki.ca,
        broker_tls_cert_file=pki.client_cert,
        broker_tls_key_file=pki.client_key,
    )
    assert await _worker_credential(settings, dev_tokens.worker_token, task) == crm.token


async def test_with_mtls_a_caller_without_a_certificate_fails_the_handshake(
    mtls_broker, broker_pki, dev_tokens
):
    credentials = grpc.ssl_channel_credentials(root_certificates=broker_pki.pki.ca_pem)
    async with grpc.aio.secure_channel(mtls_broker.address, credentials) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        # A valid token does not stand in for the certificate.
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await credential_pb2_grpc.CredentialServiceStub(channel).GetDeployCredential(
                credential_pb2.GetDeployCredentialRequest(credential=CRM_CREDENTIAL, server="crm"),
                metadata=(("authorization", f"Bearer {dev_tokens.engine_token}"),),
                timeout=5,
            )
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_with_mtls_the_engine_presenting_its_certificate_gets_a_deploy_credential(
    mtls_broker, broker_pki, crm, dev_tokens
):
    pki = broker_pki.pki
    env = {
        "ABADA_BROKER_ADDRESS": mtls_broker.address,
        "ABADA_BROKER_TOKEN_FILE": str(dev_tokens.directory / "engine-token"),
        "ABADA_BROKER_TLS_CA_FILE": str(pki.ca),
    }
    without_certificate = credentials_from_env(env)
    assert without_certificate is not None
    with pytest.raises(EngineError) as caught:
        await without_certificate.secret(CRM_CREDENTIAL, "crm", crm.url, "ops")
    assert caught.value.category == Category.UNAVAILABLE
    with_certificate = credentials_from_env(
        {
            **env,
            "ABADA_BROKER_TLS_CERT_FILE": str(pki.client_cert),
            "ABADA_BROKER_TLS_KEY_FILE": str(pki.client_key),
        }
    )
    assert with_certificate is not None
    assert await with_certificate.secret(CRM_CREDENTIAL, "crm", crm.url, "ops") == crm.token


def _start_with(settings: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text("crm-token: value\n")
    environment = broker_environment(
        {
            "ABADA_BROKER_GRPC_ADDRESS": "127.0.0.1:0",
            "ABADA_BROKER_INSECURE_DEV": "1",
            "ABADA_SECRET_BACKEND": "file",
            "ABADA_SECRETS_FILE": str(secrets_file),
            **settings,
        }
    )
    return subprocess.run(
        [sys.executable, "-m", "abada_broker"], env=environment, capture_output=True, text=True, timeout=30
    )


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (("CERT",), "ABADA_BROKER_TLS_KEY_FILE"),
        (("KEY",), "ABADA_BROKER_TLS_CERT_FILE"),
        (("CLIENT_CA",), "ABADA_BROKER_TLS_CERT_FILE"),
        (("CERT", "CLIENT_CA"), "ABADA_BROKER_TLS_KEY_FILE"),
    ],
)
def test_a_partial_tls_setting_stops_the_start_naming_what_is_missing(
    given: tuple[str, ...], named: str, broker_pki: BrokerPki, tmp_path: Path
) -> None:
    files = {"CERT": broker_pki.server_cert, "KEY": broker_pki.server_key, "CLIENT_CA": broker_pki.pki.ca}
    done = _start_with({f"ABADA_BROKER_TLS_{part}_FILE": str(files[part]) for part in given}, tmp_path)
    assert done.returncode == 2
    errors = [
        line["message"] for line in map(json.loads, done.stderr.splitlines()) if line["level"] == "error"
    ]
    assert len(errors) == 1 and named in errors[0]


def test_an_unreadable_certificate_stops_the_start(broker_pki: BrokerPki, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.pem"
    done = _start_with(
        {"ABADA_BROKER_TLS_CERT_FILE": str(missing), "ABADA_BROKER_TLS_KEY_FILE": str(broker_pki.server_key)},
        tmp_path,
    )
    assert done.returncode == 2
    assert str(missing) in done.stderr and "ABADA_BROKER_TLS_CERT_FILE" in done.stderr


async def _http_credential(broker: BrokerProcess, task, token: str, **client: object) -> httpx2.Response:
    assert broker.http_url is not None
    url = broker.http_url.replace("http://", "https://")
    async with httpx2.AsyncClient(base_url=url, timeout=10, **client) as http:  # type: ignore[arg-type]
        return await http.get(
            f"/v1/external-tasks/{task.id}/tool-credentials/crm",
            params={"workerId": WORKER},
            headers={"Authorization": f"Bearer {token}", "Abada-Lease-Token": task.lease_token},
        )


async def test_the_http_port_speaks_the_listeners_tls_and_nothing_in_clear(
    engine, tls_broker, broker_pki, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    trusted = ssl.create_default_context(cafile=str(broker_pki.pki.ca))
    answer = await _http_credential(tls_broker, task, dev_tokens.worker_token, verify=trusted)
    assert answer.status_code == 200 and answer.json()["secret"] == crm.token
    assert tls_broker.http_url is not None
    async with httpx2.AsyncClient(timeout=5) as clear:
        with pytest.raises(httpx2.HTTPError):
            await clear.get(f"{tls_broker.http_url}/v1/openapi.json")


async def test_the_http_port_of_an_mtls_broker_wants_a_client_certificate(
    engine, mtls_broker, broker_pki, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    pki = broker_pki.pki
    without = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises(httpx2.HTTPError):
        await _http_credential(mtls_broker, task, dev_tokens.worker_token, verify=without)
    with_certificate = ssl.create_default_context(cafile=str(pki.ca))
    with_certificate.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    answer = await _http_credential(mtls_broker, task, dev_tokens.worker_token, verify=with_certificate)
    assert answer.status_code == 200 and answer.json()["secret"] == crm.token
