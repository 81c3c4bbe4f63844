"""Server reflection as clients ask for it: `grpc.reflection.v1` (grpcurl, Postman) and `v1alpha`."""

from __future__ import annotations

import pathlib
import re

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Every service the engine's protos declare, so a new one cannot be missed.
DECLARED = sorted(
    name
    for proto in (ROOT / "proto" / "abada" / "engine" / "v1").glob("*.proto")
    for name in re.findall(r"^service (\w+) \{", proto.read_text(), re.MULTILINE)
)
ENGINE_SERVICES = {*(f"abada.engine.v1.{name}" for name in DECLARED), "grpc.health.v1.Health"}


def test_the_readme_names_every_service() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(DECLARED) >= 8
    assert [name for name in DECLARED if f"`{name}`" not in readme] == []
    assert "`grpc.reflection.v1`" in readme


async def _ask(channel: grpc.aio.Channel, package: str, request: reflection_pb2.ServerReflectionRequest):
    # v1 and v1alpha are one protocol under two package names: the same messages go to either path.
    call = channel.stream_stream(
        f"/{package}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )(iter([request]))
    async for response in call:
        return response
    raise AssertionError("no answer")


@pytest.mark.parametrize("package", ["grpc.reflection.v1", "grpc.reflection.v1alpha"])
async def test_reflection_lists_every_service_under_both_names(engine_channel, package):
    channel, _ = engine_channel
    response = await _ask(channel, package, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {service.name for service in response.list_services_response.service}
    assert ENGINE_SERVICES <= names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names


async def test_v1_reflection_describes_the_queue_service(engine_channel):
    channel, _ = engine_channel
    response = await _ask(
        channel,
        "grpc.reflection.v1",
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="abada.engine.v1.QueueService"),
    )
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    services = {service.name for file in files for service in file.service}
    assert "QueueService" in services
