"""Starting the broker: refusing to run unauthenticated, the dev tokens, insecure dev mode, a dead engine."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest
import yaml
from broker_support import (
    CRM_CREDENTIAL,
    broker_environment,
    bundle,
    error_info,
    leased_task,
    running_broker,
    write_atomically,
)


def _broker_command(*arguments: str, settings: dict[str, str] | None = None, stdin: str | None = None):
    return subprocess.run(
        [sys.executable, "-m", "abada_broker", *arguments],
        env=broker_environment({"ABADA_BROKER_GRPC_ADDRESS": "127.0.0.1:0", **(settings or {})}),
        input=stdin,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _error_lines(stderr: str) -> list[str]:
    return [entry["message"] for entry in map(json.loads, stderr.splitlines()) if entry["level"] == "error"]


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A loopback port that is bound but not listening: connecting to it is refused at once."""
    with socket.socket() as placeholder:
        placeholder.bind(("127.0.0.1", 0))
        yield placeholder.getsockname()[1]


def test_without_a_callers_file_or_insecure_dev_the_broker_refuses_to_start(tmp_path):
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text("crm-token: value\n")
    done = _broker_command(settings={"ABADA_SECRET_BACKEND": "file", "ABADA_SECRETS_FILE": str(secrets_file)})
    assert done.returncode == 2
    [message] = _error_lines(done.stderr)
    assert (
        "ABADA_BROKER_AUTH_TOKENS_FILE" in message and "--insecure-dev" in message and "dev-tokens" in message
    )


@pytest.mark.parametrize("address", ["0.0.0.0:50061", "[::]:50061", "192.0.2.10:50061", ":50061"])
def test_insecure_dev_mode_listens_on_loopback_only(tmp_path, address):
    """Review finding: --insecure-dev accepted every caller without a token on 0.0.0.0."""
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text("crm-token: value\n")
    done = _broker_command(
        "--insecure-dev",
        "--address",
        address,
        settings={"ABADA_SECRET_BACKEND": "file", "ABADA_SECRETS_FILE": str(secrets_file)},
    )
    assert done.returncode == 2
    [message] = _error_lines(done.stderr)
    assert "loopback only" in message and address in message


@pytest.mark.parametrize(
    ("callers", "named"),
    [
        (
            {"callers": [{"identity": "pool", "roles": ["admin"], "token_sha256": "ab" * 32}]},
            "callers[0].roles",
        ),
        (
            {"callers": [{"identity": "pool", "roles": ["worker"], "token_sha256": "plaintext"}]},
            "token_sha256",
        ),
        ({"workers": []}, "'callers'"),
    ],
)
def test_a_malformed_callers_file_stops_the_start_with_the_entry_at_fault(tmp_path, callers, named):
    callers_file = tmp_path / "callers.yaml"
    callers_file.write_text(yaml.safe_dump(callers))
    done = _broker_command("--auth-tokens-file", str(callers_file), "--secret-backend", "file")
    assert done.returncode == 2
    [message] = _error_lines(done.stderr)
    assert named in message and str(callers_file) in message


def test_dev_tokens_writes_private_token_files_and_a_callers_file_of_digests(tmp_path):
    out = tmp_path / "auth"
    done = _broker_command("dev-tokens", "--out", str(out))
    assert done.returncode == 0, done.stderr
    worker_token = (out / "worker-token").read_text().strip()
    engine_token = (out / "engine-token").read_text().strip()
    for name in ("broker-callers.yaml", "worker-token", "engine-token"):
        assert os.stat(out / name).st_mode & 0o777 == 0o600
        assert str(out / name) in done.stdout
    callers = yaml.safe_load((out / "broker-callers.yaml").read_text())["callers"]
    assert [(c["identity"], c["roles"]) for c in callers] == [
        ("agent-pool", ["worker"]),
        ("abada-engine", ["engine"]),
    ]
    assert [c["token_sha256"] for c in callers] == [
        hashlib.sha256(worker_token.encode()).hexdigest(),
        hashlib.sha256(engine_token.encode()).hexdigest(),
    ]
    assert worker_token not in (out / "broker-callers.yaml").read_text()

    again = _broker_command("dev-tokens", "--out", str(out))
    assert again.returncode == 2 and "--force" in again.stderr
    assert (out / "worker-token").read_text().strip() == worker_token  # running processes keep working
    forced = _broker_command("dev-tokens", "--out", str(out), "--force")
    assert forced.returncode == 0
    assert (out / "worker-token").read_text().strip() != worker_token


