"""Who may call the engine: every caller authenticated, every call authorized by role."""

from __future__ import annotations

import grpc
import pytest
from abada.engine.v1 import (
    definition_pb2,
    definition_pb2_grpc,
    external_task_pb2,
    external_task_pb2_grpc,
    lease_pb2,
    lease_pb2_grpc,
)
from abada_engine.api.guard import Guard
from abada_engine.api.server import ServerTls, start_grpc_server
from abada_engine.auth import CallerRegistry, token_sha256
from bearer import BearerToken
from certificates import make_pki
from engine_helpers import ONE_SERVICE_TASK, deploy, error_info, start
from grpc_health.v1 import health_pb2, health_pb2_grpc


def fetch_request(worker_id: str, topic: str = "abada:agent") -> external_task_pb2.FetchAndLockRequest:
    return external_task_pb2.FetchAndLockRequest(
        worker_id=worker_id,
        max_tasks=1,
        topics=[external_task_pb2.TopicSubscription(name=topic, lease_ms=5000)],
    )


async def refused(call, code: grpc.StatusCode, reason: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    assert caught.value.code() == code, caught.value.details()
    assert error_info(caught.value).reason == reason


@pytest.fixture
async def channel_as(engine):
    """A channel to the test engine that presents `token` (or nothing)."""
    opened = []

    def open_channel(token: str | None) -> grpc.aio.Channel:
        interceptors = [BearerToken(token)] if token else []
        channel = grpc.aio.insecure_channel(engine.address, interceptors=interceptors)
        opened.append(channel)
        return channel

    yield open_channel
    for channel in opened:
        await channel.close()


async def test_unauthenticated_and_unknown_callers_are_refused(engine, channel_as):
    for token, reason in ((None, "UNAUTHENTICATED"), ("made-up", "UNKNOWN_CREDENTIAL")):
        channel = channel_as(token)
        tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel)
        await refused(
            tasks.FetchAndLock(fetch_request("agent-pool")), grpc.StatusCode.UNAUTHENTICATED, reason
        )
        definitions = definition_pb2_grpc.DefinitionServiceStub(channel)
        await refused(
            definitions.ListDefinitions(definition_pb2.ListDefinitionsRequest()),
            grpc.StatusCode.UNAUTHENTICATED,
            reason,
        )


