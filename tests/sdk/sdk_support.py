"""Helpers for the SDK tests: an SDK worker process and polling for a condition."""

from __future__ import annotations

import asyncio
import json
import pathlib
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any


class WorkerProcess:
    """`sdk_worker_app.py` as a subprocess; its stderr collected, its handler calls read from a file."""

    def __init__(self, process: asyncio.subprocess.Process, trace: pathlib.Path) -> None:
        self.process = process
        self.trace = trace
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def calls(self, event: str | None = None) -> list[dict[str, Any]]:
        if not self.trace.exists():
            return []
        found = [json.loads(line) for line in self.trace.read_text().splitlines() if line.strip()]
        return [call for call in found if event is None or call["event"] == event]

    async def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        await poll(
            lambda: any(text in line for line in self.lines), timeout, f"log line {text!r}\n{self.log}"
        )

    async def wait_for_calls(self, event: str, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        await poll(lambda: len(self.calls(event)) >= count, timeout, f"{count} {event} calls\n{self.log}")
        return self.calls(event)

    async def terminate(self) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.process.wait(), 20)
        finally:
            await self._reader


async def poll(condition: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        outcome = condition()
        if not isinstance(outcome, bool):
            outcome = await outcome
        if outcome:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.05)
