"""LeaseService: the credential broker's check that a caller holds a live lease."""

from __future__ import annotations

import grpc
from abada.engine.v1 import lease_pb2, lease_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.errors import invalid
from abada_engine.runtime.leases import Leases

from . import messages
from .convert import parse_uuid, timestamp
from .guard import ServiceHandler


class LeaseHandler(ServiceHandler, lease_pb2_grpc.LeaseServiceServicer):
    _leases: Leases

    async def VerifyLease(
        self, request: lease_pb2.VerifyLeaseRequest, context: grpc.aio.ServicerContext
    ) -> lease_pb2.VerifyLeaseResponse:
        if not request.server:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "server", "is required")
        held, bindings = await self._leases.verify_for_server(
            parse_uuid(request.task_id, "task_id"), request.worker_id, request.lease_token, request.server
        )
        return lease_pb2.VerifyLeaseResponse(
            lease_expires_at=timestamp(held.lease_expires_at),
            bindings=[messages.binding(b) for b in bindings],
            credential=bindings[0].credential,
            attempt=held.attempt,
        )
