"""How an attempt can end other than with an answer; the executor turns each into the right call."""

from __future__ import annotations

from typing import Any


class AttemptEnded(Exception):
    """Base: the attempt stops here."""


class LeaseLost(AttemptEnded):
    """Somebody else owns the task now (or nobody): report nothing, touch nothing."""

    def __init__(self, reason: str, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason = reason


class Interrupted(AttemptEnded):
    """The drain deadline passed: stop without a half-done write and let the lease lapse."""


class AttemptFailed(AttemptEnded):
    """Report the attempt as failed; with `no_retry` the engine raises an incident instead of retrying."""

    def __init__(
        self, error_code: str, message: str, *, no_retry: bool = False, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.error_code = error_code
        self.message = message
        self.no_retry = no_retry
        self.details = details or {}


class LimitExceeded(AttemptFailed):
    def __init__(self, limit: str, message: str) -> None:
        super().__init__("LIMIT_EXCEEDED", message, no_retry=True, details={"limit": limit})
        self.limit = limit


class QuotaWait(Exception):
    """A model's quota is used up for now: wait this long, keep the lease, and ask again.

    Raised for the engine's MODEL_QUOTA_EXHAUSTED and for a provider's own 429; never ends the attempt.
    """

    def __init__(self, retry_after_seconds: float, message: str, source: str) -> None:
        super().__init__(message)
        self.retry_after_seconds = retry_after_seconds
        self.source = source


class EngineUnavailable(Exception):
    """The engine did not answer within the retry budget."""