async def test_health_needs_no_credentials(engine, channel_as):
    health = health_pb2_grpc.HealthStub(channel_as(None))
    answer = await health.Check(health_pb2.HealthCheckRequest(service=""))
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_roles_decide_what_a_caller_may_call(engine, channel_as, engine_tokens):
    worker = channel_as(engine_tokens.worker_pool)
    await refused(
        definition_pb2_grpc.DefinitionServiceStub(worker).Deploy(
            definition_pb2.DeployRequest(source_name="x.yaml", content=ONE_SERVICE_TASK)
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_REQUIRED",
    )
    await refused(
        lease_pb2_grpc.LeaseServiceStub(worker).VerifyLease(
            lease_pb2.VerifyLeaseRequest(
                task_id="00000000-0000-0000-0000-000000000000", worker_id="agent-pool", server="crm"
            )
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_REQUIRED",
    )
    operator = channel_as(engine_tokens.operator)
    await refused(
        external_task_pb2_grpc.ExternalTaskServiceStub(operator).FetchAndLock(fetch_request("ops")),
        grpc.StatusCode.PERMISSION_DENIED,
        "ROLE_REQUIRED",
    )
    deployed = await definition_pb2_grpc.DefinitionServiceStub(operator).Deploy(
        definition_pb2.DeployRequest(source_name="x.yaml", content=ONE_SERVICE_TASK)
    )
    assert deployed.definitions[0].process_id == "job"
    broker = channel_as(engine_tokens.broker)
    await refused(
        lease_pb2_grpc.LeaseServiceStub(broker).VerifyLease(
            lease_pb2.VerifyLeaseRequest(
                task_id="00000000-0000-0000-0000-000000000000",
                worker_id="agent-pool",
                lease_token="x",
                server="crm",
            )
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "UNKNOWN_TASK",
    )  # authorized; the task simply does not exist


async def test_a_worker_gets_only_its_topics_and_acts_only_under_its_own_id(
    engine, channel_as, engine_tokens
):
    await deploy(engine, ONE_SERVICE_TASK)
    await start(engine, "job")
    tasks = external_task_pb2_grpc.ExternalTaskServiceStub(channel_as(engine_tokens.worker_pool))
    await refused(
        tasks.FetchAndLock(fetch_request("agent-pool/pod-1", topic="jobs")),
        grpc.StatusCode.PERMISSION_DENIED,
        "TOPIC_NOT_ALLOWED",
    )
    await refused(
        tasks.FetchAndLock(fetch_request("someone-else")),
        grpc.StatusCode.PERMISSION_DENIED,
        "WORKER_ID_MISMATCH",
    )
    await refused(
        tasks.FetchAndLock(fetch_request("agent-poolside")),
        grpc.StatusCode.PERMISSION_DENIED,
        "WORKER_ID_MISMATCH",
    )
    # `pool/` names no worker: the engine and the broker agree on identity or identity/<name>.
    await refused(
        tasks.FetchAndLock(fetch_request("agent-pool/")),
        grpc.StatusCode.PERMISSION_DENIED,
        "WORKER_ID_MISMATCH",
    )
    answered = await tasks.FetchAndLock(fetch_request("agent-pool/pod-1"))
    assert list(answered.tasks) == []
    # Another worker's lease cannot be touched under a borrowed worker id either.
    await refused(
        tasks.Complete(
            external_task_pb2.CompleteRequest(
                task_id="00000000-0000-0000-0000-000000000000", worker_id="w", lease_token="x"
            )
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "WORKER_ID_MISMATCH",
    )
    # Nor by a batch of completions, nor can a batch's eager dispatch reach a topic not granted.
    someone_elses = external_task_pb2.CompleteRequest(
        task_id="00000000-0000-0000-0000-000000000000", lease_token="x"
    )
    await refused(
        tasks.CompleteTasks(
            external_task_pb2.CompleteTasksRequest(worker_id="w", completions=[someone_elses])
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "WORKER_ID_MISMATCH",
    )
    await refused(
        tasks.CompleteTasks(
            external_task_pb2.CompleteTasksRequest(
                worker_id="agent-pool/pod-1",
                completions=[someone_elses],
                fetch_next=external_task_pb2.FetchNext(
                    topics=[external_task_pb2.TopicSubscription(name="jobs", lease_ms=5000)], max_tasks=1
                ),
            )
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "TOPIC_NOT_ALLOWED",
    )
    # Nor journaled to by a batch of steps.
    await refused(
        tasks.AppendSteps(
            external_task_pb2.AppendStepsRequest(
                worker_id="w",
                steps=[
                    external_task_pb2.AppendStepRequest(
                        task_id="00000000-0000-0000-0000-000000000000", lease_token="x", sequence=1
                    )
                ],
            )
        ),
        grpc.StatusCode.PERMISSION_DENIED,
        "WORKER_ID_MISMATCH",
    )


def test_the_callers_file_holds_no_token(engine_tokens):
    text = engine_tokens.callers_file.read_text()
    for token in (
        engine_tokens.suite,
        engine_tokens.operator,
        engine_tokens.broker,
        engine_tokens.worker_pool,
    ):
        assert token not in text


async def test_mtls_takes_the_identity_from_the_client_certificate(engine_core, tmp_path):
    pki = make_pki(tmp_path, client_cn="ops-cert")
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        "callers:\n  - {identity: ops-by-certificate, roles: [operator], certificate_cn: ops-cert}\n"
    )
    running = await start_grpc_server(
        engine_core,
        "127.0.0.1:0",
        Guard(CallerRegistry(callers)),
        ServerTls(pki.server_cert, pki.server_key, pki.ca_pem),
    )
    try:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki.ca_pem,
            private_key=pki.client_key.read_bytes(),
            certificate_chain=pki.client_cert.read_bytes(),
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{running.port}", credentials) as channel:
            listed = await definition_pb2_grpc.DefinitionServiceStub(channel).ListDefinitions(
                definition_pb2.ListDefinitionsRequest()
            )
            assert listed is not None
            await refused(
                external_task_pb2_grpc.ExternalTaskServiceStub(channel).FetchAndLock(
                    fetch_request("ops-by-certificate")
                ),
                grpc.StatusCode.PERMISSION_DENIED,
                "ROLE_REQUIRED",
            )
        without_certificate = grpc.ssl_channel_credentials(root_certificates=pki.ca_pem)
        async with grpc.aio.secure_channel(f"127.0.0.1:{running.port}", without_certificate) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await definition_pb2_grpc.DefinitionServiceStub(channel).ListDefinitions(
                    definition_pb2.ListDefinitionsRequest(), timeout=5
                )
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(0)


async def test_tls_without_a_client_ca_asks_for_no_certificate_and_takes_tokens(engine_core, tmp_path):
    pki = make_pki(tmp_path)
    callers = tmp_path / "callers.yaml"
    callers.write_text(
        "callers:\n  - {identity: ops-by-token, roles: [operator], token_sha256: "
        + token_sha256("ops-secret")
        + "}\n"
    )
    running = await start_grpc_server(
        engine_core,
        "127.0.0.1:0",
        Guard(CallerRegistry(callers)),
        ServerTls(pki.server_cert, pki.server_key, None),
    )
    try:
        server_only = grpc.ssl_channel_credentials(root_certificates=pki.ca_pem)
        async with grpc.aio.secure_channel(f"127.0.0.1:{running.port}", server_only) as channel:
            stub = definition_pb2_grpc.DefinitionServiceStub(channel)
            listed = await stub.ListDefinitions(
                definition_pb2.ListDefinitionsRequest(), metadata=(("authorization", "Bearer ops-secret"),)
            )
            assert listed is not None  # the token was taken over TLS without a client certificate
            await refused(
                stub.ListDefinitions(definition_pb2.ListDefinitionsRequest()),
                grpc.StatusCode.UNAUTHENTICATED,
                "UNAUTHENTICATED",
            )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as plaintext:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await definition_pb2_grpc.DefinitionServiceStub(plaintext).ListDefinitions(
                    definition_pb2.ListDefinitionsRequest(),
                    metadata=(("authorization", "Bearer ops-secret"),),
                    timeout=5,
                )
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await running.stop(0)
