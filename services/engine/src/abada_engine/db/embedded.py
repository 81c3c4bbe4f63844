"""An embedded PostgreSQL (pgserver) for development and the offline demo."""

from __future__ import annotations

import logging
import pathlib
import warnings
from typing import Any

log = logging.getLogger(__name__)


def start_embedded_postgres(data_dir: pathlib.Path, *, announce: bool = True) -> tuple[str, Any]:
    """Start (or attach to) an embedded server in `data_dir`; return its URL and handle.

    `announce` logs that this is not for production (`abada dev` says so in its own words)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs complains about XDG_RUNTIME_DIR in containers
        import pgserver

    data_dir.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(str(data_dir), cleanup_mode="stop")
    url = server.get_uri()
    if not announce:
        return url, server
    log.warning(
        "ABADA_DATABASE_URL is not set: using an embedded PostgreSQL (pgserver) in %s; "
        "set ABADA_DATABASE_URL for anything but development",
        data_dir,
    )
    return url, server
