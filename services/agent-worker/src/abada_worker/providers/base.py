"""What the agent loop needs from a model provider, and nothing about any provider's wire format."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Generic, Protocol, TypeVar

from abada_common.capped_http import ResponseTooLarge, capped_client, too_large_in

from ..conversation import FunctionResult, ModelReply, ModelRequest, ModelTurn, Turn

StatusError = TypeVar("StatusError", bound=BaseException)

# Statuses another try may fix (timeout, conflict, rate limit, the provider's own trouble);
# any other client error would fail the same way again.
RETRYABLE_STATUSES = frozenset({408, 409, 429})


class ModelCallError(Exception):
    """The provider gave no reply. `retryable` says whether another attempt may get one.

    `retry_after_seconds` is set when the provider said when to come back (a 429 with
    `retry-after`): the worker waits that long and asks again within the same attempt.
    """

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
    # Where the worker's credential for the provider comes from, named when the provider rejects it.
    credential: str

    async def generate(self, request: ModelRequest) -> ModelReply:
        """One model turn; raises ModelCallError when there is no reply."""
        ...

    async def aclose(self) -> None: ...


def status_is_retryable(status: int) -> bool:
    return status >= 500 or status in RETRYABLE_STATUSES


def error_reply(
    provider: str,
    status: int,
    code: str,
    message: str,
    *,
    retry_after_seconds: float | None,
    retryable: bool = True,
) -> ModelCallError:
    """A provider's error reply, told the same for every provider: the status, the provider's own
    code for the error when it gave one, and its message. Another try may help when the status says
    so, unless the provider's own code said it will not (`retryable`)."""
    said = f"{provider} answered {status}{f' {code}' if code else ''}"
    return ModelCallError(
        f"{said}: {message}" if message else said,
        retryable=retryable and status_is_retryable(status),
        status=status,
        retry_after_seconds=retry_after_seconds,
    )


# The provider's own quota: waited out like the engine's (the lease kept, the same STARTED step).
QUOTA_STATUS = 429
# The provider refused the worker's credential: no retry can fix it.
CREDENTIAL_STATUSES = frozenset({401, 403})


def reply_too_large(provider: str, error: BaseException) -> ModelCallError:
    """A reply cut off at the response size limit (`capped_http`): asking again gets the same."""
    return ModelCallError(
        f"{provider}'s reply was not read to its end: {too_large_in(error)}", retryable=False
    )


def unreachable(provider: str, error: BaseException) -> ModelCallError:
    """No reply from the transport (connection refused, a timeout, a body that is not a reply):
    another attempt may well get one, unless the reply was cut off at the size limit."""
    if too_large_in(error) is not None:
        return reply_too_large(provider, error)
    return ModelCallError(f"{provider} could not be reached: {error!r}", retryable=True)


@contextmanager
def sdk_errors(
    provider: str,
    status_error: type[StatusError],
    call_error: Callable[[StatusError], ModelCallError],
    transport_error: type[BaseException],
) -> Iterator[None]:
    """Around a call to the provider's SDK: its failures as `ModelCallError`, an error reply (the
    SDK's `status_error`) as `call_error` reads it, any `transport_error` as no reply at all."""
    try:
        yield
    except ResponseTooLarge as error:
        # Some SDK paths let the transport's own error through unwrapped.
        raise reply_too_large(provider, error) from None
    except status_error as error:
        raise call_error(error) from None
    except transport_error as error:
        raise unreachable(provider, error) from None


def key_or_placeholder(
    provider: str,
    credential: str,
    *,
    api_key: str | None,
    base_url: str | None,
    placeholder: str,
    instead: str = "a base URL for a compatible server",
) -> str:
    """The key to give the provider's SDK: the worker's own, else a placeholder for a server at
    `base_url` that needs none (the SDKs refuse to start without a key)."""
    if api_key:
        return api_key
    if not base_url:
        raise ValueError(f"{provider} needs {credential}, or {instead}")
    return placeholder


class _SdkClient(Protocol):
    async def close(self) -> None: ...


SdkClient = TypeVar("SdkClient", bound=_SdkClient)


class StainlessProvider(Generic[SdkClient]):
    """A provider served through the `openai` or `anthropic` SDK, whose async clients take the same
    options and close the same way.

    The SDK's own retries are off: a rate limit goes back to the worker, which waits out
    `retry-after` within the attempt, and an outage is waited out with every other worker.
    """

    credential: str

    def __init__(
        self,
        factory: Callable[..., SdkClient],
        provider: str,
        *,
        api_key: str | None,
        base_url: str | None,
        timeout_seconds: float,
    ) -> None:
        self._client = factory(
            # A key for servers that need none (the scripted endpoint, a local vLLM); the SDK insists on one.
            api_key=key_or_placeholder(
                provider, self.credential, api_key=api_key, base_url=base_url, placeholder="no-key"
            ),
            base_url=base_url or None,
            timeout=timeout_seconds,
            max_retries=0,
            http_client=capped_client(),
        )

    async def aclose(self) -> None:
        await self._client.close()


def wire_history(history: tuple[Turn, ...]) -> Iterator[ModelTurn | list[tuple[FunctionResult, str]]]:
    """The history as a provider shows it: each model turn, and each turn's results paired with the
    call id the model gave (its own, often none), not the one the worker assigned for its journal."""
    wire_ids: dict[str, str] = {}
    for turn in history:
        if isinstance(turn, ModelTurn):
            wire_ids.update((call.id, call.wire_id) for call in turn.function_calls)
            yield turn
        else:
            yield [(result, wire_ids.get(result.call_id, result.call_id)) for result in turn.results]


def is_outage(error: ModelCallError) -> bool:
    """A failure that passes with time rather than a refusal of this request: the provider overloaded
    or out of reach (408, 409, any 5xx, 529 included, a connection error, a timeout). A 429 is not an
    outage but the provider's quota, waited out as quota."""
    return error.retryable and error.status != QUOTA_STATUS


def retry_after_seconds(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """How long the provider asked us to wait: `retry-after-ms`, else `retry-after` (seconds or a date).

    None when it said nothing usable; never negative.
    """
    lowered = {name.lower(): value for name, value in headers.items()}
    milliseconds = lowered.get("retry-after-ms")
    if milliseconds:
        try:
            return max(0.0, float(milliseconds) / 1000)
        except ValueError:
            pass
    value = lowered.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
