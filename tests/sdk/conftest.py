"""SDK tests: the SDK's client on the test loop, and SDK workers as real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pathlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from abada_sdk import AsyncEngineClient
from sdk_support import WorkerProcess

APP = pathlib.Path(__file__).with_name("sdk_worker_app.py")


@pytest.fixture
async def sdk_worker(
    engine_tokens, tmp_path: pathlib.Path
) -> AsyncIterator[Callable[..., Awaitable[WorkerProcess]]]:
    started: list[WorkerProcess] = []

    async def start(address: str, app: pathlib.Path = APP, **settings: str) -> WorkerProcess:
        trace = tmp_path / f"trace-{len(started)}.jsonl"
        env = {
            **os.environ,
            "ABADA_ENGINE_ADDRESS": address,
            "ABADA_TOKEN": engine_tokens.suite,
            "ABADA_WORKER_ID": f"sdk-test/{len(started)}",
            "SDK_WORKER_TRACE": str(trace),
            **settings,
        }
        env.pop("ABADA_TOKEN_FILE", None)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(app),
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        worker = WorkerProcess(process, trace)
        started.append(worker)
        await worker.wait_for_log("worker started")
        return worker

    yield start
    for worker in started:
        if worker.process.returncode is None:
            worker.process.kill()
            with contextlib.suppress(Exception):
                await worker.process.wait()


@pytest.fixture
async def sdk_client(engine, engine_tokens) -> AsyncIterator[AsyncEngineClient]:
    async with AsyncEngineClient(engine.address, token=engine_tokens.suite, timeout=10) as client:
        yield client
