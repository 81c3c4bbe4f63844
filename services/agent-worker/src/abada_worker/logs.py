"""The worker's logging: the services' JSON lines (abada_common.logs), with every secret the worker
holds scrubbed from every line.

Secrets are redacted at the formatter, so a message that quotes an exception or a header by
accident still cannot carry a credential out.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import MutableMapping
from typing import Any

from abada_common.logs import JsonFormatter
from abada_common.logs import configure_logging as configure_json_logging

SERVICE = "agent-worker"
REDACTED = "[redacted]"


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


class TaskLog(logging.LoggerAdapter[logging.Logger]):
    """Adds the task's fields to every record, and keeps the record's own `extra` too.

    The standard adapter replaces a call's `extra` with its own (before Python 3.13).
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **(kwargs.get("extra") or {})}
        return msg, kwargs


def configure_logging(level: str = "INFO") -> None:
    root = configure_json_logging(JsonFormatter(SERVICE, redact=redactor.redact), level)
    # The HTTP clients log every request at INFO, and the model SDKs their request options (headers
    # included) at DEBUG; the worker logs what matters itself, and the redactor stays the backstop.
    for chatty in ("httpx", "httpx2", "httpcore", "mcp", "google_genai", "openai", "anthropic"):
        logging.getLogger(chatty).setLevel(max(logging.WARNING, root.level))
