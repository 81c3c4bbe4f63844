"""The broker's logging: the services' JSON lines (abada_common.logs), with the audit trail always on."""

from __future__ import annotations

import logging
from typing import TextIO

from abada_common.logs import JsonFormatter
from abada_common.logs import configure_logging as configure_json_logging

from .audit import AUDIT_LOGGER

SERVICE = "credential-broker"


def configure_logging(level: str = "INFO", stream: TextIO | None = None) -> None:
    configure_json_logging(JsonFormatter(SERVICE), level, stream)
    # The audit trail is not diagnostics: a quieter ABADA_LOG_LEVEL must not switch it off.
    logging.getLogger(AUDIT_LOGGER).setLevel(logging.INFO)
    logging.captureWarnings(True)
