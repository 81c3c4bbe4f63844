"""The connection to the engine: channel, TLS, bearer token, deadline, and the generated stubs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from abada.engine.v1 import (
    approval_pb2_grpc,
    definition_pb2_grpc,
    dependency_pb2_grpc,
    external_task_pb2_grpc,
    incident_pb2_grpc,
    process_pb2_grpc,
    queue_pb2_grpc,
)

from .errors import from_rpc_error, invalid_input

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_SECONDS = 30.0

Response = TypeVar("Response")


@dataclass(frozen=True)
class ConnectionSettings:
    address: str = DEFAULT_ADDRESS
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Where the token came from, as the user would fix it: `--token / ABADA_TOKEN` or the file's path.
    token_source: str = ""

    @property
    def uses_tls(self) -> bool:
        return any(path is not None for path in (self.tls_ca, self.tls_cert, self.tls_key))


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise invalid_input(f"cannot read the token file {path}: {error.strerror}") from None
    if not token:
        raise invalid_input(f"the token file {path} is empty")
    return token


def _read_pem(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise invalid_input(f"cannot read the {what} {path}: {error.strerror}") from None


def open_channel(settings: ConnectionSettings) -> grpc.Channel:
    if not settings.uses_tls:
        return grpc.insecure_channel(settings.address)
    if (settings.tls_cert is None) != (settings.tls_key is None):
        raise invalid_input("mTLS needs both --tls-cert and --tls-key")
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read_pem(settings.tls_ca, "CA file") if settings.tls_ca else None,
        private_key=_read_pem(settings.tls_key, "client key") if settings.tls_key else None,
        certificate_chain=_read_pem(settings.tls_cert, "client certificate") if settings.tls_cert else None,
    )
    return grpc.secure_channel(settings.address, credentials)


class EngineClient:
    """Generated stubs over one channel; `call` adds the token and deadline and explains failures."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self._settings = settings
        self._channel = open_channel(settings)
        self.definitions = definition_pb2_grpc.DefinitionServiceStub(self._channel)
        self.processes = process_pb2_grpc.ProcessServiceStub(self._channel)
        self.tasks = external_task_pb2_grpc.ExternalTaskServiceStub(self._channel)
        self.incidents = incident_pb2_grpc.IncidentServiceStub(self._channel)
        self.queue = queue_pb2_grpc.QueueServiceStub(self._channel)
        self.approvals = approval_pb2_grpc.ApprovalServiceStub(self._channel)
        self.dependencies = dependency_pb2_grpc.DependencyServiceStub(self._channel)

    def call(self, method: Callable[..., Response], request: Any) -> Response:
        metadata = (("authorization", f"Bearer {self._settings.token}"),) if self._settings.token else None
        try:
            return method(request, timeout=self._settings.timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(
                error,
                self._settings.address,
                self._settings.timeout,
                has_token=bool(self._settings.token),
                token_source=self._settings.token_source,
            ) from None

    def close(self) -> None:
        self._channel.close()


class LazyEngine:
    """Opens the channel on first use, so `--help` and input mistakes never touch the network."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self._client: EngineClient | None = None

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            self._client = EngineClient(self.settings)
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
