"""The `abada-worker` as a real subprocess, its JSON log collected, always stopped afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any


class WorkerProcess:
    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._reader = asyncio.create_task(self._read())

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def records(self) -> list[dict[str, Any]]:
        parsed = []
        for line in self.lines:
            with contextlib.suppress(ValueError):
                parsed.append(json.loads(line))
        return parsed

    @property
    def log_text(self) -> str:
        return "\n".join(self.lines)

    async def _read(self) -> None:
        assert self.process.stderr is not None
        async for raw in self.process.stderr:
            self.lines.append(raw.decode(errors="replace").rstrip("\n"))

    # Generous: a worker's start-up (imports, channels) takes seconds on a machine busy with other work;
    # polling costs nothing when it is quick.
    async def wait_for_log(self, message: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.records:
                if record.get("message") == message:
                    return record
            if self.process.returncode is not None:
                break
            await asyncio.sleep(0.05)
        raise AssertionError(f"the worker never logged {message!r}:\n{self.log_text[-4000:]}")

    async def wait(self, timeout: float = 20.0) -> int:
        try:
            code = await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"the worker did not exit within {timeout}s:\n{self.log_text[-4000:]}"
            ) from None
        await self._reader
        return code

    async def terminate(self, timeout: float = 20.0) -> int:
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        return await self.wait(timeout)

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.process.wait(), 10)
        self._reader.cancel()


class WorkerLauncher:
    """Starts workers with the test's environment; every one still running is killed at the end."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.started: list[WorkerProcess] = []

    async def start(self, **overrides: str) -> WorkerProcess:
        environment = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("ABADA_", "GEMINI_", "OPENAI_", "ANTHROPIC_"))
        }
        environment.update(self.env)
        environment.update(overrides)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "abada_worker.main",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            env=environment,
        )
        worker = WorkerProcess(process)
        self.started.append(worker)
        # Loading the provider SDKs takes seconds, and on a loaded 2-core machine more than a minute.
        await worker.wait_for_log("worker ready", timeout=120)
        return worker

    async def close(self) -> None:
        for worker in self.started:
            await worker.kill()


@contextlib.asynccontextmanager
async def worker_launcher(env: dict[str, str]) -> AsyncIterator[WorkerLauncher]:
    launcher = WorkerLauncher(env)
    try:
        yield launcher
    finally:
        await launcher.close()
