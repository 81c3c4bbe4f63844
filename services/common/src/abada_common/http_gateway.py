"""HTTP/JSON beside gRPC: every RPC on the REST path its `google.api.http` rule names, with no route
written by hand.

At start the gateway reads the HTTP rules from the service descriptors (the path templates, which
fields the body, the path and the query fill) and answers each request by calling the same servicer
method gRPC calls, with a `ServicerContext`-compatible `HttpCallContext`: the bearer token travels as
the `authorization` metadata, so authentication, roles, limits and refusals (ErrorInfo, BadRequest,
RetryInfo) are the servicer's own. Calling the servicer in-process rather than looping back through a
gRPC channel saves a second encoding, an HTTP/2 round trip and a copy of every limit; the servicers
read only the context's metadata, peer and auth context, and end a call with `abort`, which the
adapter turns into the refusal it carries.

Refusals answer the HTTP status grpc-gateway gives each gRPC code, with the `google.rpc.Status` as
JSON (`code`, `message`, `details` with `@type`), `Retry-After` when it carries a RetryInfo.
"""

from __future__ import annotations

import json
import logging
import math
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
from google.api import annotations_pb2, http_pb2
from google.protobuf import descriptor, json_format, message, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.rpc import error_details_pb2, status_pb2
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import request_response

from . import rpc_status
from .errors import Category

log = logging.getLogger(__name__)

# The HTTP status grpc-gateway answers for each gRPC code.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}
_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}

# The lease token may come as this header instead of in the body or query (it is a secret: a header
# stays out of access logs that record URLs).
LEASE_TOKEN_HEADER = "abada-lease-token"
# How deep a JSON body may nest, objects and arrays together: deeper than any Abada message needs
# (a Struct included), shallow enough that no parser recursion limit is ever near.
MAX_JSON_DEPTH = 64
# Headers that describe the HTTP exchange itself, not the call: never handed on as metadata.
_NOT_METADATA = frozenset(
    {"host", "content-length", "content-type", "connection", "accept", "accept-encoding", "user-agent"}
)
_STRUCT_TYPES = frozenset({"google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue"})


class HttpAbort(grpc.aio.AbortError):
    """What `HttpCallContext.abort` raises: the refusal, for the gateway to answer with."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self.status = status


class HttpCallContext:
    """The part of `grpc.aio.ServicerContext` the servicers use, over one HTTP request."""

    def __init__(
        self, metadata: Sequence[tuple[str, str]], peer: str, common_name: str | None = None
    ) -> None:
        self._metadata = tuple(metadata)
        self._peer = peer
        self._common_name = common_name
        self.trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()
        self.code: grpc.StatusCode | None = None
        self.details: str | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict[str, list[bytes]]:
        if self._common_name is None:
            return {}
        return {"x509_common_name": [self._common_name.encode()]}

    def set_trailing_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        self.trailing_metadata = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    async def send_initial_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> None:
        return None

    def time_remaining(self) -> float | None:
        return None

    def cancelled(self) -> bool:
        return False

    def done(self) -> bool:
        return False

    async def abort(
        self,
        code: grpc.StatusCode,
        details: str = "",
        trailing_metadata: Iterable[tuple[str, str | bytes]] = (),
    ) -> None:
        for key, value in trailing_metadata:
            if key == rpc_status.DETAILS_KEY and isinstance(value, bytes):
                raise HttpAbort(status_pb2.Status.FromString(value))
        raise HttpAbort(status_pb2.Status(code=code.value[0], message=details))


@dataclass(frozen=True)
class PathTemplate:
    """One `google.api.http` path: a regular expression over the raw path and the fields it fills."""

    template: str
    pattern: re.Pattern[str]
    fields: tuple[str, ...]

    @classmethod
    def parse(cls, template: str) -> PathTemplate:
        path, verb = template, ""
        last = template.rsplit("/", 1)[-1]
        if ":" in last and "}" not in last.split(":", 1)[1]:
            path, _, verb = template.rpartition(":")
        fields: list[str] = []
        parts: list[str] = []
        position = 0
        for match in re.finditer(r"\{([a-zA-Z0-9_.]+)(?:=([^}]*))?\}", path):
            parts.append(re.escape(path[position : match.start()]))
            fields.append(match.group(1))
            wildcard = match.group(2) or "*"
            # `*` is one segment; `**` (rare) any number of them.
            parts.append(f"(?P<v{len(fields) - 1}>{'.+' if wildcard == '**' else '[^/]+?'})")
            position = match.end()
        parts.append(re.escape(path[position:]))
        if verb:
            parts.append(re.escape(":" + verb))
        return cls(template, re.compile("^" + "".join(parts) + "$"), tuple(fields))

    def match(self, raw_path: str) -> dict[str, str] | None:
        found = self.pattern.match(raw_path)
        if found is None:
            return None
        return {name: urllib.parse.unquote(found.group(f"v{i}")) for i, name in enumerate(self.fields)}

    @property
    def openapi_path(self) -> str:
        return re.sub(r"\{([a-zA-Z0-9_.]+)(?:=[^}]*)?\}", r"{\1}", self.template)


@dataclass(frozen=True)
class Binding:
    """One HTTP way into one RPC."""

    service: str
    method: descriptor.MethodDescriptor
    http_method: str
    path: PathTemplate
    body: str  # "*", a field name, or "" (no body: every other field from the query)
    response_body: str
    index: int  # 0 for the rule itself, 1.. for its additional bindings

    @property
    def operation_id(self) -> str:
        name = f"{self.method.containing_service.name}_{self.method.name}"
        return name if self.index == 0 else f"{name}_{self.index + 1}"


def http_rules(method: descriptor.MethodDescriptor) -> list[http_pb2.HttpRule]:
    """The method's HTTP rule and its additional bindings, in order; empty without one."""
    options = method.GetOptions()
    if not options.HasExtension(annotations_pb2.http):
        return []
    rule: http_pb2.HttpRule = options.Extensions[annotations_pb2.http]
    return [rule, *rule.additional_bindings]


