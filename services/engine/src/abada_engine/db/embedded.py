"""An embedded PostgreSQL (pgserver) for development and the offline demo."""

from __future__ import annotations

import logging
import pathlib
from typing import Any

log = logging.getLogger(__name__)


def start_embedded_postgres(data_dir: pathlib.Path) -> tuple[str, Any]:
    """Start (or attach to) an embedded server in `data_dir`; return its URL and handle."""
    import pgserver

    data_dir.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(str(data_dir), cleanup_mode="stop")
    url = server.get_uri()
    log.warning(
        "ABADA_DATABASE_URL is not set: using an embedded PostgreSQL (pgserver) in %s; "
        "set ABADA_DATABASE_URL for anything but development",
        data_dir,
    )
    return url, server
