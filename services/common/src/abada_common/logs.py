"""JSON logs on stderr, one object a line, the same for every Abada service: time, level, service,
logger, message, then the record's `extra` fields, and `trace_id` / `span_id` inside a recorded span.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TextIO

from .log_noise import quiet_third_party_loggers
from .telemetry import TraceContextFilter

_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; `redact` (a service's secret scrubber) sees the finished line."""

    def __init__(self, service: str, redact: Callable[[str], str] | None = None) -> None:
        super().__init__()
        self._service = service
        self._redact = redact

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            # An `extra` field never replaces one of the fixed ones above.
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_") and key not in entry:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        line = json.dumps(entry, default=str, ensure_ascii=False)
        return self._redact(line) if self._redact is not None else line


def configure_logging(
    formatter: logging.Formatter, level: str = "INFO", stream: TextIO | None = None
) -> logging.Logger:
    """Sends every record to `stream` (stderr) through `formatter`; returns the root logger."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(formatter)
    handler.addFilter(TraceContextFilter())  # trace_id and span_id inside a span
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    quiet_third_party_loggers()  # httpx, mcp, alembic ... at WARNING unless the level is DEBUG
    return root
