"""The OpenAPI 3.1 document of a service's HTTP side, made from its descriptors' HTTP rules.

The same bindings the gateway serves (`http_gateway.bindings`), the messages as JSON Schemas in the
proto3 JSON mapping (camelCase names, 64-bit integers as strings, enums by name, the short enum names
the gateway also takes), the bearer-token security scheme, and every refusal as a `google.rpc.Status`.
`scripts/gen_openapi.py` writes it to api/openapi/ at build time; the services serve it at
/v1/openapi.json.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf import descriptor, descriptor_pb2
from google.protobuf.descriptor import FieldDescriptor

from .http_gateway import LEASE_TOKEN_HEADER, Binding, bindings

# The refusals every operation may answer: the HTTP statuses of the gRPC codes Abada's services use.
ERROR_RESPONSES = {
    "400": "INVALID_ARGUMENT or FAILED_PRECONDITION: a malformed request, naming the field",
    "401": "UNAUTHENTICATED: no bearer token, or one the service does not know",
    "403": "PERMISSION_DENIED: the caller lacks the role, or acts for another worker",
    "404": "NOT_FOUND",
    "409": "ALREADY_EXISTS or ABORTED",
    "413": "the body is larger than the service takes",
    "429": "RESOURCE_EXHAUSTED: a quota or limit; Retry-After says when to try again",
    "500": "INTERNAL",
    "503": "UNAVAILABLE: a dependency (the database, the secret store) is out of reach; try again",
}
_SCALARS: dict[int, dict[str, Any]] = {
    FieldDescriptor.TYPE_STRING: {"type": "string"},
    FieldDescriptor.TYPE_BOOL: {"type": "boolean"},
    FieldDescriptor.TYPE_BYTES: {"type": "string", "format": "byte"},
    FieldDescriptor.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SINT32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_SFIXED32: {"type": "integer", "format": "int32"},
    FieldDescriptor.TYPE_UINT32: {"type": "integer", "format": "int64", "minimum": 0},
    FieldDescriptor.TYPE_FIXED32: {"type": "integer", "format": "int64", "minimum": 0},
    # proto3 JSON writes 64-bit integers as strings (a JSON number loses precision past 2^53).
    FieldDescriptor.TYPE_INT64: {"type": "string", "format": "int64", "pattern": "^-?[0-9]{1,18}$"},
    FieldDescriptor.TYPE_SINT64: {"type": "string", "format": "int64", "pattern": "^-?[0-9]{1,18}$"},
    FieldDescriptor.TYPE_SFIXED64: {"type": "string", "format": "int64", "pattern": "^-?[0-9]{1,18}$"},
    FieldDescriptor.TYPE_UINT64: {"type": "string", "format": "uint64", "pattern": "^[0-9]{1,19}$"},
    FieldDescriptor.TYPE_FIXED64: {"type": "string", "format": "uint64", "pattern": "^[0-9]{1,19}$"},
    FieldDescriptor.TYPE_DOUBLE: {"type": "number", "format": "double"},
    FieldDescriptor.TYPE_FLOAT: {"type": "number", "format": "float"},
}
_WELL_KNOWN: dict[str, dict[str, Any]] = {
    "google.protobuf.Struct": {"type": "object", "additionalProperties": True},
    "google.protobuf.Value": {},
    "google.protobuf.ListValue": {"type": "array", "items": {}},
    "google.protobuf.Timestamp": {"type": "string", "format": "date-time"},
    "google.protobuf.Duration": {"type": "string", "pattern": "^-?[0-9]+(\\.[0-9]+)?s$"},
    "google.protobuf.Empty": {"type": "object"},
}
STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "google.rpc.Status: the gRPC code, a message and details such as google.rpc.ErrorInfo "
    "(reason, domain abada.dev, metadata.field), google.rpc.BadRequest and google.rpc.RetryInfo.",
    "properties": {
        "code": {"type": "integer", "format": "int32"},
        "message": {"type": "string"},
        "details": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"@type": {"type": "string"}},
                "additionalProperties": True,
            },
        },
    },
}


# Written beside the generated stubs by their builder (api/python/stub_builder.py), with the comments.
DESCRIPTOR_SET = "descriptors.binpb"


@functools.cache
def comments() -> dict[str, str]:
    """The protos' leading comments by full name (`abada.engine.v1.ExternalTaskService.AppendStep`,
    `abada.engine.v1.AppendStepRequest.lease_token`); empty where the stubs were built without them."""
    try:
        raw = (importlib.resources.files("abada") / DESCRIPTOR_SET).read_bytes()
    except (OSError, ModuleNotFoundError):
        return {}
    found: dict[str, str] = {}
    for file in descriptor_pb2.FileDescriptorSet.FromString(raw).file:
        _FileComments(file, found).collect()
    return found


class _FileComments:
    """One file's comments into `found`, by the paths SourceCodeInfo gives each declaration."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto, found: dict[str, str]) -> None:
        self._file = file
        self._found = found
        self._text = {
            tuple(location.path): location.leading_comments
            for location in file.source_code_info.location
            if location.leading_comments.strip()
        }

    def collect(self) -> None:
        package = self._file.package
        for index, service in enumerate(self._file.service):
            self._note([6, index], f"{package}.{service.name}")
            for number, method in enumerate(service.method):
                self._note([6, index, 2, number], f"{package}.{service.name}.{method.name}")
        for index, proto in enumerate(self._file.message_type):
            self._message(proto, [4, index], f"{package}.{proto.name}")
        for index, enum in enumerate(self._file.enum_type):
            self._note([5, index], f"{package}.{enum.name}")

    def _note(self, path: Sequence[int], name: str) -> None:
        comment = self._text.get(tuple(path))
        if comment:
            self._found[name] = "\n".join(line.strip() for line in comment.strip().splitlines())

    def _message(self, proto: descriptor_pb2.DescriptorProto, path: list[int], name: str) -> None:
        self._note(path, name)
        for index, field in enumerate(proto.field):
            self._note([*path, 2, index], f"{name}.{field.name}")
        for index, nested in enumerate(proto.nested_type):
            self._message(nested, [*path, 3, index], f"{name}.{nested.name}")
        for index, enum in enumerate(proto.enum_type):
            self._note([*path, 4, index], f"{name}.{enum.name}")


