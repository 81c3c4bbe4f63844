"""Deploy-time contract check: every bound tool exists on its live MCP server with the pinned schema.

For each tool server of a bundle the engine opens an MCP session over streamable-http (with the
server's credential from the credential source), lists the tools and compares. The observed
input-schema hashes are frozen into the definition version, so the worker can detect a server
that changed after deploy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
from typing import Any, Protocol

import grpc
import httpx2
import yaml
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.bearer_auth import BearerAuth
from abada_common.capped_http import CappedTransport, ResponseTooLarge
from abada_common.tool_limits import MAX_RESPONSE_BYTES, MAX_TOOL_LIST_PAGES, MAX_TOOLS, TooMuchFromServer
from abada_common.tool_schemas import description_sha256, schema_sha256
from abada_sdk.connection import BearerToken, ClientTls, Connection, ConnectionConfigError
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp_types import PaginatedRequestParams, Tool

from abada_engine.errors import Category, EngineError, precondition

from .catalog import ObservedSchemas, ObservedTool
from .model import Bundle, ToolServerSpec
from .schemas import MAX_SCHEMA_BYTES

log = logging.getLogger(__name__)


class CredentialSource(Protocol):
    async def secret(self, credential: str, server: str, url: str, deployed_by: str) -> str:
        """The secret of `credential`, to be sent to `url` for the deploy of operator `deployed_by`."""
        ...


class FileCredentials:
    """Credentials from a YAML file (name: value), read on every deploy so rotation needs no restart."""

    def __init__(self, path: pathlib.Path) -> None:
        self._path = path

    async def secret(self, credential: str, server: str, url: str, deployed_by: str) -> str:
        try:
            data = yaml.safe_load(self._path.read_text()) or {}
        except (OSError, yaml.YAMLError) as error:
            raise EngineError(
                Category.UNAVAILABLE,
                ErrorReason.CREDENTIAL_UNAVAILABLE,
                f"cannot read the deploy credentials file: {type(error).__name__}",
            ) from None
        value = data.get(credential)
        if isinstance(value, dict):
            value = value.get("value")
        if not isinstance(value, str) or not value:
            raise precondition(
                ErrorReason.CREDENTIAL_NOT_FOUND,
                f"no credential {credential!r} for tool server {server!r}",
                f"tool_servers.{server}.credential",
            )
        return value


class McpContractCheck:
    def __init__(self, credentials: CredentialSource | None, timeout_seconds: float = 10.0) -> None:
        self._credentials = credentials
        self._timeout = timeout_seconds

    async def __call__(self, bundle: Bundle, deployed_by: str) -> ObservedSchemas:
        results = await asyncio.gather(
            *(self._check_server(server, deployed_by) for server in bundle.tool_servers.values()),
            return_exceptions=True,
        )
        observed: ObservedSchemas = {}
        for result in results:
            if isinstance(result, BaseException):
                raise result
            observed.update(result)
        return observed

    async def _check_server(self, server: ToolServerSpec, deployed_by: str) -> ObservedSchemas:
        secret = None
        if server.credential and self._credentials is not None:
            secret = await self._credentials.secret(server.credential, server.name, server.url, deployed_by)
        refusals: list[int] = []
        transport = CappedTransport()
        try:
            listed = await asyncio.wait_for(
                self._list_tools(server.url, secret, refusals, transport), timeout=self._timeout
            )
        except EngineError:
            raise
        except (TimeoutError, Exception) as error:  # any transport failure means the same to the deployer
            over = _innermost(error)
            if transport.over_limit and not isinstance(over, TooMuchFromServer):
                over = ResponseTooLarge(server.url, MAX_RESPONSE_BYTES)
            if isinstance(over, TooMuchFromServer):
                raise _at_url(
                    server,
                    Category.FAILED_PRECONDITION,
                    ErrorReason.TOOL_SERVER_OVER_LIMIT,
                    f"was not listened to further: {over}",
                ) from None
            if refusals:
                raise _refused(server, refusals[0], secret is not None) from None
            cause = (
                "no answer within the deploy timeout" if isinstance(error, TimeoutError) else _describe(error)
            )
            raise _at_url(
                server, Category.UNAVAILABLE, ErrorReason.TOOL_SERVER_UNAVAILABLE, f"is unreachable: {cause}"
            ) from None
        observed: ObservedSchemas = {}
        for tool in server.tools.values():
            if tool.name not in listed:
                raise _mismatch(
                    server,
                    tool.name,
                    f"tool {tool.name!r} is not offered by server {server.name!r} "
                    f"(it offers: {', '.join(sorted(listed)) or 'nothing'})",
                )
            digest = schema_sha256(listed[tool.name].input_schema)
            if tool.input_schema_sha256 and tool.input_schema_sha256 != digest:
                raise _mismatch(
                    server,
                    tool.name,
                    f"the input schema of {server.name}/{tool.name} changed: pinned "
                    f"sha256 {tool.input_schema_sha256}, server has {digest}",
                )
            observed[(server.name, tool.name)] = ObservedTool(
                digest,
                description_sha256(listed[tool.name].description),
                _kept_schema(listed[tool.name].input_schema),
            )
        return observed

    async def _list_tools(
        self, url: str, secret: str | None, refusals: list[int], transport: CappedTransport
    ) -> dict[str, Tool]:
        """The server's tools by name; a 401/403 answer is noted in `refusals` on the way."""
        auth = BearerAuth(lambda: secret) if secret else None

        async def note_refusal(response: httpx2.Response) -> None:
            if response.status_code in (401, 403):
                refusals.append(response.status_code)

        hooks = {"response": [note_refusal]}
        # trust_env off: a proxy set in the engine's environment must never carry deploy credentials.
        # Every answer is counted as it streams in and cut off at the limit (the MCP client may wrap or
        # swallow the error; the transport remembers it).
        async with httpx2.AsyncClient(
            auth=auth, timeout=self._timeout, event_hooks=hooks, trust_env=False, transport=transport
        ) as http:
            async with streamable_http_client(url, http_client=http) as (read_stream, write_stream):
                async with ClientSession(read_stream, write_stream) as session:
                    await session.initialize()
                    tools: dict[str, Tool] = {}
                    cursor = None
                    for _ in range(MAX_TOOL_LIST_PAGES):
                        params = PaginatedRequestParams(cursor=cursor) if cursor else None
                        page = await session.list_tools(params=params)
                        for tool in page.tools:
                            tools[tool.name] = tool
                        if len(tools) > MAX_TOOLS:
                            raise TooMuchFromServer(f"it lists more than {MAX_TOOLS} tools")
                        cursor = page.next_cursor
                        if not cursor:
                            return tools
                    raise TooMuchFromServer(f"its tool list goes on past {MAX_TOOL_LIST_PAGES} pages")