def bindings(services: Iterable[descriptor.ServiceDescriptor]) -> list[Binding]:
    found: list[Binding] = []
    for service in services:
        for method in service.methods:
            if method.client_streaming or method.server_streaming:
                continue  # one JSON body in, one out: a stream has no such answer here
            for index, rule in enumerate(http_rules(method)):
                verb = rule.WhichOneof("pattern")
                if verb is None:
                    continue
                template = rule.custom.path if verb == "custom" else getattr(rule, verb)
                http_method = rule.custom.kind.upper() if verb == "custom" else verb.upper()
                found.append(
                    Binding(
                        service.full_name,
                        method,
                        http_method,
                        PathTemplate.parse(template),
                        rule.body,
                        rule.response_body,
                        index,
                    )
                )
    return found


class BadRequest(Exception):
    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name}: {problem}" if field_name else problem)
        self.field_name = field_name
        self.problem = problem


def _enum_prefix(enum: descriptor.EnumDescriptor) -> str:
    first = enum.values[0].name if enum.values else ""
    return first[: -len("UNSPECIFIED")] if first.endswith("_UNSPECIFIED") else ""


def _enum_value(value: Any, enum: descriptor.EnumDescriptor, where: str) -> Any:
    """A short enum name (`TOOL_CALL`) as its full one (`STEP_KIND_TOOL_CALL`); others as they are."""
    if isinstance(value, str) and value not in enum.values_by_name:
        full = _enum_prefix(enum) + value
        if full in enum.values_by_name:
            return full
        names = ", ".join(v.name for v in enum.values[1:])
        raise BadRequest(where, f"{value[:60]!r} is not one of {names}")
    return value


def _field_by_json(message_type: descriptor.Descriptor, key: str) -> FieldDescriptor | None:
    found = message_type.fields_by_name.get(key)
    if found is not None:
        return found
    for candidate in message_type.fields:
        if candidate.json_name == key:
            return candidate
    return None


def _depth(value: Any) -> int:
    """How deep `value` nests (objects and arrays), walked without recursion."""
    deepest = 0
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth + 1)
            pending.extend((child, depth + 1) for child in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth + 1)
            pending.extend((child, depth + 1) for child in item)
    return deepest


def _normalise(value: Any, message_type: descriptor.Descriptor, where: str) -> Any:
    """The JSON object for `message_type` with short enum names made full and unknown fields refused,
    each problem naming its field (json_format's own messages do not name it reliably)."""
    if message_type.full_name in _STRUCT_TYPES or message_type.full_name.startswith("google.protobuf."):
        return value
    if not isinstance(value, dict):
        raise BadRequest(where, "must be a JSON object")
    out: dict[str, Any] = {}
    for key, item in value.items():
        path = f"{where}.{key}" if where else key
        found = _field_by_json(message_type, key)
        if found is None:
            raise BadRequest(path, f"{message_type.name} has no such field")
        out[key] = _normalise_field(item, found, path)
    return out


def _normalise_field(value: Any, found: FieldDescriptor, where: str) -> Any:
    if value is None:
        return value
    if found.message_type is not None and found.message_type.GetOptions().map_entry:
        if not isinstance(value, dict):
            raise BadRequest(where, "must be a JSON object")
        value_field = found.message_type.fields_by_name["value"]
        return {k: _normalise_field(v, value_field, f"{where}.{k}") for k, v in value.items()}
    if found.is_repeated:
        if not isinstance(value, list):
            raise BadRequest(where, "must be a JSON array")
        return [_normalise_single(v, found, f"{where}[{i}]") for i, v in enumerate(value)]
    return _normalise_single(value, found, where)


