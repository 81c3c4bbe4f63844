"""How every Abada client reaches a service: address, bearer token, TLS, deadline, reconnects.

One connection config for the SDK's clients and workers, the `abada` CLI, the agent worker (to the
engine and to the broker), the broker (to the engine) and the engine (to the broker at deploy):

    connection = Connection(
        "engine.abada:50051",
        token=BearerToken(token_file=Path("/var/run/abada/token")),   # re-read when the file changes
        tls=ClientTls(ca_file=Path("ca.pem"), cert_file=..., key_file=...),  # mTLS with a certificate
    )
    channel = connection.open_aio_channel()
    await stub.Call(request, timeout=connection.timeout, metadata=connection.metadata)

Certificates are read again each time a channel is opened and `tls.fingerprint()` changes when a
file does, so a rotated Secret is picked up without a restart. A setting that cannot be used raises
`ConnectionConfigError`, naming the file and why.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict, Unpack

import grpc

log = logging.getLogger("abada_sdk.connection")

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TIMEOUT_SECONDS = 30.0
# gRPC waits up to two minutes between reconnects by default; a lease lasts seconds. A service back
# from a restart must be found again well within one lease.
RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

_Fingerprint = tuple[int, int, int, int]
_MISSING: _Fingerprint = (-1, -1, -1, -1)


class ConnectionConfigError(ValueError):
    """A connection setting cannot be used (a file unreadable or empty, a certificate without its key)."""


def _fingerprint(path: Path) -> _Fingerprint:
    stat = os.stat(path)
    return (stat.st_ino, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_size)


class BearerToken:
    """A bearer token, given directly or in a file that is read again whenever it changes (a mounted
    Secret that rotates). A file briefly gone or unreadable keeps the token read before: a rotation
    is no outage. `what` names the token in messages ("the worker token")."""

    def __init__(
        self, token: str | None = None, token_file: Path | None = None, *, what: str = "the token"
    ) -> None:
        if token and token_file is not None:
            raise ConnectionConfigError(f"{what} is given both directly and in a file: set one")
        self._static = token.strip() if token else None
        self._file = token_file
        self._what = what
        self._lock = threading.Lock()
        self._seen: _Fingerprint | None = None
        self._from_file: str | None = None
        if token_file is not None:
            self._read(strict=True)
            if self._from_file is None:
                raise ConnectionConfigError(f"the file {str(token_file)!r} holding {what} is empty")

    @property
    def configured(self) -> bool:
        return self._static is not None or self._file is not None

    def current(self) -> str | None:
        return self._static if self._file is None else self._read(strict=False)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata: `authorization: Bearer <token>`, or nothing when no token is set."""
        token = self.current()
        return (("authorization", f"Bearer {token}"),) if token else ()

    def _read(self, *, strict: bool) -> str | None:
        assert self._file is not None
        with self._lock:
            try:
                seen = _fingerprint(self._file)
                if seen != self._seen:
                    self._from_file = self._file.read_text(encoding="utf-8").strip() or None
                    self._seen = seen
            except OSError as error:
                if strict:
                    raise ConnectionConfigError(
                        f"cannot read {self._what} from {str(self._file)!r}: {error.strerror}"
                    ) from None
                if self._seen != _MISSING:
                    log.warning(
                        "cannot read %s from %s (%s); using the one read before",
                        self._what,
                        self._file,
                        error.strerror,
                    )
                    self._seen = _MISSING
            return self._from_file


@dataclass(frozen=True)
class ClientTls:
    """TLS towards a service: the CA its certificate chains to (the system's when unset) and, for
    mutual TLS, a client certificate and its key. Off when none is set."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ConnectionConfigError("a client certificate and its key go together: set both or neither")

    @property
    def enabled(self) -> bool:
        return any(path is not None for path in (self.ca_file, self.cert_file, self.key_file))

    def files(self) -> tuple[Path, ...]:
        return tuple(path for path in (self.ca_file, self.cert_file, self.key_file) if path is not None)

    def fingerprint(self) -> tuple[_Fingerprint, ...]:
        """Changes when one of the files does: time to open a new channel."""
        prints = []
        for path in self.files():
            try:
                prints.append(_fingerprint(path))
            except OSError:
                prints.append(_MISSING)
        return tuple(prints)

    def credentials(self) -> grpc.ChannelCredentials:
        """Read now, so a rotated certificate is used from the next channel on."""

        def read(path: Path | None, what: str) -> bytes | None:
            if path is None:
                return None
            try:
                return path.read_bytes()
            except OSError as error:
                raise ConnectionConfigError(
                    f"cannot read the {what} {str(path)!r}: {error.strerror}"
                ) from None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_file, "CA file"),
            private_key=read(self.key_file, "client key"),
            certificate_chain=read(self.cert_file, "client certificate"),
        )


class ConnectionOptions(TypedDict, total=False):
    """What a client takes to reach the engine, each read from the environment when not given."""

    token: str | None
    token_file: str | os.PathLike[str] | None
    tls_ca: str | os.PathLike[str] | None
    tls_cert: str | os.PathLike[str] | None
    tls_key: str | os.PathLike[str] | None
    # Seconds a call may take unless it says otherwise.
    timeout: float


@dataclass(frozen=True)
class Connection:
    address: str = DEFAULT_ADDRESS
    token: BearerToken = field(default_factory=BearerToken)
    tls: ClientTls = field(default_factory=ClientTls)
    # The deadline of one call unless the call says otherwise.
    timeout: float = DEFAULT_TIMEOUT_SECONDS
    options: tuple[tuple[str, int], ...] = RECONNECT_OPTIONS

    @classmethod
    def resolve(cls, address: str | None = None, **options: Unpack[ConnectionOptions]) -> Connection:
        """Arguments first, then ABADA_ENGINE_ADDRESS, ABADA_TOKEN / ABADA_TOKEN_FILE and ABADA_TLS_*."""
        env = os.environ
        token = options.get("token")
        token_file = options.get("token_file")
        if token is None and token_file is None:
            token = env.get("ABADA_TOKEN") or None
            token_file = env.get("ABADA_TOKEN_FILE") or None

        def path(value: str | os.PathLike[str] | None, variable: str) -> Path | None:
            chosen = value if value is not None else env.get(variable)
            return Path(chosen) if chosen else None

        return cls(
            address=address or env.get("ABADA_ENGINE_ADDRESS") or DEFAULT_ADDRESS,
            token=BearerToken(token, None if token else path(token_file, "ABADA_TOKEN_FILE")),
            tls=ClientTls(
                ca_file=path(options.get("tls_ca"), "ABADA_TLS_CA_FILE"),
                cert_file=path(options.get("tls_cert"), "ABADA_TLS_CERT_FILE"),
                key_file=path(options.get("tls_key"), "ABADA_TLS_KEY_FILE"),
            ),
            timeout=options.get("timeout", DEFAULT_TIMEOUT_SECONDS),
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self.token.metadata()

    def open_aio_channel(self) -> grpc.aio.Channel:
        if not self.tls.enabled:
            return grpc.aio.insecure_channel(self.address, options=self.options)
        return grpc.aio.secure_channel(self.address, self.tls.credentials(), options=self.options)

    def open_channel(self) -> grpc.Channel:
        if not self.tls.enabled:
            return grpc.insecure_channel(self.address, options=self.options)
        return grpc.secure_channel(self.address, self.tls.credentials(), options=self.options)


def read_token_file(path: Path) -> str:
    """The token in `path`, now; raises ConnectionConfigError when it cannot be read or is empty."""
    token = BearerToken(token_file=path).current()
    assert token is not None  # an empty file is refused above
    return token