def _described(schema: dict[str, Any], name: str) -> dict[str, Any]:
    comment = comments().get(name)
    return {**schema, "description": comment} if comment else schema


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


class _Schemas:
    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {"google.rpc.Status": STATUS_SCHEMA}

    def enum(self, enum: descriptor.EnumDescriptor) -> dict[str, Any]:
        if enum.full_name not in self.schemas:
            names = [value.name for value in enum.values]
            first = names[0] if names else ""
            prefix = first[: -len("UNSPECIFIED")] if first.endswith("_UNSPECIFIED") else ""
            short = [name[len(prefix) :] for name in names[1:] if prefix and name.startswith(prefix)]
            own = comments().get(enum.full_name, "")
            self.schemas[enum.full_name] = {
                "type": "string",
                "enum": names + short,
                "description": (own + "\n" if own else "") + "By name; requests may leave out the prefix "
                f"({prefix or 'none'}) as in the short names listed.",
            }
        return _ref(enum.full_name)

    def message(self, message_type: descriptor.Descriptor, leave_out: Iterable[str] = ()) -> dict[str, Any]:
        if message_type.full_name in _WELL_KNOWN:
            return dict(_WELL_KNOWN[message_type.full_name])
        left_out = set(leave_out)
        if not left_out:
            if message_type.full_name in self.schemas:
                return _ref(message_type.full_name)
            self.schemas[message_type.full_name] = {}  # placeholder: a message may contain itself
        properties = {
            field.json_name: _described(self.field(field), field.full_name)
            for field in message_type.fields
            if field.name not in left_out
        }
        schema: dict[str, Any] = _described(
            {"type": "object", "properties": properties, "additionalProperties": False},
            message_type.full_name,
        )
        if left_out:
            return schema
        self.schemas[message_type.full_name] = schema
        return _ref(message_type.full_name)

    def field(self, field: FieldDescriptor) -> dict[str, Any]:
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            return {
                "type": "object",
                "additionalProperties": self.single(field.message_type.fields_by_name["value"]),
            }
        if field.is_repeated:
            return {"type": "array", "items": self.single(field)}
        return self.single(field)

    def single(self, field: FieldDescriptor) -> dict[str, Any]:
        if field.enum_type is not None:
            return self.enum(field.enum_type)
        if field.message_type is not None:
            return self.message(field.message_type)
        return dict(_SCALARS[field.type])


