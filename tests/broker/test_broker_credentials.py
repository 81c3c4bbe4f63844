"""GetToolCredential and GetDeployCredential through a real broker process, the real engine and a Vault.

The broker learns from the engine whether a lease is live and which servers it binds; only then does it
read Vault. These tests take real leases from the engine and check what a worker, a stranger and the
engine itself get.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import urllib.request
import uuid

import grpc
import pytest
import yaml
from abada.engine.v1 import external_task_pb2
from broker_support import (
    CRM_CREDENTIAL,
    CRM_SECRET_PATH,
    POOL,
    WORKER,
    bundle,
    error_info,
    extra_server,
    leased_task,
    secret_paths,
    write_atomically,
)
from engine_helpers import complete, fetch, until_lease_ran_out
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(autouse=True)
def deployable(deploy_credentials, crm) -> None:
    """The engine checks every tool server live at deploy time, with these credentials; all point at the
    demo CRM, which accepts only its own token."""
    deploy_credentials.write_text(
        yaml.safe_dump({name: crm.token for name in (CRM_CREDENTIAL, "billing-token", "ledger-token")})
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _status_of(request: urllib.request.Request) -> int:
    with urllib.request.urlopen(request, timeout=5) as response:
        return int(response.status)


async def _refused(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


async def _audited(broker, condition, timeout: float = 20.0) -> list[dict]:  # type: ignore[no-untyped-def]
    """The broker's audit events once `condition(events)` holds: its log lines are written after the
    answers, so they are polled for (bounded), never waited for with a guessed sleep."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        events = broker.audit_events()
        if condition(events):
            return events
        assert asyncio.get_running_loop().time() < deadline, f"audit not written in {timeout}s: {events[-5:]}"
        await asyncio.sleep(0.05)


def _vault_reads(vault, credential: str = CRM_CREDENTIAL) -> int:
    """Requests Vault answered about ``credential``; the health checks touch other paths."""
    paths = secret_paths(credential)
    return sum(1 for request in vault.requests if request.path in paths)


async def test_the_lease_holder_gets_the_current_secret_its_version_and_an_expiry_within_the_lease(
    engine, broker, vault, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    issued = await broker.for_task(dev_tokens.worker_token, task)

    assert issued.secret == crm.token
    assert issued.credential == CRM_CREDENTIAL
    assert issued.version == vault.current_version(CRM_SECRET_PATH)
    lease_expires_at = task.lease_expires_at.ToDatetime(tzinfo=dt.UTC)
    expire_time = issued.expire_time.ToDatetime(tzinfo=dt.UTC)
    assert _now() < expire_time <= lease_expires_at
    # What the worker got really opens the CRM.
    request = urllib.request.Request(
        crm.base_url + "/tickets", headers={"Authorization": f"Bearer {issued.secret}"}
    )
    assert await asyncio.to_thread(_status_of, request) == 200


async def test_a_long_lease_still_gets_a_credential_that_expires_within_the_maximum_ttl(
    engine, broker, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url), lease_ms=3_600_000)
    asked_at = _now()
    issued = await broker.for_task(dev_tokens.worker_token, task)
    expire_time = issued.expire_time.ToDatetime(tzinfo=dt.UTC)
    assert expire_time < task.lease_expires_at.ToDatetime(tzinfo=dt.UTC)
    assert asked_at + dt.timedelta(seconds=295) < expire_time <= _now() + dt.timedelta(seconds=300)


