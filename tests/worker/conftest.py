"""The worker end-to-end tests' collaborators, set up once here: the demo CRM, the scripted Gemini
endpoint, the real credential broker and a launcher of real worker processes, around the suite's engine.

Nothing one test does is seen by the next: every test gets the CRM emptied as if just started (no
ticket, idempotency key or recorded call; the standard contract), the scripted endpoint with its script
loaded afresh and its ledger empty, the engine's tables emptied (the `engine` fixture), and workers
that are all stopped when it ends. The processes themselves are started once (a CRM or a broker takes
seconds to start on a loaded machine), which is what keeps these tests quick.

A module changes what it needs by overriding a fixture:
- `crm_read_latency_ms`: the CRM's lookups take this long (to see calls overlap);
- `model_script`: the script loaded before each test (tests may load another);
- `model_settings`: how workers reach a model (default: the scripted Gemini endpoint);
- `worker_settings`: the module's own worker environment (its worker id, lease, concurrency).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from crm_mcp.testing import RunningCrmServer, running_crm_server
from scripted_gemini import SUPPORT_TRIAGE_SCRIPT
from scripted_gemini.testing import load_script, reset_calls, running_scripted_gemini
from worker_process import WorkerLauncher, worker_launcher
from worker_servers import RealBroker, running_real_broker

POOL = "agent-pool"


@pytest.fixture(scope="session")
def crm_token() -> str:
    """The CRM's token, which the session's broker hands out as the `crm-token` credential."""
    return secrets.token_urlsafe(24)


@pytest.fixture(scope="session")
def crm_server(crm_token: str) -> Iterator[RunningCrmServer]:
    with running_crm_server(enable_control=True, token=crm_token) as server:
        yield server


@pytest.fixture
def crm_read_latency_ms() -> int:
    return 0


@pytest.fixture
def crm(crm_server: RunningCrmServer, crm_read_latency_ms: int, deploy_credentials: Path) -> RunningCrmServer:
    """The CRM as if just started, for this test alone; the engine checks its contract at deploy time
    with the credential written here."""
    crm_server.reset(read_latency_ms=crm_read_latency_ms)
    deploy_credentials.write_text(json.dumps({"crm-token": crm_server.token}))
    return crm_server


@pytest.fixture(scope="module")
def gemini_server() -> Iterator[str]:
    with running_scripted_gemini() as url:
        yield url


@pytest.fixture
def model_script() -> Any:
    return SUPPORT_TRIAGE_SCRIPT


@pytest.fixture
def gemini_url(gemini_server: str, model_script: Any) -> str:
    """The scripted Gemini endpoint with the module's script loaded afresh and an empty ledger."""
    load_script(gemini_server, model_script)
    reset_calls(gemini_server)
    return gemini_server


@pytest.fixture(scope="session")
async def broker(  # type: ignore[no-untyped-def]
    crm_token: str, engine_channel, engine_tokens, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[RealBroker]:
    _, engine_address = engine_channel
    async with running_real_broker(
        tmp_path_factory.mktemp("worker-broker"),
        engine_address=engine_address,
        engine_token=engine_tokens.broker,
        worker_identity=POOL,
        worker_token=engine_tokens.worker_pool,
        secrets={"crm-token": crm_token},
    ) as running:
        yield running


@pytest.fixture
def model_settings(gemini_url: str) -> dict[str, str]:
    return {"ABADA_GEMINI_BASE_URL": gemini_url}


@pytest.fixture
def worker_settings() -> dict[str, str]:
    return {}


@pytest.fixture
async def workers(  # type: ignore[no-untyped-def]
    engine, broker: RealBroker, engine_tokens, model_settings: dict[str, str], worker_settings: dict[str, str]
) -> AsyncIterator[WorkerLauncher]:
    """Starts worker processes (`await workers.start(**more_env)`); every one is stopped at the end."""
    env = {
        "ABADA_ENGINE_ADDRESS": engine.address,
        "ABADA_BROKER_ADDRESS": broker.address,
        # The pool's token, as a deployment gives it: only abada:agent, only worker ids agent-pool/...
        "ABADA_WORKER_TOKEN": engine_tokens.worker_pool,
        "ABADA_WORKER_ID": f"{POOL}/e2e",
        "ABADA_WORKER_HEALTH_ADDRESS": "127.0.0.1:0",
        "ABADA_WORKER_POLL_WAIT_MS": "300",
        "ABADA_LEASE_MS": "2000",
        "ABADA_DRAIN_SECONDS": "5",
        "ABADA_WORKER_CONCURRENCY": "4",
        **model_settings,
        **worker_settings,
    }
    async with worker_launcher(env) as launcher:
        yield launcher
