"""Finding 3, the model side: a provider (or whatever answers at its address) cannot exhaust a worker.

The same streamed cap as a tool server's answers holds for each provider's replies: an endless
body is cut off while it streams in, and the call is a refusal, not an outage to ask again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from abada_common.tool_limits import MAX_RESPONSE_BYTES
from abada_worker.conversation import ModelRequest
from abada_worker.providers.anthropic_messages import AnthropicMessagesProvider
from abada_worker.providers.base import ModelCallError, is_outage
from abada_worker.providers.gemini import GeminiProvider
from abada_worker.providers.openai_chat import OpenAIChatProvider


@contextlib.asynccontextmanager
async def endless_answer() -> AsyncIterator[tuple[str, list[int]]]:
    """Answers every request with 200 and a JSON body that never ends; counts what it managed to send."""
    sent = [0]

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            headers = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in headers.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                ),
                0,
            )
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            block = b"1" * 65_536
            writer.write(b'6\r\n{"a": \r\n')
            while sent[0] < 40 * MAX_RESPONSE_BYTES:
                writer.write(f"{len(block):x}\r\n".encode() + block + b"\r\n")
                await writer.drain()
                sent[0] += len(block)
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", sent
    finally:
        server.close()


PROVIDERS = {
    "openai": lambda url: OpenAIChatProvider(api_key=None, base_url=url + "/v1", timeout_seconds=60),
    "anthropic": lambda url: AnthropicMessagesProvider(api_key=None, base_url=url, timeout_seconds=60),
    "gemini": lambda url: GeminiProvider(api_key=None, base_url=url, timeout_seconds=60),
}


@pytest.mark.parametrize("name", sorted(PROVIDERS))
async def test_an_endless_reply_is_cut_off_and_not_asked_again(name):
    async with endless_answer() as (url, sent):
        provider = PROVIDERS[name](url)
        with pytest.raises(ModelCallError) as caught:
            await asyncio.wait_for(provider.generate(ModelRequest("m", "system", "user", (), ())), 120)
    assert "not read to its end" in str(caught.value)
    assert not is_outage(caught.value) and not caught.value.retryable
    assert sent[0] < 20 * MAX_RESPONSE_BYTES  # the worker stopped reading long before the end
