"""The console's way to the engine: its public gRPC API over one loopback channel, each call made with
the signed-in person's own token, so the engine's roles decide what they may see and do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from abada.engine.v1 import (
    approval_pb2,
    approval_pb2_grpc,
    definition_pb2_grpc,
    dependency_pb2_grpc,
    external_task_pb2_grpc,
    incident_pb2_grpc,
    process_pb2,
    process_pb2_grpc,
    queue_pb2_grpc,
)
from abada_sdk.connection import Connection
from abada_sdk.errors import AbadaError, PermissionDenied, error_from_rpc

Reply = TypeVar("Reply")
TIMEOUT_SECONDS = 10.0


class Engine:
    """Stubs on one channel (opened on first use: aio channels belong to the loop that made them)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = self.connection.open_aio_channel()
            channel = self._channel
            self.processes = process_pb2_grpc.ProcessServiceStub(channel)
            self.approvals = approval_pb2_grpc.ApprovalServiceStub(channel)
            self.incidents = incident_pb2_grpc.IncidentServiceStub(channel)
            self.tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
            self.definitions = definition_pb2_grpc.DefinitionServiceStub(channel)
            self.queues = queue_pb2_grpc.QueueServiceStub(channel)
            self.dependencies = dependency_pb2_grpc.DependencyServiceStub(channel)
        return self._channel

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def call(
        self,
        token: str,
        method: Callable[[Engine], grpc.aio.UnaryUnaryMultiCallable[Any, Reply]],
        request: Any,
    ) -> Reply:
        """One RPC as the person whose token this is; a refusal becomes the SDK's AbadaError."""
        self._open()
        try:
            return await method(self)(
                request, timeout=TIMEOUT_SECONDS, metadata=(("authorization", f"Bearer {token}"),)
            )
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None

    async def roles_of(self, token: str) -> frozenset[str]:
        """What the console may offer this token, asked of the engine (it has no who-am-I call): the
        approvals inbox answers approvers and operators, the instances list operators only. Raises
        the engine's refusal (Unauthenticated for an unknown token)."""
        await self.call(
            token, lambda e: e.approvals.ListApprovals, approval_pb2.ListApprovalsRequest(page_size=1)
        )
        try:
            await self.call(
                token, lambda e: e.processes.ListInstances, process_pb2.ListInstancesRequest(page_size=1)
            )
        except PermissionDenied:
            return frozenset({"approver"})
        return frozenset({"operator", "approver"})


__all__ = ["AbadaError", "Engine"]