def test_hash_token_prints_the_digest_the_callers_file_wants():
    done = _broker_command("hash-token", stdin="my-pool-token\n")
    assert done.returncode == 0
    assert done.stdout.strip() == hashlib.sha256(b"my-pool-token").hexdigest()


async def test_insecure_dev_mode_warns_loudly_and_still_checks_the_lease(
    engine, engine_tokens, crm, deploy_credentials, tmp_path
):
    deploy_credentials.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))
    engine_token_file = tmp_path / "engine-token"
    engine_token_file.write_text(engine_tokens.broker + "\n")
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text(yaml.safe_dump({CRM_CREDENTIAL: crm.token}))
    settings = {
        "ABADA_ENGINE_ADDRESS": engine.address,
        "ABADA_SECRET_BACKEND": "file",
        "ABADA_SECRETS_FILE": str(secrets_file),
    }
    arguments = ["--insecure-dev", "--engine-token-file", str(engine_token_file)]
    async with running_broker(tmp_path / "broker", settings, arguments=arguments) as broker:
        task = await leased_task(engine, bundle(crm.url), worker_id="laptop")
        issued = await broker.tool_credential(None, task.id, "laptop", task.lease_token)
        assert (issued.secret, issued.version) == (crm.token, 1)
        # The offline file backend rotates too: a rewritten file is read by the next request.
        write_atomically(secrets_file, yaml.safe_dump({CRM_CREDENTIAL: "rotated-demo-token"}))
        rotated = await broker.tool_credential(None, task.id, "laptop", task.lease_token)
        assert (rotated.secret, rotated.version) == ("rotated-demo-token", 2)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await broker.tool_credential(None, task.id, "someone-else", task.lease_token)
        assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
    warnings = [line["message"] for line in broker.log_lines() if line["level"] == "warning"]
    assert any(message.startswith("INSECURE DEVELOPMENT MODE") for message in warnings)


async def test_an_unreachable_engine_is_a_retryable_unavailable(closed_port, tmp_path):
    auth = tmp_path / "auth"
    assert _broker_command("dev-tokens", "--out", str(auth)).returncode == 0
    secrets_file = tmp_path / "secrets.yaml"
    secrets_file.write_text(yaml.safe_dump({CRM_CREDENTIAL: "never-handed-out"}))
    settings = {
        "ABADA_ENGINE_ADDRESS": f"127.0.0.1:{closed_port}",
        "ABADA_ENGINE_TOKEN_FILE": str(auth / "engine-token"),
        "ABADA_BROKER_AUTH_TOKENS_FILE": str(auth / "broker-callers.yaml"),
        "ABADA_SECRET_BACKEND": "file",
        "ABADA_SECRETS_FILE": str(secrets_file),
    }
    token = (auth / "worker-token").read_text().strip()
    async with running_broker(tmp_path / "broker", settings) as broker:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await broker.tool_credential(
                token, "7d6f8b36-6f63-4a38-9d0e-6a8f4c1c9b1e", "agent-pool/pod-a", "lease-token"
            )
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_info(caught.value).reason == "ENGINE_UNAVAILABLE"
    assert "never-handed-out" not in broker.log_text()
    [event] = broker.audit_events()
    assert (event["event"], event["outcome"], event["reason"]) == (
        "credential.refused",
        "unavailable",
        "ENGINE_UNAVAILABLE",
    )
