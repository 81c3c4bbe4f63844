"""CredentialService over gRPC: requests in, the issuer's answers out, refusals as rich statuses.

A refusal is the gRPC code plus a ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer
holding an ``ErrorInfo`` (domain ``abada.dev``, the reason, ``field`` for bad input).
"""

from __future__ import annotations

import logging

import grpc
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada_common import rpc_status
from google.protobuf import timestamp_pb2

from .auth import bearer_token
from .errors import BrokerError
from .issuer import CallContext, CredentialIssuer, ToolCredentialRequest

log = logging.getLogger(__name__)

SERVICE_NAME = credential_pb2.DESCRIPTOR.services_by_name["CredentialService"].full_name


def _call_context(context: grpc.aio.ServicerContext) -> CallContext:
    authorization = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            authorization = value
    return CallContext(token=bearer_token(authorization), peer=context.peer())


async def _abort(context: grpc.aio.ServicerContext, error: BrokerError) -> None:
    await rpc_status.abort(
        context,
        rpc_status.status_message(
            error.outcome, error.reason_name, error.message, field=error.field or "", metadata=error.metadata
        ),
    )


class CredentialServicer(credential_pb2_grpc.CredentialServiceServicer):
    def __init__(self, issuer: CredentialIssuer) -> None:
        self._issuer = issuer

    async def GetToolCredential(
        self, request: credential_pb2.GetToolCredentialRequest, context: grpc.aio.ServicerContext
    ) -> credential_pb2.GetToolCredentialResponse:
        asked = ToolCredentialRequest(
            task_id=request.task_id,
            worker_id=request.worker_id,
            lease_token=request.lease_token,
            server=request.server,
        )
        try:
            issued = await self._issuer.tool_credential(_call_context(context), asked)
        except BrokerError as error:
            await _abort(context, error)
            raise AssertionError("unreachable: abort raises") from None
        expire_time = timestamp_pb2.Timestamp()
        expire_time.FromDatetime(issued.expire_time)
        return credential_pb2.GetToolCredentialResponse(
            secret=issued.secret.value,
            version=issued.secret.version,
            expire_time=expire_time,
            credential=issued.credential,
        )

    async def GetDeployCredential(
        self, request: credential_pb2.GetDeployCredentialRequest, context: grpc.aio.ServicerContext
    ) -> credential_pb2.GetDeployCredentialResponse:
        try:
            secret = await self._issuer.deploy_credential(
                _call_context(context), request.credential, request.server, request.url, request.on_behalf_of
            )
        except BrokerError as error:
            await _abort(context, error)
            raise AssertionError("unreachable: abort raises") from None
        return credential_pb2.GetDeployCredentialResponse(secret=secret.value, version=secret.version)
