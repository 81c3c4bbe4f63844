"""Running the `abada` CLI against the test engine without blocking the event loop the engine serves on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from abada.engine.v1 import external_task_pb2
from abada_engine.cli.app import app
from engine_helpers import fetch
from typer.testing import CliRunner

# Settings from the developer's shell must not leak into what a test asserts.
_CLEAN_ENV: dict[str, str | None] = {
    name: None
    for name in (
        "ABADA_ENGINE_ADDRESS",
        "ABADA_TOKEN",
        "ABADA_TOKEN_FILE",
        "ABADA_TLS_CA_FILE",
        "ABADA_TLS_CERT_FILE",
        "ABADA_TLS_KEY_FILE",
        "ABADA_TIMEOUT",
        # The output goes to a pipe, so tables are not fitted to a width; a COLUMNS from the test runner
        # (pytest-xdist's workers set 80) would narrow them.
        "COLUMNS",
    )
}


# The test engine authenticates every call; its address maps to the token the CLI should send
# when a test does not choose one itself (see tests/cli/conftest.py).
ENGINE_TOKENS: dict[str, str] = {}


@dataclass
class Ran:
    exit_code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)


async def abada(
    address: str, *args: str, options: Sequence[str] = ("--timeout", "10"), env: dict[str, str] | None = None
) -> Ran:
    """`abada --engine ADDRESS OPTIONS... ARGS...` in a worker thread; the sync gRPC client must not run on the loop."""
    runner = CliRunner()
    result = await asyncio.to_thread(
        runner.invoke,
        app,
        ["--engine", address, *options, *args],
        env={
            **_CLEAN_ENV,
            **({"ABADA_TOKEN": ENGINE_TOKENS[address]} if address in ENGINE_TOKENS else {}),
            **(env or {}),
        },
        prog_name="abada",
    )
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return Ran(result.exit_code, result.stdout, result.stderr)


async def fetch_one(
    engine: Any, topic: str, worker_id: str = "cli-test-worker"
) -> external_task_pb2.ExternalTask:
    tasks = await fetch(engine, worker_id, topic)
    assert len(tasks) == 1, f"expected one task on {topic}"
    return tasks[0]
