"""gRPC server reflection under both names clients ask for: `grpc.reflection.v1` and `v1alpha`.

grpcio-reflection implements only v1alpha. The v1 service is the same protocol under a new package
name: its messages have the same fields and numbers, so the same bytes answer both, and one
servicer serves the two method paths.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_reflection.v1alpha import _async as reflection_async
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection for `service_names` (plus both reflection services themselves) on `server`."""
    names = (*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    servicer = reflection_async.ReflectionServicer(names)
    v1 = grpc.method_handlers_generic_handler(
        V1_SERVICE_NAME,
        {
            "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                servicer.ServerReflectionInfo,
                request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
            )
        },
    )
    server.add_generic_rpc_handlers((v1,))