def _normalise_single(value: Any, found: FieldDescriptor, where: str) -> Any:
    if found.enum_type is not None:
        return _enum_value(value, found.enum_type, where)
    if found.message_type is not None:
        return _normalise(value, found.message_type, where)
    return value


def _parse_error_field(text: str) -> str:
    """The field json_format's ParseError names, as well as it can be read from its message."""
    at = re.search(r" at ([A-Za-z0-9_.\[\]]+?)\.?$", text)
    if at is not None and "." in at.group(1):
        return at.group(1).split(".", 1)[1]
    return ".".join(re.findall(r"Failed to parse (\S+) field", text))


def to_message(data: dict[str, Any], message_type: type[message.Message]) -> message.Message:
    """`data` (JSON) as a `message_type`; a problem raises BadRequest naming the field."""
    normalised = _normalise(data, cast(descriptor.Descriptor, message_type.DESCRIPTOR), "")
    request = message_type()
    try:
        json_format.ParseDict(normalised, request, max_recursion_depth=MAX_JSON_DEPTH + 8)
    except json_format.ParseError as error:
        text = str(error).split("\n", 1)[0]
        problem = text.rsplit(": ", 1)[-1] if ": " in text else text
        raise BadRequest(_parse_error_field(text), problem[:300]) from None
    except (ValueError, TypeError, RecursionError, OverflowError) as error:
        raise BadRequest("", f"cannot be read: {type(error).__name__}") from None
    return request


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    for part in parts[:-1]:
        child = data.get(part)
        if not isinstance(child, dict):
            child = {}
            data[part] = child
        data = child
    data[parts[-1]] = value


def _query_field(message_type: descriptor.Descriptor, dotted: str) -> FieldDescriptor | None:
    """The field a query parameter (`workerId`, `worker_id`, `dependency.kind`) names, if scalar."""
    found: FieldDescriptor | None = None
    current: descriptor.Descriptor | None = message_type
    for part in dotted.split("."):
        if current is None:
            return None
        found = _field_by_json(current, part)
        if found is None:
            return None
        current = found.message_type
    if found is None or (
        found.message_type is not None and found.message_type.full_name not in _SCALAR_WRAPPERS
    ):
        return None
    return found


_SCALAR_WRAPPERS = frozenset({"google.protobuf.Timestamp", "google.protobuf.Duration"})


def _query_value(raw: str, found: FieldDescriptor) -> Any:
    if found.type == FieldDescriptor.TYPE_BOOL:
        return {"true": True, "false": False, "1": True, "0": False}.get(raw.lower(), raw)
    return raw


