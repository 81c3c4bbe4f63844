"""Where each credential may be sent: the tool-server origins allowed to receive it.

A credential is a bearer token for one tool server. Whoever asks for it (the engine at deploy, a worker
for its task) sends it to the URL the definition names, and a definition is written by an operator, so
without this rule any operator could have any credential sent to a server of their choosing. The broker
therefore gives a credential out only for a URL whose origin (scheme, host, port) is allowed for it:

- listed for that credential in the origins file (``ABADA_BROKER_CREDENTIAL_ORIGINS_FILE``, YAML
  ``credential-name: [https://host[:port][/path], ...]``), read again whenever it changes; or
- without a file, a loopback origin only (one machine: the demo and development).

An entry with a path binds the credential to that path and below it, segment by segment
(``https://gateway/crm`` allows ``/crm`` and ``/crm/mcp``, not ``/crm-other`` nor ``/billing``): two
tool servers behind one gateway do not share credentials. A URL whose path could mean another path
once a server or proxy normalises it (``.`` or ``..`` segments, an encoded ``/``, ``\\`` or ``.``) is
refused wherever a path binding applies.

Plain ``http`` is refused unless the host is loopback: the secret would cross the network in clear.
"""

from __future__ import annotations

import logging
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import yaml
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.addresses import is_loopback_host

from .errors import BrokerError, Outcome

log = logging.getLogger(__name__)

_DEFAULT_PORTS = {"http": 80, "https": 443}


class OriginsFileError(Exception):
    """The origins file cannot be used; the message says why (never a secret: the file holds none)."""


def origin_of(url: str) -> str:
    """`scheme://host:port` of an http(s) URL, lower-cased with the default port made explicit."""
    parts = urllib.parse.urlsplit(url.strip())
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        raise ValueError(f"{url!r} has a bad port") from None
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


@dataclass(frozen=True)
class Binding:
    """An origin, and the path under which a credential may go there (empty: anywhere on it)."""

    origin: str
    path_segments: tuple[str, ...] = ()

    def allows(self, origin: str, path_segments: tuple[str, ...]) -> bool:
        return origin == self.origin and path_segments[: len(self.path_segments)] == self.path_segments


# Characters that some server or proxy on the way may decode into a separator or a dot segment.
_AMBIGUOUS_ESCAPES = ("%2f", "%5c", "%2e")


def path_segments_of(url: str) -> tuple[str, ...]:
    """The URL's path as its segments (`/crm/mcp/` is ("crm", "mcp")), refusing a path that another
    reader could resolve differently (ValueError)."""
    path = urllib.parse.urlsplit(url.strip()).path
    lowered = path.lower()
    if "\\" in path or any(escape in lowered for escape in _AMBIGUOUS_ESCAPES):
        raise ValueError(f"{url!r} has an encoded separator, backslash or dot in its path")
    segments = tuple(segment for segment in path.split("/") if segment)
    if any(segment in (".", "..") for segment in segments):
        raise ValueError(f"{url!r} has a '.' or '..' segment in its path")
    return segments


def binding_of(url: str) -> Binding:
    return Binding(origin_of(url), path_segments_of(url))


def is_loopback(origin: str) -> bool:
    return is_loopback_host(urllib.parse.urlsplit(origin).hostname or "")


def _refused(message: str, credential: str) -> BrokerError:
    return BrokerError(
        Outcome.PERMISSION_DENIED,
        ErrorReason.CREDENTIAL_ORIGIN_NOT_ALLOWED,
        message,
        field="url",
        metadata={"credential": credential},
    )


@dataclass(frozen=True)
class _Loaded:
    mtime_ns: int
    allowed: dict[str, frozenset[Binding]]


class CredentialOrigins:
    """Decides whether a credential may go to a URL; ``path`` None means loopback only."""

    def __init__(self, path: Path | None) -> None:
        self._path = path
        self._loaded: _Loaded | None = None
        if path is not None:
            self._allowed()  # a broken file stops the broker at start, not at the first request

    def check(self, credential: str, url: str) -> None:
        """Raise ``ErrorReason.CREDENTIAL_ORIGIN_NOT_ALLOWED`` unless ``credential`` may be sent to ``url``."""
        try:
            origin = origin_of(url)
        except ValueError as error:
            raise _refused(str(error), credential) from None
        if origin.startswith("http://") and not is_loopback(origin):
            raise _refused(
                f"credential {credential!r} is not sent over plain http to {origin}: use https", credential
            )
        if self._path is None:
            if not is_loopback(origin):
                raise _refused(
                    f"credential {credential!r} may not be sent to {origin}: no origins file is "
                    "configured (ABADA_BROKER_CREDENTIAL_ORIGINS_FILE), so only loopback servers get credentials",
                    credential,
                )
            return
        bindings = self._allowed().get(credential, frozenset())
        if not any(binding.origin == origin for binding in bindings):
            raise _refused(f"credential {credential!r} may not be sent to {origin}", credential)
        if all(not binding.path_segments for binding in bindings):
            return
        try:
            segments = path_segments_of(url)
        except ValueError as error:
            raise _refused(str(error), credential) from None
        if not any(binding.allows(origin, segments) for binding in bindings):
            shown = "/" + "/".join(segments)
            raise _refused(f"credential {credential!r} may not be sent to {shown} on {origin}", credential)

    def _allowed(self) -> dict[str, frozenset[Binding]]:
        assert self._path is not None
        try:
            mtime_ns = self._path.stat().st_mtime_ns
        except OSError as error:
            if self._loaded is not None:
                log.warning(
                    "the origins file cannot be read; keeping the last good one", extra={"error": str(error)}
                )
                return self._loaded.allowed
            raise OriginsFileError(f"cannot read the origins file {self._path}: {error.strerror}") from None
        if self._loaded is not None and self._loaded.mtime_ns == mtime_ns:
            return self._loaded.allowed
        try:
            allowed = _parse(self._path.read_text())
        except (OSError, OriginsFileError, yaml.YAMLError) as error:
            if self._loaded is not None:
                log.warning(
                    "the origins file is broken; keeping the last good one", extra={"error": str(error)}
                )
                return self._loaded.allowed
            raise OriginsFileError(f"the origins file {self._path} is not usable: {error}") from None
        self._loaded = _Loaded(mtime_ns, allowed)
        return allowed


def _parse(text: str) -> dict[str, frozenset[Binding]]:
    data = yaml.safe_load(text) or {}
    if not isinstance(data, dict):
        raise OriginsFileError("it must map credential names to lists of origins")
    allowed: dict[str, frozenset[Binding]] = {}
    for credential, urls in data.items():
        if not isinstance(credential, str) or not isinstance(urls, list):
            raise OriginsFileError(f"{credential!r} must map to a list of origins")
        origins = set()
        for url in urls:
            if not isinstance(url, str):
                raise OriginsFileError(f"{credential}: {url!r} is not a URL")
            try:
                binding = binding_of(url)
            except ValueError as error:
                raise OriginsFileError(f"{credential}: {error}") from None
            if binding.origin.startswith("http://") and not is_loopback(binding.origin):
                raise OriginsFileError(
                    f"{credential}: {url!r} is plain http; only https is allowed off loopback"
                )
            origins.add(binding)
        allowed[credential] = frozenset(origins)
    return allowed
