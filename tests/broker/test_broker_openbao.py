"""The broker process against OpenBao (`bao server -dev`): a rotation by `bao kv put` reaches the next
request without a restart; the server stopped is SECRET_STORE_UNAVAILABLE, and started again it serves."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import hvac
import pytest
import yaml
from broker_support import (
    CRM_CREDENTIAL,
    CRM_SECRET_PATH,
    BrokerProcess,
    bundle,
    error_info,
    leased_task,
    running_broker,
)
from openbao import ROOT_TOKEN, OpenBao


@pytest.fixture(autouse=True)
def deployable(deploy_credentials, crm) -> None:
    deploy_credentials.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))


@pytest.fixture(scope="module")
def openbao(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenBao]:
    server = OpenBao(tmp_path_factory.mktemp("openbao-broker"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
async def bao_broker(  # type: ignore[no-untyped-def]
    engine_channel, openbao: OpenBao, dev_tokens, engine_tokens, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[BrokerProcess]:
    _, engine_address = engine_channel
    settings = {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_ENGINE_TOKEN": engine_tokens.broker,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(dev_tokens.callers_file),
        "ABADA_SECRET_BACKEND": "vault",
        "VAULT_ADDR": openbao.url,
        # The dev server forgets every token it issued when it restarts, except the root id it is given.
        "VAULT_TOKEN": ROOT_TOKEN,
        "ABADA_VAULT_TIMEOUT_SECONDS": "1",
        "ABADA_BROKER_HEALTH_INTERVAL_SECONDS": "0.2",
    }
    async with running_broker(tmp_path_factory.mktemp("bao-broker"), settings) as process:
        yield process


async def _eventually_served(call, timeout: float = 20.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


async def test_a_bao_kv_put_rotation_reaches_the_next_request(engine, bao_broker, openbao, crm, dev_tokens):
    openbao.put_secret(CRM_SECRET_PATH, {"value": crm.token})
    task = await leased_task(engine, bundle(crm.url))
    first = await bao_broker.for_task(dev_tokens.worker_token, task)
    assert first.secret == crm.token

    openbao.cli("kv", "put", "-mount=secret", CRM_SECRET_PATH, "value=rotated-by-an-operator")
    rotated = await bao_broker.for_task(dev_tokens.worker_token, task)
    assert rotated.secret == "rotated-by-an-operator"
    assert rotated.version == first.version + 1


async def test_openbao_stopped_is_secret_store_unavailable_then_it_recovers(
    engine, bao_broker, openbao, crm, dev_tokens, tmp_path: Path
):
    openbao.put_secret(CRM_SECRET_PATH, {"value": crm.token})
    task = await leased_task(engine, bundle(crm.url))
    assert (await bao_broker.for_task(dev_tokens.worker_token, task)).secret == crm.token

    openbao.stop()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await bao_broker.for_task(dev_tokens.worker_token, task)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(caught.value).reason == "SECRET_STORE_UNAVAILABLE"
    assert crm.token not in (caught.value.details() or "")

    openbao.start()
    openbao.put_secret(CRM_SECRET_PATH, {"value": crm.token})
    again = await _eventually_served(lambda: bao_broker.for_task(dev_tokens.worker_token, task))
    assert again.secret == crm.token


async def test_a_broker_whose_token_reads_only_the_credentials_serves_a_rotation_and_nothing_else(
    engine, engine_channel, openbao, crm, dev_tokens, engine_tokens, tmp_path: Path
):
    """The token an operator gives the broker reads `secret/data/abada/tool-credentials/*` and nothing
    more: a `bao kv put` of a new version still reaches the next task, and the token cannot read beside it."""
    openbao.put_secret(CRM_SECRET_PATH, {"value": crm.token})
    openbao.put_secret("abada/other/admin", {"value": "not for the broker"})
    openbao.add_reader_policy(
        "abada-broker-credentials",
        {
            "secret/data/abada/tool-credentials/*": ["read"],
            "secret/metadata/abada/tool-credentials/*": ["read"],
        },
    )
    token = openbao.create_token(["abada-broker-credentials"])
    _, engine_address = engine_channel
    settings = {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_ENGINE_TOKEN": engine_tokens.broker,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(dev_tokens.callers_file),
        "ABADA_SECRET_BACKEND": "vault",
        "VAULT_ADDR": openbao.url,
        "VAULT_TOKEN": token,
        "ABADA_VAULT_TIMEOUT_SECONDS": "1",
    }
    async with running_broker(tmp_path, settings) as broker:
        task = await leased_task(engine, bundle(crm.url))
        first = await broker.for_task(dev_tokens.worker_token, task)
        openbao.cli("kv", "put", "-mount=secret", CRM_SECRET_PATH, "value=rotated-under-the-policy")
        rotated = await broker.for_task(dev_tokens.worker_token, task)

    assert first.secret == crm.token
    assert rotated.secret == "rotated-under-the-policy" and rotated.version == first.version + 1
    limited = hvac.Client(url=openbao.url, token=token, timeout=5)
    with pytest.raises(hvac.exceptions.Forbidden):
        limited.secrets.kv.v2.read_secret_version(path="abada/other/admin", mount_point="secret")