def _at_url(server: ToolServerSpec, category: Category, reason: ErrorReason, what: str) -> EngineError:
    """The server at its url could not be heard out; `what` says how."""
    return EngineError(
        category,
        reason,
        f"tool server {server.name!r} at {server.url} {what}",
        field=f"tool_servers.{server.name}.url",
        metadata={"server": server.name},
    )


def _refused(server: ToolServerSpec, status: int, sent_credential: bool) -> EngineError:
    """The server wants credentials: say which is missing or refused, not that the server is unreachable."""
    answered = f"tool server {server.name!r} at {server.url} answered {status} {'Unauthorized' if status == 401 else 'Forbidden'}"
    if not server.credential:
        why = "the bundle names no credential for it (tool_servers[].credential)"
    elif not sent_credential:
        why = (
            f"the engine has no credential source to read {server.credential!r} from: "
            "set ABADA_BROKER_ADDRESS (with ABADA_BROKER_TOKEN_FILE) or ABADA_DEPLOY_CREDENTIALS_FILE"
        )
    else:
        why = f"it refused the credential {server.credential!r}"
    return precondition(
        ErrorReason.TOOL_SERVER_UNAUTHORIZED,
        f"{answered}: {why}",
        f"tool_servers.{server.name}.credential",
        metadata={"server": server.name, "status": str(status)},
    )