def _query_parameters(
    schemas: _Schemas, message_type: descriptor.Descriptor, skip: set[str], prefix: str = "", depth: int = 0
) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for field in message_type.fields:
        name = prefix + field.json_name
        if prefix + field.name in skip:
            continue
        if field.message_type is not None and field.message_type.full_name not in (
            "google.protobuf.Timestamp",
            "google.protobuf.Duration",
        ):
            if not field.is_repeated and depth < 2:
                found += _query_parameters(schemas, field.message_type, skip, name + ".", depth + 1)
            continue
        found.append({"name": name, "in": "query", "required": False, "schema": schemas.field(field)})
    return found


def _operation(schemas: _Schemas, binding: Binding) -> dict[str, Any]:
    method = binding.method
    input_type = method.input_type
    path_fields = set(binding.path.fields)
    parameters: list[dict[str, Any]] = []
    for name in binding.path.fields:
        parameters.append(
            {"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": "^[^/]+$"}}
        )
    if binding.body != "*":
        parameters += _query_parameters(schemas, input_type, path_fields | {binding.body})
    if "lease_token" in input_type.fields_by_name:
        parameters.append(
            {
                "name": LEASE_TOKEN_HEADER.title(),
                "in": "header",
                "required": False,
                "description": "the lease token, instead of leaseToken in the body or query",
                "schema": {"type": "string"},
            }
        )
    operation: dict[str, Any] = {
        "operationId": binding.operation_id,
        "tags": [method.containing_service.name],
        "summary": f"{method.containing_service.full_name}.{method.name}",
        **({"description": comments()[method.full_name]} if method.full_name in comments() else {}),
        "parameters": parameters,
        "responses": {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": schemas.message(method.output_type)}},
            },
            **{
                status: {
                    "description": description,
                    "content": {"application/json": {"schema": _ref("google.rpc.Status")}},
                }
                for status, description in ERROR_RESPONSES.items()
            },
        },
    }
    if binding.body:
        if binding.body == "*":
            body_schema = (
                schemas.message(input_type, leave_out=path_fields)
                if path_fields
                else schemas.message(input_type)
            )
        else:
            body_schema = schemas.field(input_type.fields_by_name[binding.body])
        operation["requestBody"] = {
            "required": False,
            "content": {"application/json": {"schema": body_schema}},
        }
    return operation


def document(
    services: Iterable[descriptor.ServiceDescriptor], title: str, version: str = "v1"
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `services`' HTTP rules."""
    schemas = _Schemas()
    paths: dict[str, dict[str, Any]] = {}
    for binding in bindings(services):
        paths.setdefault(binding.path.openapi_path, {})[binding.http_method.lower()] = _operation(
            schemas, binding
        )
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "Every RPC of the gRPC API as HTTP/JSON (the proto3 JSON mapping), generated "
            "from the protos' google.api.http rules.",
        },
        "security": [{"bearerAuth": []}],
        "paths": dict(sorted(paths.items())),
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": dict(sorted(schemas.schemas.items())),
        },
    }