@dataclass
class Gateway:
    """The HTTP side of one service process's servicers."""

    servicers: Mapping[str, Any]  # service full name -> servicer object
    services: Sequence[descriptor.ServiceDescriptor]
    max_body_bytes: int = 4 * 1024 * 1024
    # The client certificate's common name where the listener can tell it (none does yet: uvicorn
    # does not hand the peer certificate to the app), so a certificate can name the caller as on gRPC.
    peer_common_name: Callable[[Request], str | None] = field(default=lambda request: None)
    _routes: list[Binding] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self._routes = bindings(self.services)

    def install(self, app: Starlette) -> None:
        """Answer every request `app`'s own routes do not, so that a path no Starlette pattern matches
        (a newline in an id, say) still gets a JSON refusal, never a text page."""
        app.router.default = request_response(self.handle)

    async def handle(self, request: Request) -> Response:
        """The Starlette endpoint: route `request` to its RPC and answer it."""
        raw_path = request.scope.get("raw_path") or request.url.path.encode()
        path = raw_path.decode("latin-1").split("?", 1)[0]
        allowed = False
        for route in self._routes:
            params = route.path.match(path)
            if params is None:
                continue
            if route.http_method != request.method:
                allowed = True
                continue
            return await self._answer(route, params, request)
        if allowed:
            return _refusal(
                rpc_status.status_message(
                    Category.INVALID_ARGUMENT, "METHOD_NOT_ALLOWED", "method not allowed"
                ),
                http_status=405,
            )
        return _refusal(
            rpc_status.status_message(Category.NOT_FOUND, "NOT_FOUND", f"no operation at {path[:200]}")
        )

    async def _answer(self, route: Binding, params: dict[str, str], request: Request) -> Response:
        request_class = message_factory.GetMessageClass(route.method.input_type)
        try:
            data = await self._request_data(route, params, request)
            call = to_message(data, request_class)
        except BadRequest as problem:
            return _refusal(
                rpc_status.status_message(
                    Category.INVALID_ARGUMENT,
                    "INVALID_ARGUMENT",
                    f"malformed request: {problem}",
                    field=problem.field_name,
                    violations=[rpc_status.Violation(problem.field_name, problem.problem)],
                )
            )
        except _TooLarge:
            return _refusal(
                rpc_status.status_message(
                    Category.RESOURCE_EXHAUSTED,
                    "INVALID_ARGUMENT",
                    f"the body is larger than {self.max_body_bytes} bytes",
                ),
                http_status=413,
            )
        context = HttpCallContext(_metadata(request), _peer(request), self.peer_common_name(request))
        servicer = self.servicers[route.service]
        handler: Callable[[Any, Any], Awaitable[message.Message]] = getattr(servicer, route.method.name)
        try:
            answer = await handler(call, context)
        except HttpAbort as aborted:
            return _refusal(aborted.status)
        except Exception:
            # What gRPC answers UNKNOWN for a servicer that raised: logged, and a JSON refusal.
            log.exception("unexpected error in %s over HTTP", route.method.full_name)
            return _refusal(
                rpc_status.status_message(
                    Category.INTERNAL, "INTERNAL", "internal error; see the service log"
                )
            )
        if context.code is not None and context.code != grpc.StatusCode.OK:
            return _refusal(status_pb2.Status(code=context.code.value[0], message=context.details or ""))
        body = json_format.MessageToDict(answer)
        if route.response_body:
            body = body.get(_json_name(route.method.output_type, route.response_body), {})
        return JSONResponse(body)

    async def _request_data(self, route: Binding, params: dict[str, str], request: Request) -> dict[str, Any]:
        input_type = route.method.input_type
        data: dict[str, Any] = {}
        if route.body:
            raw = await _read_body(request, self.max_body_bytes)
            if raw.strip():
                try:
                    parsed = json.loads(raw)
                except (ValueError, RecursionError) as error:
                    raise BadRequest("", f"the body is not JSON: {str(error)[:200]}") from None
                if _depth(parsed) > MAX_JSON_DEPTH:
                    raise BadRequest("", f"the body nests deeper than {MAX_JSON_DEPTH} levels")
                if route.body == "*":
                    if not isinstance(parsed, dict):
                        raise BadRequest("", "the body must be a JSON object")
                    data = parsed
                else:
                    data[_json_name(input_type, route.body)] = parsed
        if route.body != "*":
            for name in set(request.query_params.keys()):
                found = _query_field(input_type, name)
                if found is None:
                    raise BadRequest(name, f"{input_type.name} has no such query parameter")
                values = request.query_params.getlist(name)
                value: Any = (
                    [_query_value(v, found) for v in values]
                    if found.is_repeated
                    else _query_value(values[-1], found)
                )
                _set_path(data, name, value)
        for name, value in params.items():
            # The path wins over the same field in the body, whichever spelling the body used.
            found = input_type.fields_by_name.get(name)
            if found is not None and found.json_name != name:
                data.pop(found.json_name, None)
            _set_path(data, name, value)
        token = request.headers.get(LEASE_TOKEN_HEADER)
        if token is not None and "lease_token" in input_type.fields_by_name:
            data.pop("leaseToken", None)
            data["lease_token"] = token
        return data


def _json_name(message_type: descriptor.Descriptor, name: str) -> str:
    found = message_type.fields_by_name.get(name)
    return found.json_name if found is not None else name


class _TooLarge(Exception):
    pass


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
    return b"".join(chunks)


def _metadata(request: Request) -> list[tuple[str, str]]:
    return [
        (key.decode("latin-1").lower(), value.decode("latin-1"))
        for key, value in request.scope.get("headers", ())
        if key.decode("latin-1").lower() not in _NOT_METADATA
    ]


def _peer(request: Request) -> str:
    client = request.client
    if client is None:
        return "unknown"
    return (
        f"ipv6:[{client.host}]:{client.port}" if ":" in client.host else f"ipv4:{client.host}:{client.port}"
    )


def status_json(status: status_pb2.Status) -> dict[str, Any]:
    return json_format.MessageToDict(status)


def _refusal(status: status_pb2.Status, http_status: int | None = None) -> Response:
    code = _BY_NUMBER.get(status.code, grpc.StatusCode.UNKNOWN)
    headers: dict[str, str] = {}
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            headers["Retry-After"] = str(max(1, math.ceil(retry.retry_delay.ToMilliseconds() / 1000)))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(status_json(status), status_code=http_status or HTTP_STATUS[code], headers=headers)
