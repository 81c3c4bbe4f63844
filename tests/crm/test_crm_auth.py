"""Bearer auth in front of MCP and the ticket listing, including a credential rotated without restart."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest
from crm_mcp.testing import RunningCrmServer, running_crm_server
from crm_mcp_client import call_tool, crm_session, result_json
from mcp.shared.exceptions import MCPError

INITIALIZE_REQUEST = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "crm-auth-test", "version": "0"},
    },
}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def crm() -> Iterator[RunningCrmServer]:
    with running_crm_server(token="old-token,new-token") as server:
        yield server


async def post_initialize(url: str, authorization: str | None) -> httpx2.Response:
    headers = dict(MCP_HEADERS)
    if authorization is not None:
        headers["Authorization"] = authorization
    async with httpx2.AsyncClient(timeout=10.0) as http:
        return await http.post(url, json=INITIALIZE_REQUEST, headers=headers)


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer wrong-token", "Basic b2xkLXRva2VuOg==", "Bearer", "Bearer old-token,new-token"],
)
async def test_mcp_without_a_valid_bearer_token_gets_401(
    crm: RunningCrmServer, authorization: str | None
) -> None:
    response = await post_initialize(crm.url, authorization)

    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("token", ["old-token", "new-token"])
async def test_every_token_of_the_configured_list_is_accepted(crm: RunningCrmServer, token: str) -> None:
    response = await post_initialize(crm.url, f"Bearer {token}")

    assert response.status_code == 200


async def test_the_ticket_listing_needs_the_token_too(crm: RunningCrmServer) -> None:
    async with httpx2.AsyncClient(timeout=10.0) as http:
        anonymous = await http.get(crm.base_url + "/tickets")
        wrong = await http.get(crm.base_url + "/tickets", headers={"Authorization": "Bearer nope"})
        allowed = await http.get(crm.base_url + "/tickets", headers={"Authorization": "Bearer new-token"})

    assert (anonymous.status_code, wrong.status_code, allowed.status_code) == (401, 401, 200)
    assert isinstance(allowed.json(), list)


async def test_the_mcp_client_with_a_wrong_token_cannot_connect(crm: RunningCrmServer) -> None:
    with pytest.raises(ExceptionGroup) as refused:
        async with crm_session(crm.url, "wrong-token") as session:
            await session.list_tools()

    assert refused.group_contains(MCPError, depth=None)
    assert "refused POST /mcp from 127.0.0.1: invalid bearer token" in crm.log_path.read_text()


def write_tokens(path: Path, text: str, bump_mtime_ns: int) -> None:
    path.write_text(text)
    # Guarantee a visible change even on coarse-timestamp file systems.
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + bump_mtime_ns))


async def test_a_rotated_token_file_takes_effect_without_restart(tmp_path: Path) -> None:
    token_file = tmp_path / "crm-token"
    write_tokens(token_file, "first-secret\n", 0)
    with running_crm_server(token_file=token_file) as crm:
        async with crm_session(crm.url, "first-secret") as session:
            alice = result_json(await call_tool(session, "get_customer", {"customerId": "C-42"}))
        assert alice["name"] == "Alice Martin"

        write_tokens(token_file, "first-secret,second-secret", 1_000_000)
        overlap = [
            (await post_initialize(crm.url, f"Bearer {t}")).status_code
            for t in ("first-secret", "second-secret")
        ]

        write_tokens(token_file, "second-secret", 2_000_000)
        after = [
            (await post_initialize(crm.url, f"Bearer {t}")).status_code
            for t in ("first-secret", "second-secret")
        ]

        token_file.unlink()
        without_file = (await post_initialize(crm.url, "Bearer second-secret")).status_code

    assert overlap == [200, 200]
    assert after == [401, 200]
    assert without_file == 401
