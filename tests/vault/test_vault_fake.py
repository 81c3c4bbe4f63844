"""The fake Vault answers real ``hvac`` the way Vault does: shapes, status codes, TTLs, policies."""

from __future__ import annotations

import time
from collections.abc import Iterator

import hvac
import hvac.exceptions
import pytest
import requests
from fake_vault import FakeVault, make_service_account_jwt

READER_POLICY = {
    "secret/data/abada/tool-credentials/*": ["read"],
    "secret/metadata/abada/tool-credentials/*": ["read"],
}


@pytest.fixture
def vault() -> Iterator[FakeVault]:
    with FakeVault() as server:
        server.add_policy("reader", READER_POLICY)
        yield server


def client_for(vault: FakeVault, token: str | None = None) -> hvac.Client:
    return hvac.Client(url=vault.url, token=token if token is not None else vault.root_token, timeout=2)


def test_starts_in_well_under_a_second_on_a_free_loopback_port() -> None:
    started = time.perf_counter()
    with FakeVault() as vault:
        elapsed = time.perf_counter() - started
        assert vault.url.startswith("http://127.0.0.1:")
        assert vault.port > 0
        assert client_for(vault).sys.read_health_status(method="GET")["sealed"] is False
    assert elapsed < 0.5


def test_kv_v2_write_read_and_versions(vault: FakeVault) -> None:
    kv = client_for(vault).secrets.kv.v2
    written = kv.create_or_update_secret(path="abada/tool-credentials/crm-token", secret={"value": "one"})
    assert written["data"]["version"] == 1
    assert written["data"]["destroyed"] is False and written["data"]["deletion_time"] == ""
    for envelope_field in (
        "request_id",
        "lease_id",
        "renewable",
        "lease_duration",
        "wrap_info",
        "warnings",
        "auth",
    ):
        assert envelope_field in written
    kv.create_or_update_secret(path="abada/tool-credentials/crm-token", secret={"value": "two"})

    latest = kv.read_secret_version(path="abada/tool-credentials/crm-token", raise_on_deleted_version=True)
    assert latest["data"]["data"] == {"value": "two"}
    assert latest["data"]["metadata"]["version"] == 2
    first = kv.read_secret_version(
        path="abada/tool-credentials/crm-token", version=1, raise_on_deleted_version=True
    )
    assert first["data"]["data"] == {"value": "one"}

    metadata = kv.read_secret_metadata(path="abada/tool-credentials/crm-token")["data"]
    assert metadata["current_version"] == 2
    assert metadata["oldest_version"] == 1
    assert set(metadata["versions"]) == {"1", "2"}
    assert metadata["versions"]["2"]["deletion_time"] == ""

    assert kv.list_secrets(path="abada/tool-credentials")["data"]["keys"] == ["crm-token"]


def test_control_api_writes_are_visible_through_the_http_api(vault: FakeVault) -> None:
    assert vault.put_secret("abada/tool-credentials/crm-token", {"value": "a"}) == 1
    assert vault.put_secret("abada/tool-credentials/crm-token", {"value": "b"}) == 2
    read = client_for(vault).secrets.kv.v2.read_secret_version(
        path="abada/tool-credentials/crm-token", raise_on_deleted_version=True
    )
    assert read["data"]["data"]["value"] == "b"
    assert vault.current_version("abada/tool-credentials/crm-token") == 2


def test_check_and_set(vault: FakeVault) -> None:
    kv = client_for(vault).secrets.kv.v2
    kv.create_or_update_secret(path="k", secret={"value": "v1"}, cas=0)
    with pytest.raises(hvac.exceptions.InvalidRequest, match="check-and-set parameter did not match"):
        kv.create_or_update_secret(path="k", secret={"value": "v2"}, cas=0)
    assert kv.create_or_update_secret(path="k", secret={"value": "v2"}, cas=1)["data"]["version"] == 2


def test_missing_data_is_a_bad_request(vault: FakeVault) -> None:
    response = requests.post(
        f"{vault.url}/v1/secret/data/k", json={"options": {}}, headers={"X-Vault-Token": vault.root_token}
    )
    assert response.status_code == 400
    assert response.json() == {"errors": ["no data provided"]}


def test_unknown_secret_and_unknown_version_are_invalid_path(vault: FakeVault) -> None:
    kv = client_for(vault).secrets.kv.v2
    with pytest.raises(hvac.exceptions.InvalidPath):
        kv.read_secret_version(path="abada/tool-credentials/nope", raise_on_deleted_version=True)
    with pytest.raises(hvac.exceptions.InvalidPath):
        kv.read_secret_metadata(path="abada/tool-credentials/nope")
    vault.put_secret("k", {"value": "x"})
    with pytest.raises(hvac.exceptions.InvalidPath):
        kv.read_secret_version(path="k", version=7, raise_on_deleted_version=True)