async def test_another_worker_of_the_same_pool_and_a_wrong_lease_token_are_not_the_lease_holder(
    engine, broker, vault, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    reads_before = _vault_reads(vault)
    for worker_id, lease_token in ((f"{POOL}/pod-b", task.lease_token), (WORKER, "not-the-lease-token")):
        error = await _refused(
            broker.tool_credential(dev_tokens.worker_token, task.id, worker_id, lease_token)
        )
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(error).reason == "NOT_LEASE_HOLDER"
        assert crm.token not in (error.details() or "")
    assert _vault_reads(vault) == reads_before  # refused before any secret was read


async def test_an_expired_lease_is_refused(engine, broker, vault, crm, dev_tokens):
    task = await leased_task(engine, bundle(crm.url), lease_ms=1000)
    await until_lease_ran_out(task)
    reads_before = _vault_reads(vault)
    error = await _refused(broker.for_task(dev_tokens.worker_token, task))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(error).reason == "LEASE_EXPIRED"
    assert _vault_reads(vault) == reads_before


async def test_a_server_the_task_does_not_bind_is_refused_whether_or_not_its_secret_exists(
    engine, broker, vault, crm, dev_tokens
):
    vault.put_secret("abada/tool-credentials/billing-token", {"value": "billing-secret-value"})
    content = bundle(crm.url, extra_servers=extra_server("billing", crm.url, "billing-token"))
    task = await leased_task(engine, content)  # the node binds crm only
    answers = []
    for server in ("billing", "no-such-server"):
        error = await _refused(broker.for_task(dev_tokens.worker_token, task, server=server))
        answers.append((error.code(), error_info(error).reason, error.details()))
    assert answers[0][:2] == answers[1][:2] == (grpc.StatusCode.PERMISSION_DENIED, "SERVER_NOT_BOUND")
    assert answers[0][2] == answers[1][2]  # the same words: nothing tells that billing has a secret
    assert _vault_reads(vault, "billing-token") == 0
    assert (await broker.for_task(dev_tokens.worker_token, task, server="crm")).secret == crm.token


async def test_an_unknown_task_is_refused(broker, dev_tokens):
    error = await _refused(
        broker.tool_credential(dev_tokens.worker_token, str(uuid.uuid4()), WORKER, "some-lease-token")
    )
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(error).reason == "UNKNOWN_TASK"


async def test_a_pool_token_only_covers_its_own_worker_ids(engine, broker, vault, crm, dev_tokens):
    # The engine leased the task to a worker id outside the pool; the pool's token must not speak for it.
    outsider = "other-pool/pod-a"
    task = await leased_task(engine, bundle(crm.url), worker_id=outsider)
    reads_before = _vault_reads(vault)
    for worker_id in (outsider, f"{POOL}x/pod-a", f"{POOL}/"):
        error = await _refused(broker.for_task(dev_tokens.worker_token, task, worker_id=worker_id))
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED
        assert error_info(error).reason == "WORKER_ID_MISMATCH"
    assert _vault_reads(vault) == reads_before


async def test_callers_without_a_known_token_or_the_worker_role_are_refused(engine, broker, crm, dev_tokens):
    task = await leased_task(engine, bundle(crm.url))
    for token in (None, "not-a-known-token", dev_tokens.worker_token + "x"):
        error = await _refused(broker.for_task(token, task))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    error = await _refused(broker.for_task(dev_tokens.engine_token, task))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert (error_info(error).reason, error_info(error).metadata["role"]) == ("MISSING_ROLE", "worker")


# Parameters are the same in every collection (parallel runs compare them): a fixed, well-formed id.
SOME_TASK = "0193a3c4-0000-7000-8000-000000000001"


@pytest.mark.parametrize(
    ("task_id", "worker_id", "lease_token", "server", "field"),
    [
        ("", WORKER, "token", "crm", "task_id"),
        ("not-a-uuid", WORKER, "token", "crm", "task_id"),
        (SOME_TASK, WORKER, "token", "", "server"),
        (SOME_TASK, "", "token", "crm", "worker_id"),
        (SOME_TASK, WORKER, "", "crm", "lease_token"),
    ],
    ids=["no task_id", "task_id not an id", "no server", "no worker_id", "no lease_token"],
)
async def test_malformed_requests_are_invalid_arguments_naming_the_field(
    broker, dev_tokens, task_id, worker_id, lease_token, server, field
):
    error = await _refused(
        broker.tool_credential(dev_tokens.worker_token, task_id, worker_id, lease_token, server)
    )
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    info = error_info(error)
    assert (info.reason, info.metadata["field"]) == ("INVALID_ARGUMENT", field)


async def test_a_bound_credential_missing_from_vault_is_a_failed_precondition(
    engine, broker, crm, dev_tokens
):
    content = bundle(
        crm.url, bind="ledger/get_customer", extra_servers=extra_server("ledger", crm.url, "ledger-token")
    )
    task = await leased_task(engine, content)
    error = await _refused(broker.for_task(dev_tokens.worker_token, task, server="ledger"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(error).reason == "CREDENTIAL_NOT_FOUND"


async def test_a_new_version_written_to_vault_reaches_the_next_request_without_a_restart(
    engine, broker, vault, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    before = await broker.for_task(dev_tokens.worker_token, task)
    rotated = f"rotated-crm-token-{uuid.uuid4().hex}"
    version = vault.put_secret(CRM_SECRET_PATH, {"value": rotated})
    try:
        after = await broker.for_task(dev_tokens.worker_token, task)
        assert (after.secret, after.version) == (rotated, version)
        assert after.version == before.version + 1
        assert broker.process.poll() is None  # the same process throughout
    finally:
        vault.put_secret(CRM_SECRET_PATH, {"value": crm.token})


async def test_vault_unreachable_is_unavailable_without_details_and_recovers(
    engine, broker, vault, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    with vault.unreachable():
        error = await _refused(broker.for_task(dev_tokens.worker_token, task))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error_info(error).reason == "SECRET_STORE_UNAVAILABLE"
        assert str(vault.port) not in (error.details() or "")
        await broker.wait_for_health(NOT_SERVING)
        assert await broker.health("liveness") == SERVING
    await broker.wait_for_health(SERVING)
    assert (await broker.for_task(dev_tokens.worker_token, task)).secret == crm.token


async def test_the_engine_role_gets_deploy_credentials_and_workers_do_not(broker, vault, crm, dev_tokens):
    issued = await broker.deploy_credential(dev_tokens.engine_token)
    assert (issued.secret, issued.version) == (crm.token, vault.current_version(CRM_SECRET_PATH))

    error = await _refused(broker.deploy_credential(dev_tokens.worker_token))
    assert error.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_info(error).reason == "MISSING_ROLE"
    error = await _refused(broker.deploy_credential(None))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    error = await _refused(broker.deploy_credential(dev_tokens.engine_token, credential="never-stored"))
    assert (error.code(), error_info(error).reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "CREDENTIAL_NOT_FOUND",
    )


async def test_every_issue_and_refusal_is_audited_and_no_line_holds_a_secret_or_a_token(
    engine, broker, vault, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    deploys_before = len([e for e in broker.audit_events() if e["purpose"] == "deploy"])
    rotated = f"audit-rotated-{uuid.uuid4().hex}"
    issued = await broker.for_task(dev_tokens.worker_token, task)
    await _refused(broker.for_task(dev_tokens.worker_token, task, worker_id=f"{POOL}/pod-b"))
    await _refused(broker.tool_credential(dev_tokens.worker_token, task.id, WORKER, "forged-lease-token-123"))
    await _refused(broker.for_task("wrong-bearer-token-456", task))
    vault.put_secret(CRM_SECRET_PATH, {"value": rotated})
    try:
        rotated_issue = await broker.for_task(dev_tokens.worker_token, task)
        await broker.deploy_credential(dev_tokens.engine_token)
        await _refused(broker.deploy_credential(dev_tokens.worker_token))
    finally:
        vault.put_secret(CRM_SECRET_PATH, {"value": crm.token})
    written = await _audited(
        broker,
        lambda events: (
            len([e for e in events if e.get("task_id") == task.id]) >= 5
            and len([e for e in events if e["purpose"] == "deploy"]) >= deploys_before + 2
        ),
    )

    events = [event for event in written if event.get("task_id") == task.id]
    summary = [
        (e["event"], e["worker_id"], e["caller"], e["outcome"], e["reason"], e["version"]) for e in events
    ]
    assert summary == [
        ("credential.issued", WORKER, POOL, "issued", None, issued.version),
        ("credential.refused", f"{POOL}/pod-b", POOL, "permission_denied", "NOT_LEASE_HOLDER", None),
        ("credential.refused", WORKER, POOL, "permission_denied", "NOT_LEASE_HOLDER", None),
        ("credential.refused", WORKER, None, "unauthenticated", "UNAUTHENTICATED", None),
        ("credential.issued", WORKER, POOL, "issued", None, rotated_issue.version),
    ]
    first = events[0]
    assert (first["purpose"], first["server"], first["credential"], first["attempt"]) == (
        "task",
        "crm",
        CRM_CREDENTIAL,
        1,
    )
    assert first["expire_time"] == issued.expire_time.ToDatetime(tzinfo=dt.UTC).isoformat(
        timespec="milliseconds"
    )
    deploys = [e for e in broker.audit_events() if e["purpose"] == "deploy"][-2:]
    assert [(e["event"], e["caller"], e["reason"]) for e in deploys] == [
        ("credential.issued", "abada-engine", None),
        ("credential.refused", "agent-pool", "MISSING_ROLE"),
    ]

    log = broker.log_text()
    for never_logged in (
        crm.token,
        rotated,
        "billing-secret-value",
        task.lease_token,
        "forged-lease-token-123",
        dev_tokens.worker_token,
        dev_tokens.engine_token,
        "wrong-bearer-token-456",
    ):
        assert never_logged not in log
    assert all({"time", "level", "service", "logger", "message"} <= set(line) for line in broker.log_lines())


async def test_the_callers_file_is_re_read_when_it_changes(engine, broker, crm, dev_tokens):
    task = await leased_task(engine, bundle(crm.url), worker_id="night-shift/pod-1")
    original = dev_tokens.callers_file.read_text()
    document = yaml.safe_load(original)
    new_token = f"night-shift-token-{uuid.uuid4().hex}"
    document["callers"].append(
        {
            "identity": "night-shift",
            "roles": ["worker"],
            "token_sha256": hashlib.sha256(new_token.encode()).hexdigest(),
        }
    )
    refused = await _refused(broker.for_task(new_token, task, worker_id="night-shift/pod-1"))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED
    try:
        write_atomically(dev_tokens.callers_file, yaml.safe_dump(document))
        issued = await broker.for_task(new_token, task, worker_id="night-shift/pod-1")
        assert issued.secret == crm.token
        # A broken edit is ignored: the callers read before stay in force.
        write_atomically(dev_tokens.callers_file, "callers: [ {identity: oops")
        assert (await broker.for_task(new_token, task, worker_id="night-shift/pod-1")).secret == crm.token
    finally:
        write_atomically(dev_tokens.callers_file, original)
    refused = await _refused(broker.for_task(new_token, task, worker_id="night-shift/pod-1"))
    assert refused.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_reflection_describes_the_credential_service_and_health(broker):
    stub = reflection_pb2_grpc.ServerReflectionStub(broker.channel)
    call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for response in call:
        names = {service.name for service in response.list_services_response.service}
        break
    assert {"abada.broker.v1.CredentialService", "grpc.health.v1.Health"} <= names


async def test_the_engine_reads_deploy_credentials_through_the_broker(broker, vault, crm, dev_tokens):
    """The engine's own credential source for deploy-time contract checks, against the real broker."""
    from abada_engine.definitions.tool_contracts import BrokerCredentials
    from abada_engine.errors import EngineError

    engine_side = BrokerCredentials(broker.address, dev_tokens.directory / "engine-token")
    assert await engine_side.secret("crm-token", "crm", crm.url, "ops") == crm.token
    as_a_worker = BrokerCredentials(broker.address, dev_tokens.directory / "worker-token")
    with pytest.raises(EngineError) as refused:
        await as_a_worker.secret("crm-token", "crm", crm.url, "ops")
    assert refused.value.reason_name == "CREDENTIAL_UNAVAILABLE"
    assert crm.token not in str(refused.value)


async def _finished_in_three_ways(engine, crm):
    """(label, task as its old holder knew it, the way it finished) for a completed, an incident-held
    and a re-leased task."""
    completed = await leased_task(engine, bundle(crm.url))
    await complete(engine, completed, WORKER, {"triage": {"priority": "high"}})

    held = await leased_task(engine, bundle(crm.url))
    await engine.tasks.Fail(
        external_task_pb2.FailRequest(
            task_id=held.id, worker_id=WORKER, lease_token=held.lease_token, no_retry=True, error_message="x"
        )
    )

    released = await leased_task(engine, bundle(crm.url), lease_ms=1_000)
    deadline = asyncio.get_running_loop().time() + 15
    taken: list = []
    while not taken and asyncio.get_running_loop().time() < deadline:
        taken = await fetch(engine, f"{POOL}/pod-b", "abada:agent", wait_ms=500)
    assert [t.id for t in taken] == [released.id]
    return [("completed", completed), ("incident-held", held), ("re-leased", released)]


async def test_finished_held_and_re_leased_tasks_get_no_credential_and_vault_is_not_read(
    engine, broker, vault, crm, dev_tokens
):
    """Review finding: a finished task's check could turn into 'unavailable, retry' and no test noticed."""
    _, data_path = secret_paths(CRM_CREDENTIAL)

    def not_lease_holder(events: list[dict]) -> list[dict]:
        return [e for e in events if e.get("reason") == "NOT_LEASE_HOLDER"]

    before = len(not_lease_holder(broker.audit_events()))
    for label, task in await _finished_in_three_ways(engine, crm):
        reads = vault.count("GET", data_path)
        error = await _refused(broker.for_task(dev_tokens.worker_token, task))
        assert (error.code(), error_info(error).reason) == (
            grpc.StatusCode.PERMISSION_DENIED,
            "NOT_LEASE_HOLDER",
        ), label
        assert vault.count("GET", data_path) == reads, label
    refusals = not_lease_holder(
        await _audited(broker, lambda events: len(not_lease_holder(events)) >= before + 3)
    )
    # The audit blames the worker that asked, not the broker's own identity towards the engine.
    assert refusals and all(e["caller"] == POOL for e in refusals[-3:])


def _credential_count(metrics_url: str, outcome: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if (
            line.startswith("abada_broker_credentials_total{")
            and f'outcome="{outcome}"' in line
            and 'purpose="task"' in line
        ):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_metrics_count_credentials_issued_and_refused(engine, broker, crm, dev_tokens):
    issued_before = await asyncio.to_thread(_credential_count, broker.metrics_url, "issued")
    task = await leased_task(engine, bundle(crm.url))
    await broker.for_task(dev_tokens.worker_token, task)
    with pytest.raises(grpc.aio.AioRpcError):
        await broker.tool_credential(dev_tokens.worker_token, task.id, WORKER, "not-the-lease-token")
    assert await asyncio.to_thread(_credential_count, broker.metrics_url, "issued") == issued_before + 1
    assert await asyncio.to_thread(broker_refusals, broker.metrics_url) >= 1


def broker_refusals(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("abada_broker_credentials_total{") and 'outcome="issued"' not in line
    )


async def test_a_5000_character_server_name_is_refused_with_its_own_status_and_reason(
    engine, broker, vault, crm, dev_tokens
):
    task = await leased_task(engine, bundle(crm.url))
    error = await _refused(broker.for_task(dev_tokens.worker_token, task, server="s" * 5_000))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.code()
    assert error_info(error).reason
    assert len((error.details() or "").encode()) <= 1_000
