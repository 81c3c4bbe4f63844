"""MCP tool servers for one attempt: one session per server, the contract check, and the calls.

A failed exchange is told apart once, here (`_failure`): connection refused or reset, a timeout, a
session the server forgot, 5xx and 429 pass with time (`DependencyDown`: the attempt waits the outage
out with every other worker); a rejected credential, an endpoint that is not there or another refusal
does not (`ToolServerRefused`: an incident at once).

The credential travels as an `httpx2.Auth`, never in the journal or the model's view. A write's
idempotency key goes in `_meta.idempotencyKey` and in the `Idempotency-Key` header; `call_tool`
takes no per-call headers, so a request hook reads the key from a context variable set just
before the call (the transport posts in the caller's context).
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any, cast

import httpx2
from abada_common.bearer_auth import BearerAuth
from abada_common.capped_http import CappedTransport, ResponseTooLarge
from abada_common.tool_limits import MAX_RESPONSE_BYTES, MAX_TOOL_LIST_PAGES, MAX_TOOLS, TooMuchFromServer
from abada_common.tool_schemas import description_sha256, schema_sha256
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    REQUEST_TIMEOUT,
    CallToolResult,
    PaginatedRequestParams,
    RequestParamsMeta,
    Tool,
)

from .broker_client import Secret
from .dependencies import DependencyDown, tool_server
from .errors import AttemptEnded, AttemptFailed
from .fault import FaultPlan
from .step_payloads import error_result
from .work import ToolBinding

IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_META_KEY = "idempotencyKey"
SUPPORTED_TRANSPORTS = frozenset({"streamable-http", ""})

_idempotency_key: ContextVar[str | None] = ContextVar("abada_worker_idempotency_key", default=None)


# HTTP statuses of a tool server that pass with time (a restart, an overload, a rate limit).
_PASSING_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
# The server rejected the worker's credential.
CREDENTIAL_STATUSES = frozenset({401, 403})


class ToolServerRefused(AttemptFailed):
    """The server answered, and refused: a rejected credential, an endpoint that is not there, a call
    it cannot serve. Waiting will not change it: an incident at once, naming the server and why."""

    def __init__(self, server: str, message: str, status: int | None = None) -> None:
        details: dict[str, Any] = {"server": server}
        if status is not None:
            details["http_status"] = status
        super().__init__("TOOL_SERVER_REFUSED", message, no_retry=True, details=details)


class _LastStatus:
    """The HTTP status of the server's last answer that was not a success: the MCP client turns a
    failed POST into a JSON-RPC error without it, and it tells an outage from a refusal."""

    def __init__(self, transport: CappedTransport | None = None) -> None:
        self.status: int | None = None
        self._transport = transport

    @property
    def over_limit(self) -> bool:
        """Whether an answer went past the response size limit (`capped_http`)."""
        return self._transport is not None and self._transport.over_limit

    async def record(self, response: httpx2.Response) -> None:
        if response.status_code >= 400:
            self.status = response.status_code


def _failure(name: str, url: str, error: BaseException, last: _LastStatus, *, opening: bool) -> Exception:
    """What a failed exchange with a tool server means: `DependencyDown` when it passes with time
    (connection refused or reset, a timeout, a lost session, 5xx, 429), `ToolServerRefused` otherwise."""
    where = f"tool server {name!r} at {url}"
    if last.over_limit or isinstance(error, TooMuchFromServer):
        # Asking again gets the same answer: a refusal, never an outage to wait out. (A body past the
        # size limit is a TooMuchFromServer too, though a client library may have wrapped it.)
        why = (
            str(error)
            if isinstance(error, TooMuchFromServer) and not isinstance(error, ResponseTooLarge)
            else f"answered more than {MAX_RESPONSE_BYTES} bytes"
        )
        return ToolServerRefused(name, f"{where} {why}; it was not listened to further")
    if isinstance(error, MCPError):
        status = last.status
        if error.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT):
            return DependencyDown(tool_server(name), f"{where}: {error.message}")
        if error.code == INVALID_REQUEST and error.message == "Session terminated":
            # The server forgot the session (it restarted): a new session will do.
            return DependencyDown(tool_server(name), f"{where} lost the session: {error.message}")
        if status in CREDENTIAL_STATUSES:
            return ToolServerRefused(name, f"{where} rejected the credential ({status})", status)
        if error.code == METHOD_NOT_FOUND and opening:
            return ToolServerRefused(name, f"{where} serves no MCP endpoint there (404)", 404)
        if status is not None and (status in _PASSING_STATUSES or status >= 500):
            return DependencyDown(tool_server(name), f"{where} answered {status}: {error.message}")
        if status is not None:
            return ToolServerRefused(name, f"{where} refused the request ({status}): {error.message}", status)
        return ToolServerRefused(name, f"{where} answered with an error: {error.message} ({error.code})")
    return DependencyDown(tool_server(name), f"cannot talk to {where}: {_describe(error)}")


@dataclass(frozen=True)
class ContractMismatch:
    server: str
    tool: str
    problem: str
    expected_sha256: str = ""
    observed_sha256: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def check_contract(bindings: Iterable[ToolBinding], listed: dict[str, Tool]) -> list[ContractMismatch]:
    """Every bound tool must still exist, with the input schema and description frozen at deploy time.

    The description goes to the model as instructions, so a server that rewrites it after deploy
    changes what the model is told as surely as a changed schema changes what it may send.
    """
    mismatches: list[ContractMismatch] = []
    for binding in bindings:
        tool = listed.get(binding.tool)
        if tool is None:
            mismatches.append(ContractMismatch(binding.server, binding.tool, "missing"))
            continue
        for change, pinned, seen in (
            ("input schema changed", binding.input_schema_sha256, schema_sha256(tool.input_schema)),
            ("description changed", binding.description_sha256, description_sha256(tool.description)),
        ):
            if pinned and seen != pinned:
                mismatches.append(ContractMismatch(binding.server, binding.tool, change, pinned, seen))
    return mismatches


async def _add_idempotency_header(request: httpx2.Request) -> None:
    key = _idempotency_key.get()
    if key is not None:
        request.headers[IDEMPOTENCY_HEADER] = key


@cache
def _shared_tls_context() -> ssl.SSLContext:
    # Loading the CA bundle costs about a megabyte per client; fifty concurrent tasks share one.
    return httpx2.create_ssl_context()


class ToolServer:
    """An initialized MCP session to one server."""

    def __init__(self, name: str, url: str, session: ClientSession, last: _LastStatus | None = None) -> None:
        self.name = name
        self._url = url
        self._session = session
        self._last = last if last is not None else _LastStatus()

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(
        cls,
        name: str,
        url: str,
        credential: Secret | None,
        *,
        timeout_seconds: float,
        fault: FaultPlan | None = None,
    ) -> AsyncIterator[ToolServer]:
        transport = CappedTransport(verify=_shared_tls_context())
        last = _LastStatus(transport)
        hooks: dict[str, list[Any]] = {"request": [_add_idempotency_header], "response": [last.record]}
        fault_hook = fault.response_hook(name) if fault is not None else None
        if fault_hook is not None:
            hooks["response"].append(fault_hook)
        in_use = False
        try:
            async with (
                httpx2.AsyncClient(
                    auth=BearerAuth(credential.reveal) if credential is not None else None,
                    event_hooks=hooks,
                    timeout=httpx2.Timeout(timeout_seconds),
                    transport=transport,
                    trust_env=False,
                ) as http,
                streamable_http_client(url, http_client=http) as (read_stream, write_stream),
                ClientSession(read_stream, write_stream) as session,
            ):
                await session.initialize()
                in_use = True
                yield cls(name, url, session, last)
        except BaseExceptionGroup as group:
            # The transport's task group wraps whatever crosses it, the caller's own exceptions included.
            error = primary_error(group)
            if not _is_transport_error(error):
                raise error from None
            raise _failure(name, url, error, last, opening=not in_use) from error
        except (httpx2.HTTPError, MCPError, OSError) as error:
            raise _failure(name, url, error, last, opening=not in_use) from error

    def _failed(self, error: BaseException, *, opening: bool) -> Exception:
        return _failure(self.name, self._url, error, self._last, opening=opening)

    async def list_tools(self) -> dict[str, Tool]:
        listed: dict[str, Tool] = {}
        cursor: str | None = None
        for _ in range(MAX_TOOL_LIST_PAGES):
            try:
                page = await self._session.list_tools(
                    params=PaginatedRequestParams(cursor=cursor) if cursor is not None else None
                )
            except (MCPError, httpx2.HTTPError, OSError) as error:
                raise self._failed(error, opening=True) from error
            listed.update((tool.name, tool) for tool in page.tools)
            if len(listed) > MAX_TOOLS:
                raise self._failed(TooMuchFromServer(f"lists more than {MAX_TOOLS} tools"), opening=True)
            cursor = page.next_cursor
            if not cursor:
                return listed
        raise self._failed(
            TooMuchFromServer(f"has a tool list that goes on past {MAX_TOOL_LIST_PAGES} pages"), opening=True
        )

    async def call(
        self, tool: str, arguments: dict[str, Any], idempotency_key: str | None, timeout_seconds: float
    ) -> dict[str, Any]:
        """The CallToolResult as JSON; a tool error comes back as a result with `isError`, not raised."""
        # RequestParamsMeta is an open TypedDict (extra_items=Any), which mypy does not read yet.
        meta = (
            cast(RequestParamsMeta, {IDEMPOTENCY_META_KEY: idempotency_key})
            if idempotency_key is not None
            else None
        )
        reset = _idempotency_key.set(idempotency_key)
        self._last.status = None
        try:
            result = await self._session.call_tool(
                tool, arguments, read_timeout_seconds=timeout_seconds, meta=meta
            )
        except MCPError as error:
            if error.code == INVALID_PARAMS:
                return error_result(f"The server refused the arguments: {error.message}")
            raise self._failed(error, opening=False) from None
        except (httpx2.HTTPError, OSError) as error:
            raise self._failed(error, opening=False) from error
        except RuntimeError as error:
            # Raised after the answer arrived, e.g. structured content that breaks the declared output schema.
            return error_result(f"The tool's answer could not be used: {error}")
        finally:
            _idempotency_key.reset(reset)
        return _result_json(result)


def primary_error(group: BaseExceptionGroup) -> BaseException:
    """The exception that matters in a group: the worker's own first, then anything but a cancellation."""
    leaves = list(_leaves(group))
    for leaf in leaves:
        if isinstance(leaf, AttemptEnded):
            return leaf
    for leaf in leaves:
        if not isinstance(leaf, asyncio.CancelledError):
            return leaf
    return leaves[0]


def _leaves(error: BaseException) -> Iterator[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            yield from _leaves(inner)
    else:
        yield error


def _is_transport_error(error: BaseException) -> bool:
    return isinstance(error, httpx2.HTTPError | MCPError | OSError)


def _describe(error: BaseException) -> str:
    if isinstance(error, MCPError):
        return error.message
    return str(error) or type(error).__name__


def _result_json(result: CallToolResult) -> dict[str, Any]:
    dumped = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    return {
        "content": dumped.get("content", []),
        **({"structuredContent": dumped["structuredContent"]} if "structuredContent" in dumped else {}),
        "isError": bool(dumped.get("isError", False)),
    }


def unsupported_transports(bindings: Sequence[ToolBinding]) -> list[ToolBinding]:
    return [binding for binding in bindings if binding.transport not in SUPPORTED_TRANSPORTS]