def test_deleted_and_destroyed_versions_answer_404_with_their_metadata(vault: FakeVault) -> None:
    kv = client_for(vault).secrets.kv.v2
    vault.put_secret("k", {"value": "one"})
    vault.put_secret("k", {"value": "two"})
    kv.delete_latest_version_of_secret(path="k")
    with pytest.raises(hvac.exceptions.InvalidPath):
        kv.read_secret_version(path="k", raise_on_deleted_version=True)
    deleted = kv.read_secret_version(path="k", raise_on_deleted_version=False)
    assert deleted["data"]["data"] is None
    assert deleted["data"]["metadata"]["deletion_time"] != ""

    kv.destroy_secret_versions(path="k", versions=[1])
    with pytest.raises(hvac.exceptions.InvalidPath) as destroyed:
        kv.read_secret_version(path="k", version=1, raise_on_deleted_version=True)
    assert destroyed.value.json["data"]["metadata"]["destroyed"] is True

    kv.undelete_secret_versions(path="k", versions=[2])
    assert kv.read_secret_version(path="k", raise_on_deleted_version=True)["data"]["data"] == {"value": "two"}

    kv.delete_metadata_and_all_versions(path="k")
    with pytest.raises(hvac.exceptions.InvalidPath):
        kv.read_secret_metadata(path="k")


def test_wrong_missing_and_expired_tokens_are_forbidden(vault: FakeVault) -> None:
    vault.put_secret("abada/tool-credentials/crm-token", {"value": "x"})
    with pytest.raises(hvac.exceptions.Forbidden, match="invalid token"):
        client_for(vault, "hvs.not-a-token").secrets.kv.v2.read_secret_version(
            path="abada/tool-credentials/crm-token", raise_on_deleted_version=True
        )
    response = requests.get(f"{vault.url}/v1/secret/data/abada/tool-credentials/crm-token")
    assert response.status_code == 403
    assert response.json() == {"errors": ["permission denied"]}

    short_lived = vault.create_token(ttl=1, policies=["reader"])
    client = client_for(vault, short_lived)
    client.auth.token.lookup_self()
    time.sleep(1.1)
    with pytest.raises(hvac.exceptions.Forbidden):
        client.auth.token.lookup_self()
    assert vault.token_info(short_lived) is None


def test_policies_limit_what_a_token_may_read(vault: FakeVault) -> None:
    vault.put_secret("abada/tool-credentials/crm-token", {"value": "x"})
    vault.put_secret("other/thing", {"value": "y"})
    kv = client_for(vault, vault.create_token(ttl=60, policies=["reader"])).secrets.kv.v2
    assert kv.read_secret_version(path="abada/tool-credentials/crm-token", raise_on_deleted_version=True)
    with pytest.raises(hvac.exceptions.Forbidden, match="permission denied"):
        kv.read_secret_version(path="other/thing", raise_on_deleted_version=True)
    with pytest.raises(hvac.exceptions.Forbidden):
        kv.create_or_update_secret(path="abada/tool-credentials/crm-token", secret={"value": "mine"})


def test_lookup_self_describes_the_token(vault: FakeVault) -> None:
    token = vault.create_token(ttl=120, renewable=True, policies=["reader"], explicit_max_ttl=600)
    data = client_for(vault, token).auth.token.lookup_self()["data"]
    assert data["id"] == token
    assert data["policies"] == ["default", "reader"]
    assert data["renewable"] is True
    assert data["creation_ttl"] == 120
    assert data["explicit_max_ttl"] == 600
    assert 118 <= data["ttl"] <= 120
    assert data["type"] == "service"
    assert data["expire_time"].endswith("Z") and data["issue_time"].endswith("Z")
    assert data["accessor"]


def test_renew_self_extends_the_ttl_up_to_the_explicit_max(vault: FakeVault) -> None:
    token = vault.create_token(ttl=2, renewable=True, explicit_max_ttl=5)
    client = client_for(vault, token)
    renewed = client.auth.token.renew_self(increment="4s")
    assert renewed["auth"]["lease_duration"] == 4
    assert renewed["auth"]["renewable"] is True
    assert renewed["auth"]["client_token"] == token
    capped = client.auth.token.renew_self(increment="1h")
    assert capped["auth"]["lease_duration"] <= 5
    assert "capped" in capped["warnings"][0]
    default = client.auth.token.renew_self()
    assert default["auth"]["lease_duration"] == 2  # no increment: back to the token's own TTL
    assert "last_renewal_time" in client.auth.token.lookup_self()["data"]
    assert vault.count("POST", "/v1/auth/token/renew-self", status=200) == 3


def test_non_renewable_tokens_and_switched_off_renewals_fail(vault: FakeVault) -> None:
    fixed = client_for(vault, vault.create_token(ttl=60, renewable=False))
    with pytest.raises(hvac.exceptions.InvalidRequest, match="lease is not renewable"):
        fixed.auth.token.renew_self()
    vault.fail_renewals = True
    with pytest.raises(hvac.exceptions.InternalServerError):
        client_for(vault, vault.create_token(ttl=60)).auth.token.renew_self()
    assert vault.count("POST", "/v1/auth/token/renew-self", status=500) == 1


