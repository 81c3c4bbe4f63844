"""Tool-server credentials from the broker, asked for with the live lease and held only in memory.

The broker or its secret store out of reach (UNAVAILABLE, a deadline, SECRET_STORE_UNAVAILABLE) is
an outage to wait out (`DependencyDown`); any other refusal ends the attempt with an incident.
"""

from __future__ import annotations

import logging

import grpc
from abada.broker.v1 import credential_pb2, credential_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_sdk.connection import BearerToken, ClientTls, Connection

from .dependencies import BROKER, SECRET_STORE, DependencyDown
from .engine_client import LeaseRef
from .errors import AttemptFailed, LeaseLost
from .logs import redactor
from .rpc_errors import failure_of
from .settings import WorkerSettings

log = logging.getLogger(__name__)

# The broker's word for its secret store (Vault) being sealed or out of reach.
SECRET_STORE_UNAVAILABLE = ErrorReason.Name(ErrorReason.SECRET_STORE_UNAVAILABLE)


class Secret:
    """A credential that prints as `Secret(***)`, so a stray log line or repr cannot show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)"

    __str__ = __repr__


def broker_channel_for(settings: WorkerSettings) -> grpc.aio.Channel:
    """The channel to the broker: TLS when a CA or a client certificate is set (mTLS with the
    certificate), else plaintext."""
    tls = ClientTls(settings.broker_tls_ca_file, settings.broker_tls_cert_file, settings.broker_tls_key_file)
    return Connection(settings.broker_address, tls=tls).open_aio_channel()


class BrokerClient:
    def __init__(
        self,
        channel: grpc.aio.Channel,
        worker_id: str,
        caller_token: BearerToken,
        timeout_seconds: float = 10.0,
    ) -> None:
        self._stub = credential_pb2_grpc.CredentialServiceStub(channel)
        self._worker_id = worker_id
        self._token = caller_token
        self._timeout = timeout_seconds

    async def tool_credential(self, lease: LeaseRef, server: str) -> Secret:
        """The server's secret for this lease; registered with the log redactor until `forget`."""
        request = credential_pb2.GetToolCredentialRequest(
            task_id=lease.task_id, worker_id=self._worker_id, lease_token=lease.lease_token, server=server
        )
        try:
            reply = await self._stub.GetToolCredential(
                request, timeout=self._timeout, metadata=self._token.metadata()
            )
        except grpc.aio.AioRpcError as error:
            failure = failure_of(error)
            if failure.lease_lost:
                raise LeaseLost(failure.reason or failure.code.name, failure.message) from None
            said = f"{failure.reason or failure.code.name}: {failure.message}"
            if failure.transient:
                # The secret store sealed or away, or the broker itself (or its way to the engine).
                down = SECRET_STORE if failure.reason == SECRET_STORE_UNAVAILABLE else BROKER
                raise DependencyDown(
                    down,
                    f"the broker gave no credential for tool server {server!r}: {said}",
                    retry_after_seconds=failure.retry_after_seconds or 0.0,
                ) from None
            raise AttemptFailed(
                "CREDENTIAL_REFUSED",
                f"the broker refused the credential for tool server {server!r}: {said}",
                no_retry=True,
                details={"server": server, "reason": failure.reason},
            ) from None
        redactor.hold(reply.secret)
        return Secret(reply.secret)

    @staticmethod
    def forget(secret: Secret) -> None:
        redactor.release(secret.reveal())
