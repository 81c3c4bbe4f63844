"""DependencyService: the circuits of what agent tasks depend on, for operators."""

from __future__ import annotations

import grpc
from abada.engine.v1 import dependency_pb2, dependency_pb2_grpc

from abada_engine.runtime.dependencies import Dependencies

from . import messages
from .guard import ServiceHandler


class DependencyHandler(ServiceHandler, dependency_pb2_grpc.DependencyServiceServicer):
    _dependencies: Dependencies

    async def ListDependencies(
        self, request: dependency_pb2.ListDependenciesRequest, context: grpc.aio.ServicerContext
    ) -> dependency_pb2.ListDependenciesResponse:
        return dependency_pb2.ListDependenciesResponse(
            dependencies=[messages.dependency_status(row) for row in await self._dependencies.listed()]
        )