def test_kubernetes_login_checks_the_role_bindings(vault: FakeVault) -> None:
    vault.add_kubernetes_role("abada-broker", ["abada-broker"], ["abada"], ttl=300, policies=["reader"])
    vault.put_secret("abada/tool-credentials/crm-token", {"value": "x"})
    client = hvac.Client(url=vault.url, token="", timeout=2)

    login = client.auth.kubernetes.login(
        role="abada-broker", jwt=make_service_account_jwt("abada-broker", "abada"), use_token=False
    )
    auth = login["auth"]
    assert auth["lease_duration"] == 300 and auth["renewable"] is True
    assert auth["policies"] == ["default", "reader"]
    assert auth["metadata"]["service_account_name"] == "abada-broker"
    assert auth["metadata"]["service_account_namespace"] == "abada"
    client.token = auth["client_token"]
    assert client.secrets.kv.v2.read_secret_version(
        path="abada/tool-credentials/crm-token", raise_on_deleted_version=True
    )

    legacy = make_service_account_jwt("abada-broker", "abada", projected=False)
    assert client.auth.kubernetes.login(role="abada-broker", jwt=legacy, use_token=False)["auth"][
        "client_token"
    ]

    with pytest.raises(hvac.exceptions.Forbidden, match="service account name not authorized"):
        client.auth.kubernetes.login(role="abada-broker", jwt=make_service_account_jwt("intruder", "abada"))
    with pytest.raises(hvac.exceptions.Forbidden, match="namespace not authorized"):
        client.auth.kubernetes.login(
            role="abada-broker", jwt=make_service_account_jwt("abada-broker", "default")
        )
    with pytest.raises(hvac.exceptions.InvalidRequest, match='invalid role name "nope"'):
        client.auth.kubernetes.login(role="nope", jwt=make_service_account_jwt("abada-broker", "abada"))
    with pytest.raises(hvac.exceptions.Forbidden, match="expired"):
        client.auth.kubernetes.login(
            role="abada-broker",
            jwt=make_service_account_jwt("abada-broker", "abada", expires_at=time.time() - 5),
        )
    with pytest.raises(hvac.exceptions.Forbidden, match="malformed"):
        client.auth.kubernetes.login(role="abada-broker", jwt="not-a-jwt")


def test_unsupported_operations_and_unknown_routes(vault: FakeVault) -> None:
    headers = {"X-Vault-Token": vault.root_token}
    lookup_delete = requests.delete(f"{vault.url}/v1/auth/token/lookup-self", headers=headers)
    assert lookup_delete.status_code == 405
    assert "unsupported operation" in lookup_delete.json()["errors"][0]
    assert requests.post(f"{vault.url}/v1/sys/health").status_code == 405
    unknown = requests.get(f"{vault.url}/v1/nomount/data/x", headers=headers)
    assert unknown.status_code == 404
    assert "no handler for route" in unknown.json()["errors"][0]
    bad_json = requests.post(f"{vault.url}/v1/secret/data/k", data=b"{not json", headers=headers)
    assert bad_json.status_code == 400


def test_health_and_seal(vault: FakeVault) -> None:
    client = client_for(vault)
    health = client.sys.read_health_status(method="GET")
    assert health["initialized"] is True and health["sealed"] is False and health["standby"] is False
    vault.sealed = True
    sealed = client.sys.read_health_status(method="GET")
    assert sealed.status_code == 503
    with pytest.raises(hvac.exceptions.VaultDown, match="Vault is sealed"):
        client.auth.token.lookup_self()


def test_going_down_and_coming_back_keeps_state(vault: FakeVault) -> None:
    vault.put_secret("k", {"value": "kept"})
    client = client_for(vault)
    with vault.unreachable():
        assert not vault.running
        with pytest.raises(requests.exceptions.ConnectionError):
            client.secrets.kv.v2.read_secret_version(path="k", raise_on_deleted_version=True)
    assert client.secrets.kv.v2.read_secret_version(path="k", raise_on_deleted_version=True)["data"][
        "data"
    ] == {"value": "kept"}


def test_stalled_vault_makes_clients_time_out(vault: FakeVault) -> None:
    vault.stall_seconds = 5
    client = hvac.Client(url=vault.url, token=vault.root_token, timeout=0.3)
    started = time.perf_counter()
    with pytest.raises(requests.exceptions.Timeout):
        client.auth.token.lookup_self()
    assert time.perf_counter() - started < 2


def test_request_log_never_records_tokens(vault: FakeVault) -> None:
    token = vault.create_token(ttl=60)
    client_for(vault, token).auth.token.lookup_self()
    assert vault.count("GET", "/v1/auth/token/lookup-self") == 1
    assert all(token not in repr(request) for request in vault.requests)
    vault.clear_requests()
    assert vault.requests == []
