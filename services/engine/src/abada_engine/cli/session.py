"""The CLI's way to the engine: the SDK's EngineClient over one Connection, opened on first use, and
its refusals said in the CLI's terms (which flag to fix), never as a traceback."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
from abada_sdk import AbadaError, EngineClient
from abada_sdk.client import Stubs
from abada_sdk.connection import BearerToken, ClientTls, Connection, ConnectionConfigError

from .errors import CliError, from_status, invalid_input

Reply = TypeVar("Reply")
Result = TypeVar("Result")


@dataclass(frozen=True)
class ConnectionSettings:
    address: str
    timeout: float
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Where the token came from, as the user would fix it: `--token / ABADA_TOKEN` or the file's path.
    token_source: str = ""

    def connection(self) -> Connection:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise invalid_input("mTLS needs both --tls-cert and --tls-key")
        return Connection(
            self.address,
            token=BearerToken(self.token),
            tls=ClientTls(self.tls_ca, self.tls_cert, self.tls_key),
            timeout=self.timeout,
        )


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise invalid_input(f"cannot read the token file {path}: {error.strerror}") from None
    if not token:
        raise invalid_input(f"the token file {path} is empty")
    return token


class LazyEngine:
    """Opens the client on first use, so `--help` and input mistakes never touch the network."""

    def __init__(self, settings: ConnectionSettings) -> None:
        self.settings = settings
        self._client: EngineClient | None = None

    def call(
        self, method: Callable[[Stubs], grpc.aio.UnaryUnaryMultiCallable[Any, Reply]], request: Any
    ) -> Reply:
        """One RPC, answered with the engine's reply message (what `--output json` prints)."""
        return self.run(lambda client: client.call(method, request))

    def run(self, work: Callable[[EngineClient], Result]) -> Result:
        """`work` with the SDK client; a refusal or an unusable setting becomes a CliError."""
        try:
            if self._client is None:
                self._client = EngineClient(connection=self.settings.connection())
            return work(self._client)
        except AbadaError as error:
            raise self._explain(error) from None
        except ConnectionConfigError as error:
            raise invalid_input(str(error)) from None

    def _explain(self, error: AbadaError) -> CliError:
        if error.status is None:
            return CliError(str(error))
        settings = self.settings
        return from_status(
            error.status,
            settings.address,
            settings.timeout,
            has_token=bool(settings.token),
            token_source=settings.token_source,
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
