"""HTTP clients whose every response body is counted as it streams in and cut off past a size.

A tool server or a model provider can answer with hundreds of megabytes (a 300 MB `tools/call`
answer took the worker to 1.7 GB); the engine lists a tool server's tools at deploy, the worker calls
them at every task, and both read through these clients. Checking the size once the body is in memory is too late: here
the transport counts the bytes of each response as they arrive and stops reading at the limit,
raising `ResponseTooLarge` (a refusal: the same request would get the same answer). `over_limit`
remembers that it happened, for the code that tells a refusal from an outage when the error
reaches it wrapped by a client library.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx2

from abada_common.tool_limits import MAX_RESPONSE_BYTES, TooMuchFromServer


class ResponseTooLarge(httpx2.HTTPError, TooMuchFromServer):
    """A response body went past the limit; reading stopped there."""

    def __init__(self, url: str, limit: int) -> None:
        super().__init__(f"the answer from {url} was larger than {limit} bytes; reading stopped there")
        self.limit = limit


class _CappedStream(httpx2.AsyncByteStream):
    def __init__(self, inner: httpx2.AsyncByteStream, limit: int, url: str, owner: CappedTransport) -> None:
        self._inner = inner
        self._limit = limit
        self._url = url
        self._owner = owner

    async def __aiter__(self) -> AsyncIterator[bytes]:
        received = 0
        async for chunk in self._inner:
            received += len(chunk)
            if received > self._limit:
                self._owner.over_limit = True
                raise ResponseTooLarge(self._url, self._limit)
            yield chunk

    async def aclose(self) -> None:
        await self._inner.aclose()


def too_large_in(error: BaseException) -> ResponseTooLarge | None:
    """The `ResponseTooLarge` an error was raised from (a client library wraps it in its own), if any."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ResponseTooLarge):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def capped_client(limit: int = MAX_RESPONSE_BYTES) -> httpx2.AsyncClient:
    """An HTTP client for a model provider's SDK: bodies capped, no proxy from the environment."""
    return httpx2.AsyncClient(transport=CappedTransport(limit=limit), trust_env=False)


class CappedTransport(httpx2.AsyncBaseTransport):
    """An `AsyncHTTPTransport` (never reading proxies from the environment) whose response bodies are
    capped at `limit` bytes each."""

    def __init__(self, *, limit: int = MAX_RESPONSE_BYTES, verify: object = True) -> None:
        self._inner = httpx2.AsyncHTTPTransport(verify=verify, trust_env=False)  # type: ignore[arg-type]
        self._limit = limit
        self.over_limit = False

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await self._inner.handle_async_request(request)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self._limit:
            await response.aclose()
            self.over_limit = True
            raise ResponseTooLarge(str(request.url), self._limit)
        stream = response.stream
        assert isinstance(stream, httpx2.AsyncByteStream)
        response.stream = _CappedStream(stream, self._limit, str(request.url), self)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()
