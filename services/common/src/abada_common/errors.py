"""What every service's refusals have in common, without gRPC: the categories and the size bounds.

A service's domain raises its own exception carrying a `Category`, a reason and a message; only the
service's handlers turn it into a gRPC status (`abada_common.rpc_status`). The bounds live here because
a message is cut before it is logged or audited too, not only when it is sent.
"""

from __future__ import annotations

from enum import StrEnum


class Category(StrEnum):
    """What went wrong, in gRPC's vocabulary (lower case, as audit logs record it)."""

    INVALID_ARGUMENT = "invalid_argument"
    NOT_FOUND = "not_found"
    FAILED_PRECONDITION = "failed_precondition"
    PERMISSION_DENIED = "permission_denied"
    UNAUTHENTICATED = "unauthenticated"
    ALREADY_EXISTS = "already_exists"
    ABORTED = "aborted"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DATA_LOSS = "data_loss"
    INTERNAL = "internal"


# A client refuses trailers over 8 KiB (gRPC's default metadata limit) and then reports
# RESOURCE_EXHAUSTED instead of the real status. The message travels twice (grpc-message,
# percent-encoded: up to 3 bytes per byte; and inside grpc-status-details-bin, base64: 4/3), so a
# refusal repeats at most this much of what it was given, whatever the caller sent.
MAX_MESSAGE_BYTES = 1_000
MAX_METADATA_KEY_BYTES = 60
MAX_METADATA_VALUE_BYTES = 200
MAX_VIOLATION_BYTES = 500
MAX_DETAILS_BYTES = 3_600


def bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, saying how much was left out."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: max(0, limit - 40)].decode(errors="ignore")
    return f"{kept}… ({len(raw) - len(kept.encode())} more bytes)"
