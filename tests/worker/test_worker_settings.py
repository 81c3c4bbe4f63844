"""Settings from flags and environment, the rotating caller token, and logs that never show a secret."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
from abada_common.logs import JsonFormatter
from abada_sdk.connection import BearerToken
from abada_worker.broker_client import Secret
from abada_worker.logs import SERVICE, SecretRedactor
from abada_worker.settings import load_settings


def test_flags_win_over_the_environment_which_wins_over_defaults() -> None:
    env = {"ABADA_WORKER_CONCURRENCY": "7", "ABADA_DRAIN_SECONDS": "12", "ABADA_WORKER_ID": "w-env"}
    settings = load_settings(["--concurrency", "50"], env)

    assert settings.concurrency == 50
    assert settings.drain_seconds == 12.0
    assert settings.worker_id == "w-env"
    assert settings.engine_address == "127.0.0.1:50051"
    assert settings.broker_address == "127.0.0.1:50061"
    assert settings.topic == "abada:agent"
    assert settings.lease_ms == 30_000
    assert settings.health_address == "127.0.0.1:8081"


def test_the_worker_id_defaults_to_host_and_pid_and_secrets_come_from_the_environment_only() -> None:
    settings = load_settings([], {"ABADA_WORKER_TOKEN": "t0k", "GEMINI_API_KEY": "g-key"})

    assert settings.worker_id.endswith(f"-{os.getpid()}")
    assert (settings.token, settings.gemini_api_key) == ("t0k", "g-key")
    with pytest.raises(SystemExit):
        load_settings(["--token", "t0k"], {})


def test_the_test_only_fault_hook_is_parsed_and_a_malformed_one_refused() -> None:
    settings = load_settings([], {"ABADA_WORKER_FAULT": "kill-after-send:crm/create_ticket"})
    assert settings.fault.kill_after_send == ("crm", "create_ticket")
    assert load_settings([], {}).fault.kill_after_send is None
    with pytest.raises(SystemExit):
        load_settings([], {"ABADA_WORKER_FAULT": "explode"})


def test_the_token_file_is_read_again_when_it_changes_and_kept_while_it_is_briefly_gone(
    tmp_path: Path,
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("first\n")
    token = BearerToken(token_file=token_file)
    assert token.metadata() == (("authorization", "Bearer first"),)

    token_file.write_text("second-token\n")
    assert token.current() == "second-token"
    token_file.unlink()
    assert token.current() == "second-token"
    assert BearerToken().metadata() == ()


def test_a_held_secret_is_scrubbed_from_every_log_line_until_it_is_released() -> None:
    redactor = SecretRedactor()
    formatter = JsonFormatter(SERVICE, redact=redactor.redact)
    secret = Secret("s3cr3t-crm-token")
    redactor.hold(secret.reveal())
    redactor.hold(secret.reveal())  # a second task with the same credential

    record = logging.makeLogRecord(
        {
            "msg": "401 with Bearer %s",
            "args": ("s3cr3t-crm-token",),
            "levelno": logging.WARNING,
            "levelname": "WARNING",
        }
    )
    record.header = "Authorization: Bearer s3cr3t-crm-token"
    line = json.loads(formatter.format(record))

    assert line["message"] == "401 with Bearer [redacted]"
    assert line["header"] == "Authorization: Bearer [redacted]"
    assert line["level"] == "warning" and line["service"] == "agent-worker"
    assert "s3cr3t" not in repr(secret) and "s3cr3t" not in f"{secret}"
    redactor.release(secret.reveal())
    assert "[redacted]" in formatter.format(record), "still held by the other task"
    redactor.release(secret.reveal())
    assert "s3cr3t-crm-token" in formatter.format(record)


def test_the_broker_is_dialed_over_tls_only_with_its_ca_and_a_lone_client_certificate_is_refused() -> None:
    plain = load_settings([], {})
    assert plain.broker_tls_ca_file is None
    tls = load_settings([], {"ABADA_BROKER_TLS_CA_FILE": "/etc/ca.crt"})
    assert tls.broker_tls_ca_file == Path("/etc/ca.crt") and tls.broker_tls_cert_file is None
    with pytest.raises(SystemExit):
        load_settings([], {"ABADA_BROKER_TLS_CERT_FILE": "/c.pem", "ABADA_BROKER_TLS_KEY_FILE": "/c.key"})
    with pytest.raises(SystemExit):
        load_settings([], {"ABADA_BROKER_TLS_CA_FILE": "/ca", "ABADA_BROKER_TLS_CERT_FILE": "/c.pem"})


def test_provider_keys_come_from_the_environment_or_a_file_and_base_urls_from_flags_or_the_sdk_variables(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "anthropic.key"
    key_file.write_text("sk-ant-from-file\n")
    env = {
        "OPENAI_API_KEY": "sk-env",
        "OPENAI_BASE_URL": "http://sdk-variable:8000/v1",
        "ABADA_ANTHROPIC_API_KEY_FILE": str(key_file),
        "ANTHROPIC_API_KEY": "sk-ant-env",
        "ANTHROPIC_BASE_URL": "http://sdk-variable:9000",
        "ABADA_ANTHROPIC_BASE_URL": "http://abada-variable:9000",
    }
    settings = load_settings([], env)

    assert (settings.openai_api_key, settings.openai_base_url) == ("sk-env", "http://sdk-variable:8000/v1")
    # A mounted key file wins over the variable; Abada's own variable over the SDK's.
    assert (settings.anthropic_api_key, settings.anthropic_base_url) == (
        "sk-ant-from-file",
        "http://abada-variable:9000",
    )
    assert load_settings(["--openai-base-url", "http://flag/v1"], env).openai_base_url == "http://flag/v1"
    with pytest.raises(SystemExit):
        load_settings(["--openai-api-key-file", str(tmp_path / "missing")], {})
