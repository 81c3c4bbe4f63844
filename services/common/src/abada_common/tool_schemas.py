"""The one definition of a tool's schema and description hashes: deploy pins them, the worker checks
them at run time.

Both checks must agree byte for byte, so neither side carries its own copy.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def schema_sha256(schema: Any) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces) of a tool's inputSchema."""
    return hashlib.sha256(json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def description_sha256(description: str | None) -> str:
    """SHA-256 of a tool's description as UTF-8 (no description hashes like the empty string)."""
    return hashlib.sha256((description or "").encode()).hexdigest()
