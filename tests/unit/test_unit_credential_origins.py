"""Where the broker lets a credential go, on its own: origins, and paths under one gateway."""

from __future__ import annotations

import pathlib

import pytest
from abada_broker.errors import BrokerError
from abada_broker.origins import CredentialOrigins, OriginsFileError

GATEWAY = "https://tools.example.com"


def origins(tmp_path: pathlib.Path, text: str) -> CredentialOrigins:
    path = tmp_path / "origins.yaml"
    path.write_text(text)
    return CredentialOrigins(path)


def refused(check: CredentialOrigins, credential: str, url: str) -> str:
    with pytest.raises(BrokerError) as caught:
        check.check(credential, url)
    assert caught.value.reason_name == "CREDENTIAL_ORIGIN_NOT_ALLOWED"
    return str(caught.value)


def test_two_tool_servers_behind_one_gateway_do_not_share_credentials(tmp_path):
    check = origins(tmp_path, f"crm-token: [{GATEWAY}/crm]\nbilling-token: [{GATEWAY}/billing/]\n")
    check.check("crm-token", f"{GATEWAY}/crm")
    check.check("crm-token", f"{GATEWAY}/crm/mcp")
    check.check("crm-token", f"{GATEWAY}:443/crm/mcp?x=1")
    check.check("billing-token", f"{GATEWAY}/billing/mcp")
    assert "may not be sent to /billing/mcp" in refused(check, "crm-token", f"{GATEWAY}/billing/mcp")
    assert "may not be sent to /crm-other/mcp" in refused(check, "crm-token", f"{GATEWAY}/crm-other/mcp")
    refused(check, "billing-token", f"{GATEWAY}/crm/mcp")
    refused(check, "crm-token", f"{GATEWAY}/")


@pytest.mark.parametrize(
    "path",
    [
        "/crm/../billing/mcp",
        "/crm/./../billing",
        "/crm/%2e%2e/billing",
        "/crm/%2E%2E/billing",
        "/crm%2f..%2fbilling",
        "/crm/..%5cbilling",
        "/crm\\..\\billing",
        "/crm/.%2e/billing",
    ],
)
def test_a_path_another_reader_could_resolve_elsewhere_is_refused(tmp_path, path):
    check = origins(tmp_path, f"crm-token: [{GATEWAY}/crm]\n")
    refused(check, "crm-token", GATEWAY + path)


def test_an_entry_without_a_path_allows_the_whole_origin(tmp_path):
    check = origins(tmp_path, f"crm-token: [{GATEWAY}]\n")
    check.check("crm-token", f"{GATEWAY}/anything/mcp")
    refused(check, "crm-token", "https://other.example.com/crm")


def test_an_origins_file_entry_with_a_dot_segment_stops_the_broker(tmp_path):
    with pytest.raises(OriginsFileError, match=r"'\.\.' segment"):
        origins(tmp_path, f"crm-token: [{GATEWAY}/crm/../billing]\n")
