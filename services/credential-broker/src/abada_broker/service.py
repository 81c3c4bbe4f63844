"""CredentialService over gRPC: requests in, the issuer's answers out, refusals as rich statuses.

A refusal is the gRPC code plus a ``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer
holding an ``ErrorInfo`` (domain ``abada.dev``, the reason, ``field`` for bad input).
"""

from __future__ import annotations

import logging

import grpc
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from google.protobuf import any_pb2, timestamp_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from .auth import bearer_token
from .errors import BrokerError, Outcome
from .issuer import CallContext, CredentialIssuer, ToolCredentialRequest

log = logging.getLogger(__name__)

DOMAIN = "abada.dev"
SERVICE_NAME = credential_pb2.DESCRIPTOR.services_by_name["CredentialService"].full_name

_CODES: dict[Outcome, grpc.StatusCode] = {
    Outcome.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Outcome.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Outcome.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Outcome.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Outcome.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Outcome.INTERNAL: grpc.StatusCode.INTERNAL,
}


# The client refuses trailers over 8 KiB and would see RESOURCE_EXHAUSTED instead of the refusal: the
# message travels twice (percent-encoded, and inside the status), so what it repeats is capped.
MAX_MESSAGE_BYTES = 1_000
MAX_METADATA_VALUE_CHARS = 200


def _bounded(text: str, limit: int) -> str:
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: max(0, limit - 40)].decode(errors="ignore")
    return f"{kept}… ({len(raw) - len(kept.encode())} more bytes)"


def status_details(error: BrokerError) -> tuple[grpc.StatusCode, bytes]:
    code = _CODES[error.outcome]
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN)
    if error.field:
        info.metadata["field"] = _bounded(error.field, MAX_METADATA_VALUE_CHARS)
    for key, value in error.metadata.items():
        info.metadata[_bounded(key, 60)] = _bounded(value, MAX_METADATA_VALUE_CHARS)
    packed = any_pb2.Any()
    packed.Pack(info)
    message = _bounded(error.message, MAX_MESSAGE_BYTES)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message, details=[packed])
    return code, status.SerializeToString()


def _call_context(context: grpc.aio.ServicerContext) -> CallContext:
    authorization = None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str):
            authorization = value
    return CallContext(token=bearer_token(authorization), peer=context.peer())


async def _abort(context: grpc.aio.ServicerContext, error: BrokerError) -> None:
    code, details = status_details(error)
    message = _bounded(error.message, MAX_MESSAGE_BYTES)
    await context.abort(code, message, trailing_metadata=(("grpc-status-details-bin", details),))


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
