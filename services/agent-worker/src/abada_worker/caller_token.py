"""The bearer token the worker presents to the engine and the broker, re-read when its file changes."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

_MISSING = (-1, -1, -1)


class CallerToken:
    """From ABADA_WORKER_TOKEN, or from ABADA_WORKER_TOKEN_FILE (a mounted secret that may rotate)."""

    def __init__(self, token: str | None = None, token_file: Path | None = None) -> None:
        self._static = token.strip() if token else None
        self._file = token_file
        self._seen: tuple[int, int, int] | None = None
        self._from_file: str | None = None

    def current(self) -> str | None:
        if self._file is None:
            return self._static
        try:
            stat = os.stat(self._file)
        except OSError as error:
            if self._seen != _MISSING:
                log.warning("cannot read the worker token file %s: %s", self._file, error.strerror)
                self._seen = _MISSING
            # The last token read stays in use: a file briefly gone during a rotation is no outage.
            return self._from_file
        version = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if version != self._seen:
            self._from_file = self._file.read_text(encoding="utf-8").strip() or None
            self._seen = version
        return self._from_file

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """gRPC call metadata: `authorization: Bearer <token>`, or nothing when no token is set."""
        token = self.current()
        return (("authorization", f"Bearer {token}"),) if token else ()
