"""A credential goes only to the tool-server origins it is bound to, and the deploying operator is audited.

Review finding: any operator could have any credential sent, in clear, to a URL of their choosing, and the
audit named only the engine. Here a real broker process (with and without an origins file), the real
engine's lease check and a Vault show: an unbound origin or plain http off loopback is refused before
Vault is read, for the engine at deploy and for a worker holding a live lease alike; the audit event
names the operator on whose behalf the engine asked.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import grpc
import pytest
import yaml
from abada_engine.definitions.parser import parse_bundle
from abada_engine.definitions.tool_contracts import BrokerCredentials, McpContractCheck
from abada_engine.errors import EngineError
from broker_support import (
    CRM_CREDENTIAL,
    bundle,
    error_info,
    leased_task,
    running_broker,
    secret_paths,
)

_, CRM_DATA_PATH = secret_paths(CRM_CREDENTIAL)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(autouse=True)
def deployable(deploy_credentials, crm) -> None:
    deploy_credentials.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))


@pytest.fixture(scope="module")
def origins_file(tmp_path_factory, crm):
    path = tmp_path_factory.mktemp("origins") / "origins.yaml"
    path.write_text(yaml.safe_dump({CRM_CREDENTIAL: [crm.url]}))
    return path


@pytest.fixture(scope="module")
async def bound_broker(engine_channel, vault, dev_tokens, engine_tokens, origins_file, tmp_path_factory):
    """A broker with an origins file binding the CRM credential to the CRM's origin alone."""
    _, engine_address = engine_channel
    settings = {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_ENGINE_TOKEN": engine_tokens.broker,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(dev_tokens.callers_file),
        "ABADA_BROKER_CREDENTIAL_ORIGINS_FILE": str(origins_file),
        "ABADA_SECRET_BACKEND": "vault",
        "VAULT_ADDR": vault.url,
        "VAULT_TOKEN": vault.create_token(ttl=3600, policies=["abada-broker"]),
        "ABADA_BROKER_HEALTH_INTERVAL_SECONDS": "0.2",
    }
    async with running_broker(tmp_path_factory.mktemp("bound-broker"), settings) as process:
        yield process


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    error = caught.value
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(error).reason == "CREDENTIAL_ORIGIN_NOT_ALLOWED"
    return error


async def test_a_deploy_credential_goes_only_to_an_origin_it_is_bound_to(
    bound_broker, vault, crm, dev_tokens
):
    issued = await bound_broker.deploy_credential(dev_tokens.engine_token, url=crm.url)
    assert issued.secret == crm.token

    reads = vault.count("GET", CRM_DATA_PATH)
    elsewhere = f"http://127.0.0.1:{_free_port()}/mcp"
    error = await _refused(bound_broker.deploy_credential(dev_tokens.engine_token, url=elsewhere))
    assert elsewhere.rsplit("/", 1)[0] in error.details()
    error = await _refused(
        bound_broker.deploy_credential(dev_tokens.engine_token, url="http://10.20.30.40/mcp")
    )
    assert "use https" in error.details()
    assert vault.count("GET", CRM_DATA_PATH) == reads  # refused before the secret store was asked


async def test_without_an_origins_file_only_loopback_servers_get_credentials(broker, vault, crm, dev_tokens):
    issued = await broker.deploy_credential(dev_tokens.engine_token, url=crm.url)
    assert issued.secret == crm.token
    reads = vault.count("GET", CRM_DATA_PATH)
    error = await _refused(
        broker.deploy_credential(dev_tokens.engine_token, url="https://tools.example.com/mcp")
    )
    assert "ABADA_BROKER_CREDENTIAL_ORIGINS_FILE" in error.details()
    await _refused(broker.deploy_credential(dev_tokens.engine_token, url="http://203.0.113.9:8080/mcp"))
    assert vault.count("GET", CRM_DATA_PATH) == reads


async def test_a_worker_with_a_live_lease_gets_nothing_for_an_unbound_origin(
    engine, bound_broker, vault, crm, dev_tokens, origins_file
):
    """The definition names the CRM's URL, but the credential is now bound elsewhere: the lease is not enough."""
    task = await leased_task(engine, bundle(crm.url))
    assert (await bound_broker.for_task(dev_tokens.worker_token, task)).secret == crm.token
    original = origins_file.read_text()
    origins_file.write_text(yaml.safe_dump({CRM_CREDENTIAL: [f"https://crm.example.com:{_free_port()}"]}))
    try:
        reads = vault.count("GET", CRM_DATA_PATH)
        await _refused(bound_broker.for_task(dev_tokens.worker_token, task))
        assert vault.count("GET", CRM_DATA_PATH) == reads
    finally:
        origins_file.write_text(original)
    assert (await bound_broker.for_task(dev_tokens.worker_token, task)).secret == crm.token


async def test_the_engines_deploy_check_carries_the_operator_into_the_brokers_audit(
    bound_broker, crm, dev_tokens
):
    """The engine's own contract check, through the broker: the audit names the engine and the operator."""
    check = McpContractCheck(BrokerCredentials(bound_broker.address, dev_tokens.directory / "engine-token"))
    observed = await check(parse_bundle(bundle(crm.url)), "alice@ops")
    assert ("crm", "get_customer") in observed

    elsewhere = bundle(f"http://localhost:{crm.url.rsplit(':', 1)[1]}")  # the same server, another origin
    with pytest.raises(EngineError) as refused:
        await check(parse_bundle(elsewhere), "mallory@ops")
    assert refused.value.reason_name == "CREDENTIAL_UNAVAILABLE"
    assert "CREDENTIAL_ORIGIN_NOT_ALLOWED" in str(refused.value) or "may not be sent" in str(refused.value)
    await asyncio.sleep(0.2)  # the broker writes its log lines after answering

    deploys = [e for e in bound_broker.audit_events() if e.get("purpose") == "deploy"]
    by_operator = {e["on_behalf_of"]: e for e in deploys if e["on_behalf_of"] in ("alice@ops", "mallory@ops")}
    assert by_operator["alice@ops"]["outcome"] == "issued"
    assert by_operator["alice@ops"]["caller"] == "abada-engine"
    assert by_operator["alice@ops"]["url"] == crm.url
    assert by_operator["mallory@ops"]["outcome"] == "permission_denied"
    assert by_operator["mallory@ops"]["reason"] == "CREDENTIAL_ORIGIN_NOT_ALLOWED"


def test_an_origins_file_listing_plain_http_off_loopback_stops_the_broker(tmp_path, dev_tokens):
    origins = tmp_path / "origins.yaml"
    origins.write_text(yaml.safe_dump({CRM_CREDENTIAL: ["http://crm.internal:8080"]}))
    done = subprocess.run(
        [sys.executable, "-m", "abada_broker", "--auth-tokens-file", str(dev_tokens.callers_file)],
        env={
            "ABADA_BROKER_CREDENTIAL_ORIGINS_FILE": str(origins),
            "ABADA_SECRET_BACKEND": "file",
            "ABADA_SECRETS_FILE": str(tmp_path / "none.yaml"),
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "plain http" in done.stdout + done.stderr
