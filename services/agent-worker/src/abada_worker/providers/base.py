"""What the agent loop needs from a model provider, and nothing about any provider's wire format."""

from __future__ import annotations

from typing import Protocol

from ..conversation import ModelReply, ModelRequest


class ModelCallError(Exception):
    """The provider gave no reply. `retryable` says whether another attempt may get one."""

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after_seconds: float | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        # What the provider said about when to ask again (a 429's retry delay), if anything.
        self.retry_after_seconds = retry_after_seconds


class ModelProvider(Protocol):
    # Reported in the attempt metadata, e.g. "gemini".
    name: str

    async def generate(self, request: ModelRequest) -> ModelReply:
        """One model turn; raises ModelCallError when there is no reply."""
        ...

    async def aclose(self) -> None: ...
