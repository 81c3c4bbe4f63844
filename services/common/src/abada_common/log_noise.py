"""Third-party loggers every service keeps at WARNING unless ABADA_LOG_LEVEL is DEBUG.

The HTTP and MCP clients log each request and session at INFO (six lines for one deploy against one
tool server), which buries the service's own lines; their warnings and errors still come through.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

# Libraries that log routine traffic at INFO: HTTP clients (httpx2 is the MCP SDK's), the MCP SDK,
# Vault's client, HTTP servers, and Alembic's per-step chatter (the engine says what it migrated).
NOISY_LOGGERS = (
    "httpx",
    "httpx2",
    "httpcore",
    "mcp",
    "alembic",
    "urllib3",
    "hvac",
    "uvicorn",
    "sse_starlette",
)


def quiet_third_party_loggers(extra: Iterable[str] = ()) -> None:
    """Sets the noisy libraries to WARNING, or back to the root's level when the root logs DEBUG.

    Call after the root logger's level is set.
    """
    debugging = logging.getLogger().level <= logging.DEBUG
    for name in (*NOISY_LOGGERS, *extra):
        logging.getLogger(name).setLevel(logging.NOTSET if debugging else logging.WARNING)
