"""The offline demo's secret store: a YAML (or JSON) file, read again on every request."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import yaml

from .base import Secret, SecretNotFound, SecretStoreConfigError, SecretStoreUnavailable


class FileSecretStore:
    """Secrets from a YAML (or JSON) file: ``name: value`` or ``name: {value: ..., version: N}``.

    The file is read on every ``read``, so rewriting it rotates a secret at once; write it atomically
    (write a temporary file, then rename) so a reader never sees half a file. A plain value gets
    version 1, and the next version each time its value changes while the store runs.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._path = Path(path)
        self._lock = threading.Lock()
        self._fingerprint: bytes | None = None
        self._secrets: dict[str, Secret] = {}

    def __repr__(self) -> str:
        return f"FileSecretStore({str(self._path)!r})"

    async def read(self, credential: str) -> Secret:
        secrets_by_name = await asyncio.to_thread(self._load)
        secret = secrets_by_name.get(credential)
        if secret is None:
            raise SecretNotFound(
                f"credential {credential!r} is not in the secrets file {str(self._path)!r}",
                credential=credential,
            )
        return secret

    async def check(self) -> None:
        await asyncio.to_thread(self._load)

    async def close(self) -> None:
        return None

    def _load(self) -> dict[str, Secret]:
        try:
            raw = self._path.read_bytes()
        except OSError as error:
            raise SecretStoreUnavailable(
                f"cannot read the secrets file {str(self._path)!r}: {error.strerror or type(error).__name__}"
            ) from None
        fingerprint = hashlib.sha256(raw).digest()
        with self._lock:
            if fingerprint != self._fingerprint:
                self._secrets = self._parse(raw, previous=self._secrets)
                self._fingerprint = fingerprint
            return self._secrets

    def _parse(self, raw: bytes, *, previous: Mapping[str, Secret]) -> dict[str, Secret]:
        where = repr(str(self._path))
        try:
            document = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            # PyYAML's own message quotes the offending line, which may hold a secret: give the position only.
            mark = getattr(error, "problem_mark", None)
            position = "" if mark is None else f" at line {mark.line + 1}, column {mark.column + 1}"
            raise SecretStoreConfigError(
                f"the secrets file {where} is not valid YAML or JSON{position}"
            ) from None
        if document is None:
            return {}
        if not isinstance(document, dict):
            raise SecretStoreConfigError(f"the secrets file {where} must map credential names to values")
        loaded: dict[str, Secret] = {}
        for name, entry in document.items():
            if not isinstance(name, str):
                raise SecretStoreConfigError(f"the secrets file {where} has a non-text credential name")
            value, version = self._entry(name, entry, where)
            if version is None:
                before = previous.get(name)
                if before is None:
                    version = 1
                elif before.value == value:
                    version = before.version
                else:
                    version = before.version + 1
            loaded[name] = Secret(name=name, version=version, value=value)
        return loaded

    @staticmethod
    def _entry(name: str, entry: object, where: str) -> tuple[str, int | None]:
        shape = "a non-empty string or {value: <string>, version: <positive integer>}"
        if isinstance(entry, str) and entry:
            return entry, None
        if isinstance(entry, dict):
            value, version = entry.get("value"), entry.get("version")
            extra = set(entry) - {"value", "version"}
            version_ok = version is None or (
                isinstance(version, int) and not isinstance(version, bool) and version > 0
            )
            if isinstance(value, str) and value and version_ok and not extra:
                return value, version
        raise SecretStoreConfigError(
            f"credential {name!r} in the secrets file {where} must be {shape}", credential=name
        )
