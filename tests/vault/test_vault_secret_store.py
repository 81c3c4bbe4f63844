"""The broker's secret store against the fake Vault (through real hvac) and against a local file."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from abada_broker.secret_store import (
    FileSecretStore,
    Secret,
    SecretNotFound,
    SecretStore,
    SecretStoreAuthError,
    SecretStoreConfigError,
    SecretStoreError,
    SecretStoreUnavailable,
    VaultSecretStore,
    VaultSettings,
    secret_store_from_env,
)
from fake_vault import FakeVault, make_service_account_jwt

CRM_PATH = "abada/tool-credentials/crm-token"
CRM_VALUE = "crm-s3cret-value-0001"
READER_POLICY = {
    "secret/data/abada/tool-credentials/*": ["read"],
    "secret/metadata/abada/tool-credentials/*": ["read"],
}
LOGIN = "/v1/auth/kubernetes/login"
RENEW = "/v1/auth/token/renew-self"

MakeStore = Callable[..., VaultSecretStore]


@pytest.fixture
def vault() -> Iterator[FakeVault]:
    with FakeVault() as server:
        server.add_policy("broker", READER_POLICY)
        server.put_secret(CRM_PATH, {"value": CRM_VALUE})
        yield server


@pytest.fixture
async def open_stores() -> AsyncIterator[list[SecretStore]]:
    """Stores made by a test, closed after it (their upkeep tasks and HTTP sessions included)."""
    stores: list[SecretStore] = []
    yield stores
    for store in stores:
        await store.close()


@pytest.fixture
def make_store(open_stores: list[SecretStore]) -> MakeStore:
    def make(vault: FakeVault, **settings: object) -> VaultSecretStore:
        settings.setdefault("request_timeout_seconds", 1.0)
        store = VaultSecretStore(VaultSettings(address=vault.url, **settings))  # type: ignore[arg-type]
        open_stores.append(store)
        return store

    return make


def broker_token(vault: FakeVault, ttl: float = 3600, renewable: bool = True) -> str:
    return vault.create_token(ttl=ttl, renewable=renewable, policies=["broker"])


def jwt_file(tmp_path: Path, service_account: str = "abada-broker", namespace: str = "abada") -> Path:
    path = tmp_path / "sa-token"
    path.write_text(make_service_account_jwt(service_account, namespace))
    return path


async def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.05)


# ---- reading and rotation ----------------------------------------------------------------------


async def test_reads_the_value_field_of_the_credential(vault: FakeVault, make_store: MakeStore) -> None:
    store = make_store(vault, token=broker_token(vault))
    secret = await store.read("crm-token")
    assert (secret.name, secret.version, secret.value) == ("crm-token", 1, CRM_VALUE)
    assert CRM_VALUE not in repr(secret) and CRM_VALUE not in str(secret)
    assert isinstance(store, SecretStore)


async def test_a_new_version_reaches_the_very_next_read_with_the_cache_on(
    vault: FakeVault, make_store
) -> None:
    store = make_store(vault, token=broker_token(vault), cache_seconds=30)
    assert (await store.read("crm-token")).version == 1
    assert (await store.read("crm-token")).value == CRM_VALUE
    # The second read of version 1 came from the cache: one data read, two version checks.
    assert vault.count("GET", f"/v1/secret/data/{CRM_PATH}") == 1
    assert vault.count("GET", f"/v1/secret/metadata/{CRM_PATH}") == 2

    vault.put_secret(CRM_PATH, {"value": "rotated-value-0002"})
    rotated = await store.read("crm-token")
    assert (rotated.version, rotated.value) == (2, "rotated-value-0002")


async def test_without_a_cache_every_read_is_one_read_of_the_latest_version(
    vault: FakeVault, make_store
) -> None:
    store = make_store(vault, token=broker_token(vault), cache_seconds=0)
    assert (await store.read("crm-token")).version == 1
    vault.put_secret(CRM_PATH, {"value": "rotated-value-0002"})
    assert (await store.read("crm-token")).value == "rotated-value-0002"
    assert vault.count("GET", f"/v1/secret/metadata/{CRM_PATH}") == 0
    assert vault.count("GET", f"/v1/secret/data/{CRM_PATH}") == 2


async def test_a_deleted_current_version_is_not_served_from_the_cache(
    vault: FakeVault, make_store: MakeStore
) -> None:
    store = make_store(vault, token=broker_token(vault), cache_seconds=30)
    await store.read("crm-token")
    vault.delete_secret_versions(CRM_PATH, [1])
    with pytest.raises(SecretNotFound):
        await store.read("crm-token")


async def test_missing_secrets_names_and_fields_are_not_found(
    vault: FakeVault, make_store: MakeStore
) -> None:
    store = make_store(vault, token=broker_token(vault))
    with pytest.raises(SecretNotFound, match="'billing-token'") as missing:
        await store.read("billing-token")
    assert missing.value.credential == "billing-token"
    assert not missing.value.retryable

    vault.put_secret("abada/tool-credentials/no-value", {"password": "p4ssw0rd-not-value"})
    with pytest.raises(SecretNotFound, match="field 'value'"):
        await store.read("no-value")

    vault.clear_requests()
    for bad_name in ("../../sys/health", "a/b", "", ".hidden"):
        with pytest.raises(SecretNotFound, match="not a valid credential name"):
            await store.read(bad_name)
    assert vault.requests == []


async def test_custom_mount_and_path_template(vault: FakeVault, make_store: MakeStore) -> None:
    vault.enable_kv("kv-tools")
    vault.put_secret("tools/crm-token/current", {"token": "custom-place-value"}, mount="kv-tools")
    token = vault.create_token(ttl=60, policies=["root"])
    store = make_store(
        vault,
        token=token,
        kv_mount="kv-tools",
        path_template="tools/{credential}/current",
        value_field="token",
    )
    assert (await store.read("crm-token")).value == "custom-place-value"


# ---- token auth and renewal --------------------------------------------------------------------


async def test_the_token_is_renewed_before_it_expires(vault: FakeVault, make_store: MakeStore) -> None:
    # 3 s: renewal is due half-way (the lease is shorter than renew_before_seconds), i.e. after ~1.5 s,
    # which leaves the store's upkeep 1.5 s of slack on a loaded machine before the token would lapse.
    token = broker_token(vault, ttl=3)
    store = make_store(vault, token=token, renew_before_seconds=60)
    await store.read("crm-token")
    info = vault.token_info(token)
    assert info is not None
    original_expiry = info.issued_at + 3
    await eventually(lambda: vault.count("POST", RENEW, status=200) >= 1, timeout=10)
    first_renewal = next(request for request in vault.requests if request.path == RENEW)
    assert first_renewal.at < original_expiry
    await asyncio.sleep(max(0.0, original_expiry - time.time()) + 0.2)  # past the token's original expiry
    assert vault.token_info(token) is not None
    assert (await store.read("crm-token")).value == CRM_VALUE


async def test_a_static_token_that_cannot_be_renewed_fails_clearly_once_expired(
    vault: FakeVault, make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="abada_broker")
    vault.fail_renewals = True
    # 2 s: the first read must come while the token is valid, even on a loaded machine.
    token = broker_token(vault, ttl=2)
    info = vault.token_info(token)
    assert info is not None
    store = make_store(vault, token=token, renew_before_seconds=60)
    await store.read("crm-token")
    # The warning is logged once the failed renewal's answer is in: wait for it, not for Vault's count.
    await eventually(
        lambda: any(
            "renewal of the static Vault token failed" in record.getMessage() for record in caplog.records
        ),
        timeout=10,
    )
    assert vault.count("POST", RENEW, status=500) >= 1
    await asyncio.sleep(max(0.0, info.issued_at + 2 - time.time()) + 0.2)  # past the token's expiry
    with pytest.raises(SecretStoreAuthError, match=r"static Vault token .* has expired") as expired:
        await store.read("crm-token")
    assert "renewal attempt failed" in str(expired.value)


async def test_a_non_renewable_static_token_is_reported(
    vault: FakeVault, make_store: MakeStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="abada_broker")
    store = make_store(vault, token=broker_token(vault, ttl=60, renewable=False))
    await store.read("crm-token")
    assert any("not renewable" in record.getMessage() for record in caplog.records)
    assert vault.count("POST", RENEW) == 0


async def test_a_revoked_token_is_replaced_from_the_token_file(
    vault: FakeVault, make_store: MakeStore, tmp_path: Path
) -> None:
    first, second = broker_token(vault), broker_token(vault)
    token_file = tmp_path / "vault-token"
    token_file.write_text(first + "\n")
    store = make_store(vault, token_file=token_file)
    await store.read("crm-token")
    vault.revoke_token(first)
    token_file.write_text(second)
    assert (await store.read("crm-token")).value == CRM_VALUE

    vault.revoke_token(second)
    with pytest.raises(SecretStoreAuthError, match="revoked or has expired"):
        await store.read("crm-token")


async def test_a_bad_static_token_is_an_auth_error(vault: FakeVault, make_store: MakeStore) -> None:
    store = make_store(vault, token="hvs.wrong-token")
    with pytest.raises(SecretStoreAuthError, match="rejects the configured static token"):
        await store.read("crm-token")
    with pytest.raises(SecretStoreAuthError):
        await store.check()


async def test_a_policy_denial_is_an_auth_error_without_a_login_storm(
    vault: FakeVault, make_store: MakeStore, tmp_path: Path
) -> None:
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=300, policies=["nothing"])
    store = make_store(
        vault,
        auth_method="kubernetes",
        kubernetes_role="abada-broker",
        kubernetes_jwt_file=jwt_file(tmp_path),
    )
    for _ in range(3):
        with pytest.raises(SecretStoreAuthError, match="policy must allow 'read'"):
            await store.read("crm-token")
    assert vault.count("POST", LOGIN) == 1


# ---- kubernetes auth ---------------------------------------------------------------------------


async def test_kubernetes_login_then_read(vault: FakeVault, make_store: MakeStore, tmp_path: Path) -> None:
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=300, policies=["broker"])
    store = make_store(
        vault,
        auth_method="kubernetes",
        kubernetes_role="abada-broker",
        kubernetes_jwt_file=jwt_file(tmp_path),
    )
    assert (await store.read("crm-token")).value == CRM_VALUE
    await store.check()
    assert vault.count("POST", LOGIN, status=200) == 1


async def test_renewal_failure_leads_to_a_new_kubernetes_login(
    vault: FakeVault, make_store: MakeStore, tmp_path: Path
) -> None:
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=2, policies=["broker"])
    vault.fail_renewals = True
    store = make_store(
        vault,
        auth_method="kubernetes",
        kubernetes_role="abada-broker",
        kubernetes_jwt_file=jwt_file(tmp_path),
        renew_before_seconds=60,
    )
    await store.read("crm-token")
    await eventually(lambda: vault.count("POST", LOGIN, status=200) >= 2, timeout=10)
    assert vault.count("POST", RENEW, status=500) >= 1
    await asyncio.sleep(1.2)  # the first token has expired by now
    assert (await store.read("crm-token")).value == CRM_VALUE


async def test_a_token_revoked_under_kubernetes_auth_is_replaced_by_a_login(
    vault: FakeVault, make_store: MakeStore, tmp_path: Path
) -> None:
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=300, policies=["broker"])
    store = make_store(
        vault,
        auth_method="kubernetes",
        kubernetes_role="abada-broker",
        kubernetes_jwt_file=jwt_file(tmp_path),
    )
    await store.read("crm-token")
    for token in vault.live_tokens():
        if token.path == "auth/kubernetes/login":
            vault.revoke_token(token.token_id)
    assert (await store.read("crm-token")).value == CRM_VALUE
    assert vault.count("POST", LOGIN, status=200) == 2


@pytest.mark.parametrize(
    ("role", "service_account", "namespace", "message"),
    [
        ("abada-broker", "intruder", "abada", "service account name not authorized"),
        ("abada-broker", "abada-broker", "default", "namespace not authorized"),
        ("no-such-role", "abada-broker", "abada", 'invalid role name "no-such-role"'),
    ],
)
async def test_kubernetes_login_refused(
    vault: FakeVault,
    make_store: MakeStore,
    tmp_path: Path,
    role: str,
    service_account: str,
    namespace: str,
    message: str,
) -> None:
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=300, policies=["broker"])
    store = make_store(
        vault,
        auth_method="kubernetes",
        kubernetes_role=role,
        kubernetes_jwt_file=jwt_file(tmp_path, service_account, namespace),
    )
    with pytest.raises(SecretStoreAuthError, match=message) as refused:
        await store.read("crm-token")
    assert f"role {role!r}" in str(refused.value)
    assert not refused.value.retryable


async def test_an_unreadable_service_account_token_is_an_auth_error(
    vault: FakeVault, make_store: MakeStore, tmp_path: Path
) -> None:
    store = make_store(
        vault,
        auth_method="kubernetes",
        kubernetes_role="abada-broker",
        kubernetes_jwt_file=tmp_path / "absent",
    )
    with pytest.raises(SecretStoreAuthError, match="cannot read the Kubernetes service-account token file"):
        await store.read("crm-token")


# ---- Vault unreachable -------------------------------------------------------------------------


async def test_vault_down_is_unavailable_quickly_and_recovers(
    vault: FakeVault, make_store: MakeStore
) -> None:
    # A refused connection is reported at once, not after the request timeout (10 s here).
    store = make_store(vault, token=broker_token(vault), cache_seconds=30, request_timeout_seconds=10.0)
    await store.read("crm-token")
    vault.go_down()
    started = time.monotonic()
    with pytest.raises(SecretStoreUnavailable, match="cannot reach Vault") as down:
        await store.read("crm-token")
    assert time.monotonic() - started < 5
    assert down.value.retryable
    with pytest.raises(SecretStoreUnavailable):
        await store.check()
    vault.come_back()
    assert (await store.read("crm-token")).value == CRM_VALUE
    await store.check()


async def test_a_vault_that_never_answers_times_out(vault: FakeVault, make_store: MakeStore) -> None:
    store = make_store(vault, token=broker_token(vault), request_timeout_seconds=0.3)
    await store.read("crm-token")
    vault.stall_seconds = 10
    started = time.monotonic()
    with pytest.raises(SecretStoreUnavailable):
        await store.read("crm-token")
    assert time.monotonic() - started < 5  # the request timeout, not the 10 s stall
    vault.stall_seconds = 0
    assert (await store.read("crm-token")).value == CRM_VALUE


async def test_a_sealed_vault_is_unavailable(vault: FakeVault, make_store: MakeStore) -> None:
    store = make_store(vault, token=broker_token(vault))
    await store.check()
    vault.sealed = True
    with pytest.raises(SecretStoreUnavailable, match="sealed"):
        await store.check()
    with pytest.raises(SecretStoreUnavailable, match="HTTP 503"):
        await store.read("crm-token")


# ---- nothing secret leaks ----------------------------------------------------------------------


async def test_no_error_or_log_line_contains_a_secret(
    vault: FakeVault, make_store: MakeStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    token = broker_token(vault, ttl=1)
    jwt_path = jwt_file(tmp_path, "intruder", "abada")
    secrets = [CRM_VALUE, "rotated-value-0002", "p4ssw0rd-not-value", token, jwt_path.read_text()]
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=300, policies=["broker"])
    vault.put_secret("abada/tool-credentials/no-value", {"password": "p4ssw0rd-not-value"})
    failures: list[BaseException] = []

    async def expect_failure(attempt: Awaitable[object]) -> None:
        try:
            await attempt
        except SecretStoreError as error:
            failures.append(error)
        else:
            raise AssertionError("expected a SecretStoreError")

    store = make_store(vault, token=token, cache_seconds=30, renew_before_seconds=60)
    await store.read("crm-token")
    vault.put_secret(CRM_PATH, {"value": "rotated-value-0002"})
    await store.read("crm-token")
    await expect_failure(store.read("no-value"))
    await expect_failure(store.read("missing"))
    vault.fail_renewals = True
    with vault.unreachable():
        await expect_failure(store.read("crm-token"))
    await asyncio.sleep(1.3)
    await expect_failure(store.read("crm-token"))  # the static token expired
    kubernetes = make_store(
        vault, auth_method="kubernetes", kubernetes_role="abada-broker", kubernetes_jwt_file=jwt_path
    )
    await expect_failure(kubernetes.read("crm-token"))
    file_path = tmp_path / "secrets.yaml"
    file_path.write_text(f"crm-token: [{CRM_VALUE}\n")
    await expect_failure(FileSecretStore(file_path).read("crm-token"))

    texts = ["".join(traceback.format_exception(failure)) + repr(failure) for failure in failures]
    texts += [logging.Formatter().format(record) + repr(record.__dict__) for record in caplog.records]
    assert len(failures) == 6
    for text in texts:
        for secret in secrets:
            assert secret not in text


# ---- settings ----------------------------------------------------------------------------------


def test_settings_from_env() -> None:
    settings = VaultSettings.from_env(
        {
            "VAULT_ADDR": "https://vault.acme.internal:8200",
            "ABADA_VAULT_AUTH": "kubernetes",
            "ABADA_VAULT_K8S_ROLE": "abada-broker",
            "ABADA_VAULT_K8S_MOUNT": "k8s-prod",
            "ABADA_VAULT_KV_MOUNT": "kv",
            "ABADA_VAULT_PATH_TEMPLATE": "abada/{credential}",
            "ABADA_SECRET_CACHE_SECONDS": "10",
            "VAULT_CACERT": "/etc/vault/ca.pem",
        }
    )
    assert settings.address == "https://vault.acme.internal:8200"
    assert settings.auth_method == "kubernetes"
    assert settings.kubernetes_role == "abada-broker"
    assert settings.kubernetes_mount == "k8s-prod"
    assert settings.kubernetes_jwt_file == Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    assert (settings.kv_mount, settings.path_template, settings.cache_seconds) == (
        "kv",
        "abada/{credential}",
        10,
    )
    assert settings.ca_cert == Path("/etc/vault/ca.pem")

    static = VaultSettings.from_env(
        {"VAULT_TOKEN": "hvs.very-secret-token", "ABADA_VAULT_TOKEN_FILE": "/run/t"}
    )
    assert static.auth_method == "token" and static.token_file == Path("/run/t")
    assert static.path_template == "abada/tool-credentials/{credential}" and static.kv_mount == "secret"
    assert "hvs.very-secret-token" not in repr(static)


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "needs a token"),
        ({"ABADA_VAULT_AUTH": "kubernetes"}, "needs a role"),
        ({"ABADA_VAULT_AUTH": "ldap"}, "ABADA_VAULT_AUTH must be 'token' or 'kubernetes', not 'ldap'"),
        (
            {"VAULT_TOKEN": "t", "ABADA_SECRET_CACHE_SECONDS": "120"},
            "ABADA_SECRET_CACHE_SECONDS must be between 0 and ABADA_SECRET_MAX",
        ),
        ({"VAULT_TOKEN": "t", "ABADA_SECRET_CACHE_SECONDS": "soon"}, "CACHE_SECONDS must be a number"),
        ({"VAULT_TOKEN": "t", "ABADA_VAULT_PATH_TEMPLATE": "abada/fixed"}, "exactly once"),
        ({"VAULT_TOKEN": "t", "VAULT_ADDR": "vault:8200"}, "VAULT_ADDR must start with http:// or https://"),
    ],
)
def test_bad_settings_are_refused(environ: dict[str, str], message: str) -> None:
    with pytest.raises(SecretStoreConfigError, match=message):
        VaultSettings.from_env(environ)


def test_a_longer_cache_needs_an_explicitly_raised_maximum() -> None:
    settings = VaultSettings.from_env(
        {"VAULT_TOKEN": "t", "ABADA_SECRET_CACHE_SECONDS": "120", "ABADA_SECRET_MAX_CACHE_SECONDS": "300"}
    )
    assert settings.cache_seconds == 120


async def test_the_factory_chooses_the_backend(tmp_path: Path, open_stores: list[SecretStore]) -> None:
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text("crm-token: demo-value\n")
    file_store = secret_store_from_env(
        {"ABADA_SECRET_BACKEND": "file", "ABADA_SECRETS_FILE": str(secrets_file)}
    )
    open_stores.append(file_store)
    assert isinstance(file_store, FileSecretStore)
    assert (await file_store.read("crm-token")).value == "demo-value"

    vault_store = secret_store_from_env({"VAULT_ADDR": "http://127.0.0.1:8200", "VAULT_TOKEN": "t"})
    open_stores.append(vault_store)
    assert isinstance(vault_store, VaultSecretStore)

    with pytest.raises(SecretStoreConfigError, match="ABADA_SECRETS_FILE"):
        secret_store_from_env({"ABADA_SECRET_BACKEND": "file"})
    with pytest.raises(SecretStoreConfigError, match="'vault' or 'file'"):
        secret_store_from_env({"ABADA_SECRET_BACKEND": "env"})


# ---- the file backend --------------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    scratch = path.with_suffix(".tmp")
    scratch.write_text(text)
    os.replace(scratch, path)


async def test_file_backend_reads_and_rotates_on_rewrite(tmp_path: Path) -> None:
    path = tmp_path / "secrets.yaml"
    write_atomically(path, "crm-token: first-value\nbilling-token: {value: billing-value, version: 7}\n")
    store = FileSecretStore(path)
    await store.check()
    assert await store.read("crm-token") == Secret(name="crm-token", version=1, value="first-value")
    assert (await store.read("billing-token")).version == 7

    write_atomically(path, "crm-token: second-value\nbilling-token: {value: billing-value-2, version: 8}\n")
    assert await store.read("crm-token") == Secret(name="crm-token", version=2, value="second-value")
    assert (await store.read("billing-token")).value == "billing-value-2"
    write_atomically(path, "crm-token: second-value\n# a comment changes the file, not the value\n")
    assert (await store.read("crm-token")).version == 2
    with pytest.raises(SecretNotFound, match="'billing-token'"):
        await store.read("billing-token")


async def test_file_backend_reads_json(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    path.write_text(json.dumps({"crm-token": {"value": "json-value", "version": 3}}))
    assert (await FileSecretStore(path).read("crm-token")).version == 3


async def test_file_backend_errors(tmp_path: Path) -> None:
    missing = FileSecretStore(tmp_path / "absent.yaml")
    with pytest.raises(SecretStoreUnavailable, match="cannot read the secrets file"):
        await missing.read("crm-token")
    with pytest.raises(SecretStoreUnavailable):
        await missing.check()

    path = tmp_path / "secrets.yaml"
    path.write_text("crm-token: {value: 12}\n")
    with pytest.raises(SecretStoreConfigError, match="'crm-token' in the secrets file"):
        await FileSecretStore(path).read("crm-token")
    path.write_text("- just\n- a list\n")
    with pytest.raises(SecretStoreConfigError, match="must map credential names"):
        await FileSecretStore(path).read("crm-token")
    path.write_text("crm-token: 'unterminated-secret-value\n")
    with pytest.raises(SecretStoreConfigError, match="not valid YAML") as invalid:
        await FileSecretStore(path).read("crm-token")
    assert "unterminated-secret-value" not in str(invalid.value)
