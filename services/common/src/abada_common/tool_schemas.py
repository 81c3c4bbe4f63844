"""The one definition of a tool's schema hash: deploy pins it, the worker checks it at run time.

Both checks must agree byte for byte, so neither side carries its own copy.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


def schema_sha256(schema: Any) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces) of a tool's inputSchema."""
    return hashlib.sha256(json.dumps(schema, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
