"""Each service's settings are declared once (abada_common.settings): typed, described, listed by --help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from abada_broker.config import BrokerSettings
from abada_broker.secret_store import SecretBackendSettings, VaultSettings
from abada_common.settings import SettingsError
from abada_engine.config import EngineSettings
from abada_worker.settings import WorkerSettings

SERVICES = Path(__file__).resolve().parents[2] / "services"
# dev_tokens.py names the other programs' variables in what it prints; the engine's cli/ is the
# separate `abada` program, and devstack/ (`abada dev`) sets every service's variables for the
# processes it starts.
READ_ELSEWHERE = {"dev_tokens.py", "main.py", "config.py"}


@pytest.mark.parametrize(
    ("model", "package", "skip"),
    [
        (EngineSettings, "engine/src/abada_engine", {"cli", "devstack"}),
        (WorkerSettings, "agent-worker/src/abada_worker", set()),
        (BrokerSettings, "credential-broker/src/abada_broker", READ_ELSEWHERE),
    ],
    ids=["engine", "worker", "broker"],
)
def test_every_variable_a_service_names_is_declared_with_a_description(model, package, skip):
    declared = model.variables()
    if model is BrokerSettings:  # the broker's secret store declares its own
        declared |= SecretBackendSettings.variables() | VaultSettings.variables()
    named = {
        name
        for source in (SERVICES / package).rglob("*.py")
        if not ({source.name, *source.relative_to(SERVICES / package).parts} & skip)
        for name in re.findall(r"ABADA_[A-Z0-9_]*[A-Z0-9]\b(?!_)", source.read_text())
        if not name.endswith("_TLS")  # f"ABADA_BROKER_TLS_{part}_FILE": each part is declared
    }
    assert named <= set(declared), named - set(declared)
    assert all(info.description for info in declared.values())


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["abada_engine.main", "--help"],
            ["ABADA_DB_POOL_SIZE (a whole number from 1 to 1000; default: 20)"],
        ),
        (["abada_worker.main", "--help"], ["ABADA_LEASE_MS", "ABADA_OPENAI_BASE_URL (or OPENAI_BASE_URL)"]),
        (
            ["abada_broker", "serve", "--help"],
            ["ABADA_CREDENTIAL_MAX_TTL_SECONDS", "ABADA_SECRET_BACKEND", "ABADA_VAULT_K8S_ROLE"],
        ),
    ],
    ids=["engine", "worker", "broker"],
)
def test_help_lists_the_variables(argv, expected):
    shown = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, check=True, timeout=60
    )
    for text in expected:
        assert text in shown.stdout


def test_a_bad_value_is_one_line_naming_the_variable_and_what_was_written():
    with pytest.raises(SettingsError) as bad_level:
        EngineSettings.from_env({"ABADA_LOG_LEVEL": "verbose"})
    assert str(bad_level.value) == (
        "ABADA_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, not 'verbose'"
    )
    with pytest.raises(SettingsError, match=r"^ABADA_CREDENTIAL_MAX_TTL_SECONDS must be a positive number"):
        BrokerSettings.from_env({"ABADA_BROKER_INSECURE_DEV": "1", "ABADA_CREDENTIAL_MAX_TTL_SECONDS": "0"})


def test_blank_variables_count_as_unset_and_flags_win_over_the_environment():
    env = {"ABADA_DB_POOL_SIZE": "  ", "ABADA_GRPC_ADDRESS": "127.0.0.1:1"}
    settings = EngineSettings.from_env(env, grpc_address="127.0.0.1:2")
    assert (settings.db_pool_size, settings.grpc_address) == (20, "127.0.0.1:2")
