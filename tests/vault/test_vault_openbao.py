"""The broker's secret store against a real Vault-API server: OpenBao's `bao server -dev`, through hvac.

What the in-test fake (fake_vault.py) cannot prove about the real thing: KV v2 versions as the
server numbers them, a rotation by an operator's `bao kv put` reaching the very next read, a token
the server really renews, and the server going away and coming back. The fake keeps the cases a dev
server cannot show (sealed, odd errors, a server that never answers).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from abada_broker.secret_store import SecretStoreUnavailable, VaultSecretStore, VaultSettings
from openbao import ROOT_TOKEN, OpenBao, running_openbao

CRM_PATH = "abada/tool-credentials/crm-token"
READER_POLICY = {
    "secret/data/abada/tool-credentials/*": ["read"],
    "secret/metadata/abada/tool-credentials/*": ["read"],
}


@pytest.fixture(scope="module")
def openbao(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenBao]:
    with running_openbao(tmp_path_factory.mktemp("openbao")) as server:
        server.add_reader_policy("abada-broker", READER_POLICY)
        yield server


@pytest.fixture
async def stores() -> AsyncIterator[list[VaultSecretStore]]:
    made: list[VaultSecretStore] = []
    yield made
    for store in made:
        await store.close()


def store_for(
    openbao: OpenBao, stores: list[VaultSecretStore], token: str, **settings: object
) -> VaultSecretStore:
    store = VaultSecretStore(
        VaultSettings(address=openbao.url, token=token, request_timeout_seconds=2.0, **settings)  # type: ignore[arg-type]
    )
    stores.append(store)
    return store


async def poll(condition, what: str, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout}s")
        await asyncio.sleep(0.1)


async def test_kv_v2_versions_and_a_bao_kv_put_rotation_reach_the_next_read(openbao, stores):
    first = openbao.put_secret(CRM_PATH, {"value": "crm-value-0001"})
    store = store_for(openbao, stores, openbao.create_token(["abada-broker"]), cache_seconds=30)
    secret = await store.read("crm-token")
    assert (secret.version, secret.value) == (first, "crm-value-0001")
    assert (await store.read("crm-token")).value == "crm-value-0001"  # served again from the cache

    # An operator rotates with the CLI; nothing is restarted, and the cache does not hide it.
    openbao.cli("kv", "put", "-mount=secret", CRM_PATH, "value=crm-value-0002")
    rotated = await store.read("crm-token")
    assert (rotated.version, rotated.value) == (first + 1, "crm-value-0002")


async def test_the_server_renews_the_token_before_it_expires(openbao, stores):
    openbao.put_secret(CRM_PATH, {"value": "crm-value-renewal"})
    token = openbao.create_token(["abada-broker"], ttl="4s")
    root = openbao.root()

    def expiry() -> dt.datetime:
        text = root.auth.token.lookup(token)["data"]["expire_time"]
        return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))

    issued_expiry = expiry()
    store = store_for(openbao, stores, token, renew_before_seconds=60)
    await store.read("crm-token")
    # Renewal is due half-way through the 4 s lease; the server's own record moves.
    await poll(lambda: expiry() > issued_expiry, "the token renewed on the server")
    await poll(
        lambda: dt.datetime.now(dt.UTC) > issued_expiry + dt.timedelta(seconds=0.5), "past the first expiry"
    )
    assert (await store.read("crm-token")).value == "crm-value-renewal"


async def test_the_server_stopped_is_unavailable_and_started_again_it_serves(tmp_path: Path, stores):
    # A server of its own: dev mode keeps nothing across a restart, so the test seeds it again, and
    # reads with the root token, whose id the dev server re-creates.
    server = OpenBao(tmp_path)
    server.start()
    try:
        server.put_secret(CRM_PATH, {"value": "before-the-outage"})
        store = store_for(server, stores, ROOT_TOKEN, cache_seconds=0)
        assert (await store.read("crm-token")).value == "before-the-outage"

        server.stop()
        with pytest.raises(SecretStoreUnavailable) as down:
            await store.read("crm-token")
        assert down.value.retryable
        with pytest.raises(SecretStoreUnavailable):
            await store.check()

        server.start()
        server.put_secret(CRM_PATH, {"value": "after-the-outage"})
        assert (await store.read("crm-token")).value == "after-the-outage"
        await store.check()
    finally:
        server.stop()
