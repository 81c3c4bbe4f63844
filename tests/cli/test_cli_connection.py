"""Reaching the engine: address, bearer token, mTLS, deadline, and the one-line error when it is not there."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from abada.engine.v1 import definition_pb2, definition_pb2_grpc
from certificates import make_pki
from cli_support import abada


@dataclass
class RecordingDefinitions(definition_pb2_grpc.DefinitionServiceServicer):
    """Stands in for the engine where the test must see what the CLI put on the wire."""

    seen_metadata: list[dict[str, str]] = field(default_factory=list)

    async def ListDefinitions(self, request, context):
        self.seen_metadata.append(dict(context.invocation_metadata()))
        return definition_pb2.ListDefinitionsResponse(
            definitions=[definition_pb2.Definition(id="d-1", process_id="greet", version=1)]
        )

    async def GetDefinition(self, request, context):
        await asyncio.sleep(5)
        return definition_pb2.GetDefinitionResponse()

    async def Deploy(self, request, context):
        await asyncio.sleep(5)
        return definition_pb2.DeployResponse()


@dataclass
class FakeEngine:
    address: str
    servicer: RecordingDefinitions


async def serve(credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.aio.Server, FakeEngine]:
    server = grpc.aio.server()
    servicer = RecordingDefinitions()
    definition_pb2_grpc.add_DefinitionServiceServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    return server, FakeEngine(f"127.0.0.1:{port}", servicer)


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngine]:
    server, fake = await serve()
    yield fake
    await server.stop(0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_unreachable_engine_is_one_line_from_the_installed_module():
    address = f"127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
    env["ABADA_ENGINE_ADDRESS"] = address
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "abada_engine.cli.app",
        "instances",
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=30)
    assert process.returncode == 1
    assert stdout == b""
    assert stderr.decode().splitlines() == [f"error: cannot reach the engine at {address} (UNAVAILABLE)"]


async def test_token_is_sent_as_bearer_metadata(fake_engine):
    ran = await abada(fake_engine.address, "definitions", options=("--token", "s3cret"))
    assert ran.exit_code == 0, ran.stderr
    assert "greet" in ran.stdout
    assert fake_engine.servicer.seen_metadata[-1]["authorization"] == "Bearer s3cret"


async def test_no_token_sends_no_authorization(fake_engine):
    assert (await abada(fake_engine.address, "definitions")).exit_code == 0
    assert "authorization" not in fake_engine.servicer.seen_metadata[-1]


async def test_token_file_and_environment(fake_engine, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    ran = await abada(fake_engine.address, "definitions", env={"ABADA_TOKEN_FILE": str(token_file)})
    assert ran.exit_code == 0, ran.stderr
    assert fake_engine.servicer.seen_metadata[-1]["authorization"] == "Bearer from-file"

    ran = await abada(fake_engine.address, "definitions", env={"ABADA_TOKEN": "from-env"})
    assert ran.exit_code == 0, ran.stderr
    assert fake_engine.servicer.seen_metadata[-1]["authorization"] == "Bearer from-env"


async def test_a_token_file_flag_beats_a_token_left_in_the_environment(fake_engine, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-file")
    ran = await abada(
        fake_engine.address,
        "definitions",
        options=("--token-file", str(token_file)),
        env={"ABADA_TOKEN": "stale"},
    )
    assert ran.exit_code == 0, ran.stderr
    assert fake_engine.servicer.seen_metadata[-1]["authorization"] == "Bearer from-file"


async def test_token_problems_are_input_errors(fake_engine, tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("  \n")
    ran = await abada(fake_engine.address, "definitions", options=("--token-file", str(empty)))
    assert ran.exit_code == 2
    assert ran.stderr.strip() == f"error: the token file {empty} is empty"
    both = await abada(
        fake_engine.address, "definitions", options=("--token", "a", "--token-file", str(empty))
    )
    assert both.exit_code == 2
    assert "not both" in both.stderr
    assert fake_engine.servicer.seen_metadata == []


async def test_slow_engine_hits_the_timeout(fake_engine, tmp_path):
    bundle = tmp_path / "b.yaml"
    bundle.write_text("processes: []\n")
    ran = await abada(fake_engine.address, "deploy", str(bundle), options=("--timeout", "0.3"))
    assert ran.exit_code == 1
    assert ran.stderr.strip() == (
        f"error: the engine at {fake_engine.address} did not answer within 0.3s (DEADLINE_EXCEEDED)"
    )


async def test_mtls_presents_the_client_certificate(tmp_path):
    pki = make_pki(tmp_path)
    credentials = grpc.ssl_server_credentials(
        [(pki.server_key, pki.server_cert)], root_certificates=pki.ca_pem, require_client_auth=True
    )
    server, fake = await serve(credentials)
    try:
        with_cert = await abada(
            fake.address,
            "definitions",
            env={
                "ABADA_TLS_CA_FILE": str(pki.ca),
                "ABADA_TLS_CERT_FILE": str(pki.client_cert),
                "ABADA_TLS_KEY_FILE": str(pki.client_key),
                "ABADA_TOKEN": "s3cret",
            },
        )
        assert with_cert.exit_code == 0, with_cert.stderr
        assert "greet" in with_cert.stdout
        assert fake.servicer.seen_metadata[-1]["authorization"] == "Bearer s3cret"

        # The engine insists on a client certificate: without one the handshake fails.
        without_cert = await abada(fake.address, "definitions", options=("--tls-ca", str(pki.ca)))
        assert without_cert.exit_code == 1
        assert (
            without_cert.stderr.strip() == f"error: cannot reach the engine at {fake.address} (UNAVAILABLE)"
        )

        half = await abada(fake.address, "definitions", options=("--tls-cert", str(pki.client_cert)))
        assert half.exit_code == 2
        assert half.stderr.strip() == "error: mTLS needs both --tls-cert and --tls-key"
    finally:
        await server.stop(0)


async def test_the_real_engine_refuses_the_cli_without_a_token_and_names_why(engine, engine_tokens):
    ran = await abada(engine.address, "definitions", env={"ABADA_TOKEN": ""})
    assert ran.exit_code == 1
    assert "UNAUTHENTICATED" in ran.stderr
    as_operator = await abada(engine.address, "definitions", options=("--token", engine_tokens.operator))
    assert as_operator.exit_code == 0, as_operator.stderr
    as_worker = await abada(engine.address, "definitions", options=("--token", engine_tokens.worker_pool))
    assert as_worker.exit_code == 1
    assert "ROLE_REQUIRED" in as_worker.stderr
