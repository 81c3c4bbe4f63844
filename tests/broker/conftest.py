"""Fixtures for the broker tests: a fake Vault, the demo CRM, dev tokens and a broker subprocess.

The broker runs as a subprocess pointed at the real engine of ``tests/conftest.py`` (on the test loop)
and at a :class:`FakeVault` holding the CRM's token as ``crm-token``.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for helper_dir in (HERE.parent / "vault", HERE.parent / "engine"):
    if str(helper_dir) not in sys.path:
        sys.path.insert(0, str(helper_dir))

from broker_support import BROKER_POLICY, CRM_SECRET_PATH, BrokerProcess, running_broker  # noqa: E402
from crm_mcp.testing import RunningCrmServer  # noqa: E402
from fake_vault import FakeVault  # noqa: E402


@dataclass(frozen=True)
class DevTokenFiles:
    directory: Path
    callers_file: Path
    worker_token: str
    engine_token: str
    printed: str


@pytest.fixture(scope="module")
def vault(crm: RunningCrmServer) -> Iterator[FakeVault]:
    with FakeVault() as server:
        server.add_policy("abada-broker", BROKER_POLICY)
        server.put_secret(CRM_SECRET_PATH, {"value": crm.token})
        yield server


@pytest.fixture(scope="module")
def dev_tokens(tmp_path_factory: pytest.TempPathFactory) -> DevTokenFiles:
    """Written by the real `abada-broker dev-tokens` command, as the offline demo does."""
    directory = tmp_path_factory.mktemp("broker-auth") / "auth"
    done = subprocess.run(
        [sys.executable, "-m", "abada_broker", "dev-tokens", "--out", str(directory)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return DevTokenFiles(
        directory=directory,
        callers_file=directory / "broker-callers.yaml",
        worker_token=(directory / "worker-token").read_text().strip(),
        engine_token=(directory / "engine-token").read_text().strip(),
        printed=done.stdout,
    )


@pytest.fixture(scope="module")
async def broker(
    engine_channel: tuple[object, str],
    vault: FakeVault,
    dev_tokens: DevTokenFiles,
    engine_tokens: object,
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[BrokerProcess]:
    _, engine_address = engine_channel
    settings = {
        "ABADA_ENGINE_ADDRESS": engine_address,
        "ABADA_ENGINE_TOKEN": engine_tokens.broker,
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(dev_tokens.callers_file),
        "ABADA_SECRET_BACKEND": "vault",
        "VAULT_ADDR": vault.url,
        "VAULT_TOKEN": vault.create_token(ttl=3600, policies=["abada-broker"]),
        "ABADA_VAULT_TIMEOUT_SECONDS": "1",
        "ABADA_BROKER_HEALTH_INTERVAL_SECONDS": "0.2",
        "ABADA_BROKER_METRICS_ADDRESS": f"127.0.0.1:{_free_port()}",
        "ABADA_BROKER_HTTP_ADDRESS": "127.0.0.1:0",
    }
    async with running_broker(tmp_path_factory.mktemp("broker"), settings) as process:
        process.metrics_url = f"http://{settings['ABADA_BROKER_METRICS_ADDRESS']}/metrics"
        yield process


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
