"""JSON logs, one object a line, with every secret the worker holds scrubbed from every record.

Same format as the other Abada services: time, level, service, logger, message, then any `extra`
fields. Secrets are redacted at the handler, so a message that quotes an exception or a header by
accident still cannot carry a credential out.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import Counter
from collections.abc import MutableMapping
from datetime import UTC, datetime
from typing import Any

from abada_common.telemetry import TraceContextFilter

SERVICE = "agent-worker"
REDACTED = "[redacted]"
_STANDARD_ATTRIBUTES = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class SecretRedactor:
    """The secrets currently held, counted, so two tasks sharing one credential can release it apart."""

    def __init__(self) -> None:
        self._held: Counter[str] = Counter()
        self._lock = threading.Lock()

    def hold(self, secret: str) -> None:
        if secret:
            with self._lock:
                self._held[secret] += 1

    def release(self, secret: str) -> None:
        with self._lock:
            if self._held[secret] <= 1:
                self._held.pop(secret, None)
            else:
                self._held[secret] -= 1

    def redact(self, text: str) -> str:
        with self._lock:
            secrets = sorted(self._held, key=len, reverse=True)
        for secret in secrets:
            text = text.replace(secret, REDACTED)
        return text


redactor = SecretRedactor()


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str = SERVICE, scrubber: SecretRedactor = redactor) -> None:
        super().__init__()
        self._service = service
        self._scrubber = scrubber

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(
            {
                key: value
                for key, value in vars(record).items()
                if key not in _STANDARD_ATTRIBUTES and not key.startswith("_")
            }
        )
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return self._scrubber.redact(json.dumps(entry, default=str, ensure_ascii=False))


class TaskLog(logging.LoggerAdapter[logging.Logger]):
    """Adds the task's fields to every record, and keeps the record's own `extra` too.

    The standard adapter replaces a call's `extra` with its own (before Python 3.13).
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def configure_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(TraceContextFilter())  # trace_id and span_id inside a span
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # The HTTP clients log every request at INFO, and the model SDKs their request options (headers
    # included) at DEBUG; the worker logs what matters itself, and the redactor stays the backstop.
    for chatty in ("httpx", "httpx2", "mcp", "google_genai", "openai", "anthropic"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
