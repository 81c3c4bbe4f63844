"""Where the engine is and how to prove who we are: address, bearer token, TLS; read from arguments or env."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass(frozen=True)
class Connection:
    address: str = DEFAULT_ADDRESS
    token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    @classmethod
    def resolve(
        cls,
        address: str | None = None,
        *,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        tls_ca: str | os.PathLike[str] | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
    ) -> Connection:
        """Arguments first, then ABADA_ENGINE_ADDRESS, ABADA_TOKEN / ABADA_TOKEN_FILE and ABADA_TLS_*."""
        env = os.environ
        if token is None and token_file is None:
            token = env.get("ABADA_TOKEN") or None
            token_file = env.get("ABADA_TOKEN_FILE") or None
        if token is None and token_file is not None:
            token = read_token_file(Path(token_file))

        def path(value: str | os.PathLike[str] | None, variable: str) -> Path | None:
            chosen = value if value is not None else env.get(variable)
            return Path(chosen) if chosen else None

        return cls(
            address=address or env.get("ABADA_ENGINE_ADDRESS") or DEFAULT_ADDRESS,
            token=token.strip() if token else None,
            tls_ca=path(tls_ca, "ABADA_TLS_CA_FILE"),
            tls_cert=path(tls_cert, "ABADA_TLS_CERT_FILE"),
            tls_key=path(tls_key, "ABADA_TLS_KEY_FILE"),
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def open_aio_channel(self) -> grpc.aio.Channel:
        if not any((self.tls_ca, self.tls_cert, self.tls_key)):
            return grpc.aio.insecure_channel(self.address)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("mTLS needs both a client certificate and its key")
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.tls_ca.read_bytes() if self.tls_ca else None,
            private_key=self.tls_key.read_bytes() if self.tls_key else None,
            certificate_chain=self.tls_cert.read_bytes() if self.tls_cert else None,
        )
        return grpc.aio.secure_channel(self.address, credentials)


def read_token_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ValueError(f"cannot read the token file {path}: {error.strerror}") from None
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token
