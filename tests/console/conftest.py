"""The console's browser tests: a real Chromium (Debian's, driven by Playwright) against the console
served on a real HTTP port, calling the suite's engine over gRPC, with the worker end-to-end tests'
collaborators (the demo CRM, the scripted Gemini endpoint, the broker, real worker processes).

Playwright never downloads a browser here: it drives /usr/bin/chromium, which this set-up installs
with apt-get when it is missing (as CI runs as root), and fails, rather than skips, when it cannot.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest
from abada_engine.api.http import HttpServer, build_app
from abada_engine.auth import CallerRegistry
from abada_engine.console import Engine, build_console
from abada_engine.runtime.queue_stats import QueueStats
from abada_sdk.connection import Connection

CHROMIUM = pathlib.Path("/usr/bin/chromium")
ROOT = pathlib.Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / ".abada" / "console-screenshots"
CONSOLE_SECRET = b"console-test-secret-that-is-long-enough-32"

# The worker tests' fixtures (crm, gemini_url, broker, workers, ...), loaded from their conftest.
_WORKER_TESTS = ROOT / "tests" / "worker"
sys.path.insert(0, str(_WORKER_TESTS))
_spec = importlib.util.spec_from_file_location("worker_test_fixtures", _WORKER_TESTS / "conftest.py")
assert _spec is not None and _spec.loader is not None
_worker_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_worker_fixtures)
crm_token = _worker_fixtures.crm_token
crm_server = _worker_fixtures.crm_server
crm_read_latency_ms = _worker_fixtures.crm_read_latency_ms
crm = _worker_fixtures.crm
gemini_server = _worker_fixtures.gemini_server
model_script = _worker_fixtures.model_script
gemini_url = _worker_fixtures.gemini_url
broker = _worker_fixtures.broker
model_settings = _worker_fixtures.model_settings
worker_settings = _worker_fixtures.worker_settings
workers = _worker_fixtures.workers


def _install_chromium() -> None:
    if CHROMIUM.exists():
        return
    apt = shutil.which("apt-get")
    if apt is None or os.geteuid() != 0:
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install chromium) as root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in ([apt, "update", "-qq"], [apt, "install", "-y", "-qq", "chromium"]):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.fail(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[object]:
    _install_chromium()
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        yield launched
        await launched.close()


@pytest.fixture(scope="session")
async def console_url(engine_channel, engine_tokens, db) -> AsyncIterator[str]:  # type: ignore[no-untyped-def]
    """The engine's HTTP app with the console mounted, on a free loopback port."""
    _, address = engine_channel
    engine = Engine(Connection(address=address))
    app = build_app(
        QueueStats(db),
        CallerRegistry(engine_tokens.callers_file),
        console=build_console(engine, CONSOLE_SECRET),
    )
    server = HttpServer(app, "127.0.0.1:0")
    await server.start()
    yield f"http://127.0.0.1:{server.port}/console"
    await server.stop()
    await engine.close()


@pytest.fixture(scope="session")
def screenshots() -> pathlib.Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    return SCREENSHOTS
