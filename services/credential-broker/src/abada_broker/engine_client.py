"""The broker's one question to the engine: does this worker hold this task's live lease, for this server?

The broker calls as itself: a service token (``authorization: Bearer``, from ABADA_ENGINE_TOKEN or the
file ABADA_ENGINE_TOKEN_FILE, re-read when the file changes) and/or a TLS client certificate
(ABADA_ENGINE_TLS_CA_FILE, ABADA_ENGINE_TLS_CERT_FILE, ABADA_ENGINE_TLS_KEY_FILE; the channel is rebuilt
when one of them changes, so a renewed certificate is picked up without a restart).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import dataclass

import grpc
from abada.engine.v1 import lease_pb2, lease_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_sdk.connection import Connection, ConnectionConfigError
from abada_sdk.status import read_status

from .errors import BrokerError, invalid_argument, permission_denied, unavailable

log = logging.getLogger(__name__)

# What the worker is told for each refusal; our own words, so nothing of the engine's message leaks.
# The engine's VerifyLease refusals, passed on to the worker under the same reason.
_LEASE_REFUSALS: dict[str, tuple[ErrorReason, str]] = {
    ErrorReason.Name(reason): (reason, message)
    for reason, message in (
        (ErrorReason.UNKNOWN_TASK, "no such external task"),
        (ErrorReason.NOT_LEASE_HOLDER, "this worker does not hold the task's lease"),
        (ErrorReason.LEASE_EXPIRED, "the lease on this task has expired"),
        (ErrorReason.SERVER_NOT_BOUND, "the task's node has no tool bound on this server"),
    )
}
# Closing a replaced channel at once would cut calls still running on it.
_OLD_CHANNEL_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class VerifiedLease:
    expires_at: dt.datetime
    credential: str
    attempt: int
    tools: tuple[str, ...]
    # Where the worker will send the credential: the server's URL frozen into the definition.
    url: str = ""


class EngineLeaseClient:
    """``VerifyLease`` on the engine, with the broker's own identity."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._address = connection.address
        self._tls_seen = connection.tls.fingerprint()
        self._channel = connection.open_aio_channel()
        self._stub = lease_pb2_grpc.LeaseServiceStub(self._channel)
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return self._address

    async def verify(self, task_id: str, worker_id: str, lease_token: str, server: str) -> VerifiedLease:
        """The live lease; raises PERMISSION_DENIED with the engine's reason, or UNAVAILABLE."""
        stub = self._current_stub()
        request = lease_pb2.VerifyLeaseRequest(
            task_id=task_id, worker_id=worker_id, lease_token=lease_token, server=server
        )
        try:
            reply = await stub.VerifyLease(
                request, timeout=self._connection.timeout, metadata=self._connection.metadata
            )
        except grpc.aio.AioRpcError as error:
            raise self._translate(error) from None
        return VerifiedLease(
            expires_at=reply.lease_expires_at.ToDatetime(tzinfo=dt.UTC),
            credential=reply.credential,
            attempt=reply.attempt,
            tools=tuple(binding.tool for binding in reply.bindings),
            url=reply.bindings[0].url if reply.bindings else "",
        )

    async def close(self) -> None:
        for task in list(self._retiring):
            task.cancel()
        await self._channel.close()

    def _current_stub(self) -> lease_pb2_grpc.LeaseServiceAsyncStub:
        tls = self._connection.tls
        if tls.enabled:
            seen = tls.fingerprint()
            if seen != self._tls_seen:
                try:
                    replacement = self._connection.open_aio_channel()
                except ConnectionConfigError as error:
                    log.error("cannot reload the engine TLS files; keeping the current channel: %s", error)
                else:
                    log.info("the engine TLS files changed; using a new channel")
                    self._retire(self._channel)
                    self._channel = replacement
                    self._stub = lease_pb2_grpc.LeaseServiceStub(replacement)
                self._tls_seen = seen
        return self._stub

    def _retire(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.get_running_loop().create_task(channel.close(grace=_OLD_CHANNEL_GRACE_SECONDS))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _translate(self, error: grpc.aio.AioRpcError) -> BrokerError:
        code = error.code()
        reason, field = _error_info(error)
        if code is grpc.StatusCode.PERMISSION_DENIED and reason in _LEASE_REFUSALS:
            passed_on, message = _LEASE_REFUSALS[reason]
            return permission_denied(passed_on, message)
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            # The broker checks its input first, so this is rare: pass on which field the engine disliked.
            return invalid_argument(field or "request", "was refused by the engine as invalid")
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            log.error(
                "the engine refused the broker's own identity: check ABADA_ENGINE_TOKEN(_FILE) / the TLS "
                "client certificate and the engine's callers",
                extra={"engine": self._address, "code": code.name, "engine_reason": reason},
            )
            return unavailable(
                ErrorReason.ENGINE_REFUSED_BROKER,
                "the broker cannot verify leases right now; try again later",
            )
        log.warning(
            "VerifyLease failed",
            extra={
                "engine": self._address,
                "code": code.name,
                "engine_reason": reason,
                "detail": error.details(),
            },
        )
        return unavailable(
            ErrorReason.ENGINE_UNAVAILABLE, "the engine cannot verify the lease right now; try again later"
        )


def _error_info(error: grpc.aio.AioRpcError) -> tuple[str, str | None]:
    status = read_status(error)  # a malformed detail must not turn a refusal into a crash
    return status.reason, status.metadata.get("field")
