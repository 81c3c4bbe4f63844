"""A hand-written hostile MCP server (streamable HTTP, JSON answers) on a loopback port, in-process.

It speaks just enough of the protocol for a real MCP client to open a session, then misbehaves the
way the review's server did, by `mode`:

- `endless_pages`: every `tools/list` page names one more tool and a next cursor, for ever;
- `many_tools`: one page of 5,000 tools;
- `trickle`: the `tools/list` answer sends one space a second and never ends;
- `huge_call`: a `tools/call` answer of `huge_bytes`, streamed without a length;
- `huge_list`: the same for `tools/list` (what the engine reads at deploy);
- anything else: a well-behaved server with one tool, `lookup`.

It counts what it did (`pages`, `calls`, `sent_bytes`), so a test can tell when its client stopped listening.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

TOOL = {"name": "lookup", "description": "Look a thing up.", "inputSchema": {"type": "object"}}


@dataclass
class HostileServer:
    mode: str
    huge_bytes: int = 50 * 1024 * 1024
    url: str = ""
    pages: int = 0
    calls: int = 0
    sent_bytes: int = 0
    stopped_listening: asyncio.Event = field(default_factory=asyncio.Event)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    return
                method = request_line.split(b" ")[0].decode()
                headers: dict[str, str] = {}
                while (line := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if method != "POST":
                    await self._answer(writer, 405, b"")
                    continue
                message = json.loads(body)
                if "id" not in message:
                    await self._answer(writer, 202, b"")
                    continue
                await self._reply(writer, message)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.stopped_listening.set()
        finally:
            writer.close()

    async def _reply(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        method = message["method"]
        if method == "initialize":
            result: dict[str, Any] = {
                "protocolVersion": message["params"]["protocolVersion"],
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile", "version": "1"},
            }
        elif method == "tools/list":
            self.pages += 1
            if self.mode == "trickle":
                await self._trickle(writer)
                return
            if self.mode == "huge_list":
                await self._huge(writer, message["id"])
                return
            if self.mode == "endless_pages":
                result = {"tools": [{**TOOL, "name": f"tool_{self.pages}"}], "nextCursor": str(self.pages)}
            elif self.mode == "many_tools":
                result = {"tools": [{**TOOL, "name": f"tool_{n}"} for n in range(5_000)]}
            else:
                result = {"tools": [TOOL]}
        elif method == "tools/call":
            self.calls += 1
            if self.mode == "huge_call":
                await self._huge(writer, message["id"])
                return
            result = {"content": [{"type": "text", "text": "found"}]}
        else:
            result = {}
        payload = json.dumps({"jsonrpc": "2.0", "id": message["id"], "result": result}).encode()
        await self._answer(writer, 200, payload)

    async def _answer(self, writer: asyncio.StreamWriter, status: int, payload: bytes) -> None:
        reason = {200: "OK", 202: "Accepted", 405: "Method Not Allowed"}[status]
        head = f"HTTP/1.1 {status} {reason}\r\nContent-Length: {len(payload)}\r\n"
        if payload:
            head += "Content-Type: application/json\r\n"
        writer.write(head.encode() + b"\r\n" + payload)
        await writer.drain()

    async def _chunked_head(self, writer: asyncio.StreamWriter) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        await writer.drain()

    async def _chunk(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()
        self.sent_bytes += len(data)

    async def _trickle(self, writer: asyncio.StreamWriter) -> None:
        await self._chunked_head(writer)
        while True:
            await self._chunk(writer, b" ")
            await asyncio.sleep(1.0)

    async def _huge(self, writer: asyncio.StreamWriter, call_id: Any) -> None:
        await self._chunked_head(writer)
        await self._chunk(writer, b'{"jsonrpc": "2.0", "id": ' + json.dumps(call_id).encode())
        await self._chunk(writer, b', "result": {"content": [{"type": "text", "text": "')
        block = b"x" * 65_536
        while self.sent_bytes < self.huge_bytes:
            await self._chunk(writer, block)
        await self._chunk(writer, b'"}]}}')
        writer.write(b"0\r\n\r\n")
        await writer.drain()


@contextlib.asynccontextmanager
async def hostile_mcp_server(mode: str, **options: Any) -> AsyncIterator[HostileServer]:
    server = HostileServer(mode, **options)
    listening = await asyncio.start_server(server._serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}/mcp"
    try:
        yield server
    finally:
        listening.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(listening.wait_closed(), 5)