def _mismatch(server: ToolServerSpec, tool: str, message: str) -> EngineError:
    return precondition(
        ErrorReason.TOOL_CONTRACT_MISMATCH,
        message,
        f"tool_servers.{server.name}.tools.{tool}",
        metadata={"server": server.name, "tool": tool},
    )


def _innermost(error: BaseException) -> BaseException:
    # Task groups wrap the real cause; the innermost one says what happened.
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _describe(error: BaseException) -> str:
    error = _innermost(error)
    return f"{type(error).__name__}: {error}"[:300]


class BrokerCredentials:
    """Credentials through the credential broker (purpose: deploy), so only the broker touches Vault."""

    def __init__(self, address: str, token_file: pathlib.Path | None, tls: ClientTls | None = None) -> None:
        self._address = address
        self._token_file = token_file
        self._tls = tls or ClientTls()

    async def secret(self, credential: str, server: str, url: str, deployed_by: str) -> str:
        try:
            # Built for each deployment: the token file and the TLS files are read now, so a rotated
            # one is used at once.
            connection = Connection(
                self._address, token=BearerToken(token_file=self._token_file), tls=self._tls
            )
            channel = connection.open_aio_channel()
        except ConnectionConfigError as error:
            raise EngineError(
                Category.UNAVAILABLE,
                ErrorReason.CREDENTIAL_UNAVAILABLE,
                f"cannot reach the broker: {error}",
                field=f"tool_servers.{server}.credential",
            ) from None
        async with channel:
            stub = credential_pb2_grpc.CredentialServiceStub(channel)
            try:
                answer = await stub.GetDeployCredential(
                    credential_pb2.GetDeployCredentialRequest(
                        credential=credential, server=server, url=url, on_behalf_of=deployed_by
                    ),
                    metadata=connection.metadata,
                    timeout=10,
                )
            except grpc.aio.AioRpcError as error:
                category = (
                    Category.UNAVAILABLE
                    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                    else Category.FAILED_PRECONDITION
                )
                # The broker's reason (CREDENTIAL_ORIGIN_NOT_ALLOWED, ...) and message are the deployer's to see.
                raise EngineError(
                    category,
                    ErrorReason.CREDENTIAL_UNAVAILABLE,
                    f"the broker did not give credential {credential!r}: {error.code().name}: {error.details()}",
                    field=f"tool_servers.{server}.credential",
                ) from None
        return answer.secret


def _broker_tls_from_env(env: dict[str, str]) -> ClientTls:
    ca, cert, key = (env.get(f"ABADA_BROKER_TLS_{name}_FILE") for name in ("CA", "CERT", "KEY"))
    if bool(cert) != bool(key):
        raise ValueError("ABADA_BROKER_TLS_CERT_FILE and ABADA_BROKER_TLS_KEY_FILE go together")
    if not ca and cert:
        # Without the CA the broker would be dialed in plaintext and the certificate never shown.
        raise ValueError("ABADA_BROKER_TLS_CERT_FILE needs ABADA_BROKER_TLS_CA_FILE")
    return ClientTls(*(pathlib.Path(path) if path else None for path in (ca, cert, key)))


def credentials_from_env(env: dict[str, str]) -> CredentialSource | None:
    """The deploy-time credential source; a partial ABADA_BROKER_TLS_* set raises ValueError."""
    if env.get("ABADA_BROKER_ADDRESS"):
        token_file = env.get("ABADA_BROKER_TOKEN_FILE")
        return BrokerCredentials(
            env["ABADA_BROKER_ADDRESS"],
            pathlib.Path(token_file) if token_file else None,
            _broker_tls_from_env(env),
        )
    if env.get("ABADA_DEPLOY_CREDENTIALS_FILE"):
        return FileCredentials(pathlib.Path(env["ABADA_DEPLOY_CREDENTIALS_FILE"]))
    return None


def _kept_schema(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The input schema to freeze with the binding (approval forms are built from it), or None when it
    is larger than any schema the engine keeps: its sha256 still pins it."""
    if len(json.dumps(schema, separators=(",", ":"))) > MAX_SCHEMA_BYTES:
        return None
    return dict(schema)
