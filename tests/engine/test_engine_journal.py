"""The step journal: checks and refusals, identical re-sends, sealing at rest, rotation."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac

import grpc
import pytest
from abada.engine.v1 import external_task_pb2 as et
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.journal import Journal
from engine_helpers import append, deploy, error_info, fetch, journal, plain, start
from sqlalchemy import text

BUNDLE = """
tool_servers:
  - name: crm
    transport: streamable-http
    url: {url}
    credential: crm-token
    tools:
      get_customer:  {{ policy: read }}
      create_ticket: {{ policy: write, idempotency: {idempotency} }}
processes:
  - id: support_triage
    start: triage
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Look up ${{customerId}} and open a ticket.
        inputs: {{ customerId: "${{customerId}}" }}
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        limits: {{ max_model_calls: 3, max_tool_calls: 3, max_tokens: 1000 }}
        next: done
      - {{ id: done, type: end }}
"""
SECRET_ARGUMENT = "Parcel-never-arrived-7731"


async def leased_task(engine, crm, idempotency="key", lease_ms=30_000):
    await deploy(engine, BUNDLE.format(url=crm.url, idempotency=idempotency))
    await start(engine, "support_triage", customerId="C-42")
    [task] = await fetch(engine, "w", "abada:agent", lease_ms=lease_ms)
    return task


async def scenario_steps(engine, task):
    """Steps 1-3 of the reference scenario: model call, read tool, model call."""
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await append(
        engine,
        task,
        1,
        "MODEL_CALL",
        "COMPLETED",
        response={"functionCalls": [{"id": "call_1", "name": "crm__get_customer"}]},
        tokens=(100, 10),
    )
    await append(
        engine,
        task,
        2,
        "TOOL_CALL",
        "COMPLETED",
        "crm/get_customer",
        request={"callId": "call_1", "arguments": {"customerId": "C-42"}},
        response={"structuredContent": {"name": "Alice", "tier": "gold"}},
    )
    await append(engine, task, 3, "MODEL_CALL", "STARTED", request={"turn": 1})
    await append(
        engine,
        task,
        3,
        "MODEL_CALL",
        "COMPLETED",
        response={"functionCalls": [{"id": "call_2", "name": "crm__create_ticket"}]},
        tokens=(150, 20),
    )


async def test_the_scenario_journal_with_an_idempotency_key_for_the_write(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials)
    await scenario_steps(engine, task)
    request = {"callId": "call_2", "arguments": {"customerId": "C-42", "subject": SECRET_ARGUMENT}}
    started = await append(engine, task, 4, "TOOL_CALL", "STARTED", "crm/create_ticket", request=request)
    assert started.idempotency_key.startswith("abada-") and len(started.idempotency_key) > 40
    done = await append(
        engine,
        task,
        4,
        "TOOL_CALL",
        "COMPLETED",
        "crm/create_ticket",
        response={"structuredContent": {"ticketId": "T-981"}},
    )
    assert done.idempotency_key == started.idempotency_key
    steps = await journal(engine, task.id)
    assert [
        (s.sequence, et.StepKind.Name(s.kind), et.StepState.Name(s.state), s.tool_ref) for s in steps
    ] == [
        (1, "STEP_KIND_MODEL_CALL", "STEP_STATE_COMPLETED", ""),
        (2, "STEP_KIND_TOOL_CALL", "STEP_STATE_COMPLETED", "crm/get_customer"),
        (3, "STEP_KIND_MODEL_CALL", "STEP_STATE_COMPLETED", ""),
        (4, "STEP_KIND_TOOL_CALL", "STEP_STATE_COMPLETED", "crm/create_ticket"),
    ]
    assert (steps[0].tokens.input_tokens, steps[0].tokens.output_tokens) == (100, 10)
    assert plain(steps[3].request) == request
    assert plain(steps[3].response) == {"structuredContent": {"ticketId": "T-981"}}
    assert steps[3].idempotency_key == started.idempotency_key
    assert steps[1].idempotency_key == ""  # reads carry no key


async def test_an_identical_resend_gets_the_identical_answer(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials)
    await scenario_steps(engine, task)
    request = {"callId": "call_2", "arguments": {"customerId": "C-42"}}
    first = await append(engine, task, 4, "TOOL_CALL", "STARTED", "crm/create_ticket", request=request)
    again = await append(engine, task, 4, "TOOL_CALL", "STARTED", "crm/create_ticket", request=request)
    assert again.idempotency_key == first.idempotency_key
    assert again.step.create_time == first.step.create_time
    assert len(await journal(engine, task.id)) == 4


async def _refused(engine, task, expected_reason, code=None, **kwargs):
    before = await journal(engine, task.id)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await append(engine, task, **kwargs)
    info = error_info(caught.value)
    assert info.reason == expected_reason, caught.value.details()
    if code is not None:
        assert caught.value.code() == code
    assert await journal(engine, task.id) == before  # a refusal changes nothing
    return caught.value


async def test_every_refusal_reason_leaves_the_journal_unchanged(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials)
    await scenario_steps(engine, task)
    write = {
        "sequence": 4,
        "kind": "TOOL_CALL",
        "state": "STARTED",
        "tool_ref": "crm/create_ticket",
        "request": {"callId": "call_2"},
    }
    await _refused(
        engine, task, "NOT_LEASE_HOLDER", grpc.StatusCode.PERMISSION_DENIED, lease_token="forged", **write
    )
    await _refused(engine, task, "NOT_LEASE_HOLDER", worker_id="intruder", **write)
    await _refused(engine, task, "ATTEMPT_MISMATCH", grpc.StatusCode.FAILED_PRECONDITION, attempt=2, **write)
    await _refused(engine, task, "SEQUENCE_GAP", **{**write, "sequence": 6})
    await _refused(engine, task, "SEQUENCE_CONFLICT", grpc.StatusCode.ABORTED, **{**write, "sequence": 2})
    await _refused(engine, task, "BINDING_NOT_FOUND", **{**write, "tool_ref": "crm/delete_customer"})
    await _refused(engine, task, "WRITE_NOT_STARTED", **{**write, "state": "COMPLETED"})
    # Limits: two model calls and one tool call spent; a fourth model call and a fourth tool call exceed them.
    await append(engine, task, 4, "MODEL_CALL", "STARTED", request={"turn": 2})
    await append(engine, task, 4, "MODEL_CALL", "COMPLETED", response={"text": "..."}, tokens=(10, 10))
    error = await _refused(
        engine,
        task,
        "LIMIT_EXCEEDED",
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        sequence=5,
        kind="MODEL_CALL",
        state="STARTED",
        request={"turn": 3},
    )
    assert error_info(error).metadata["limit"] == "max_model_calls"
    await append(engine, task, 5, "TOOL_CALL", "COMPLETED", "crm/get_customer", request={"callId": "c3"})
    await append(engine, task, 6, "TOOL_CALL", "COMPLETED", "crm/get_customer", request={"callId": "c4"})
    error = await _refused(
        engine,
        task,
        "LIMIT_EXCEEDED",
        sequence=7,
        kind="TOOL_CALL",
        state="STARTED",
        tool_ref="crm/create_ticket",
        request={"callId": "c5"},
    )
    assert error_info(error).metadata["limit"] == "max_tool_calls"


async def test_token_budget_stops_the_next_model_call(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials)
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "long"}, tokens=(900, 150))
    error = await _refused(
        engine, task, "LIMIT_EXCEEDED", sequence=2, kind="MODEL_CALL", state="STARTED", request={"turn": 1}
    )
    assert error_info(error).metadata["limit"] == "max_tokens"


async def test_after_expiry_the_old_holder_cannot_journal(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials, lease_ms=1000)
    await asyncio.sleep(1.1)
    await _refused(
        engine, task, "LEASE_EXPIRED", sequence=1, kind="MODEL_CALL", state="STARTED", request={"turn": 0}
    )


async def _wait_until_expired(db, task_id: str) -> None:
    """Polls PostgreSQL's own clock until the task's lease has run out."""
    for _ in range(100):
        async with db.connect() as conn:
            live = (
                await conn.execute(
                    text("SELECT lease_expires_at > now() FROM tasks WHERE id = :id"), {"id": task_id}
                )
            ).scalar_one()
        if not live:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the lease never ran out")


async def test_a_model_turn_that_returns_after_the_lease_ran_out_is_kept_while_nobody_took_over(
    engine, db, crm_credentials
):
    """The engine was out of reach past the lease: the holder's late COMPLETED is journaled, a new step
    waits for the lease to be re-granted, and ExtendLease re-grants it (same attempt, same token)."""
    task = await leased_task(engine, crm_credentials, lease_ms=1000)
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await _wait_until_expired(db, task.id)

    late = await append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "paid"}, tokens=(7, 3))
    assert late.step.state == et.STEP_STATE_COMPLETED
    read = {"callId": "c1", "arguments": {"customerId": "C-42"}}
    await append(
        engine, task, 2, "TOOL_CALL", "COMPLETED", "crm/get_customer", request=read, response={"ok": 1}
    )
    await _refused(
        engine, task, "LEASE_EXPIRED", sequence=3, kind="MODEL_CALL", state="STARTED", request={"turn": 1}
    )

    renewed = await engine.tasks.ExtendLease(
        et.ExtendLeaseRequest(task_id=task.id, worker_id="w", lease_token=task.lease_token, lease_ms=5000)
    )
    assert renewed.lease_expires_at.ToDatetime() > task.lease_expires_at.ToDatetime()
    await append(engine, task, 3, "MODEL_CALL", "STARTED", request={"turn": 1})
    steps = await journal(engine, task.id)
    assert [(s.sequence, s.attempt, s.state) for s in steps] == [
        (1, 1, et.STEP_STATE_COMPLETED),
        (2, 1, et.STEP_STATE_COMPLETED),
        (3, 1, et.STEP_STATE_STARTED),
    ]
    assert plain(steps[0].response) == {"text": "paid"}


async def test_a_late_completed_after_somebody_took_over_is_refused_and_the_new_holder_re_runs_the_call(
    engine, db, crm_credentials
):
    task = await leased_task(engine, crm_credentials, lease_ms=1000)
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    await _wait_until_expired(db, task.id)
    [second] = await fetch(engine, "w2", "abada:agent")
    assert (second.id, second.attempt) == (task.id, 2)
    for call in (
        append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "too late"}),
        engine.tasks.ExtendLease(
            et.ExtendLeaseRequest(task_id=task.id, worker_id="w", lease_token=task.lease_token, lease_ms=5000)
        ),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert error_info(caught.value).reason == "NOT_LEASE_HOLDER"
    [orphan] = await journal(engine, task.id)
    assert orphan.state == et.STEP_STATE_STARTED


async def test_two_writers_racing_for_one_sequence_exactly_one_wins(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials)
    results = await asyncio.gather(
        *(
            append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0, "writer": n})
            for n in range(6)
        ),
        return_exceptions=True,
    )
    winners = [r for r in results if not isinstance(r, BaseException)]
    losers = [r for r in results if isinstance(r, BaseException)]
    assert len(winners) == 1
    assert all(error_info(e).reason == "SEQUENCE_CONFLICT" for e in losers)
    [step] = await journal(engine, task.id)
    assert plain(step.request) == plain(winners[0].step.request)


async def test_raw_rows_hold_no_plaintext_and_tampering_is_detected(engine, crm_credentials, db):
    task = await leased_task(engine, crm_credentials)
    await scenario_steps(engine, task)
    await append(
        engine,
        task,
        4,
        "TOOL_CALL",
        "STARTED",
        "crm/create_ticket",
        request={"callId": "call_2", "arguments": {"subject": SECRET_ARGUMENT}},
    )
    async with db.connect() as conn:
        rows = (await conn.execute(text("SELECT * FROM journal_steps ORDER BY sequence"))).mappings().all()
    for row in rows:
        raw = b"".join(bytes(v) for k, v in row.items() if isinstance(v, bytes | memoryview))
        assert SECRET_ARGUMENT.encode() not in raw
        assert b"Alice" not in raw and b"C-42" not in raw
        assert row["key_id"] == "k2"
    # Metadata stays queryable in clear.
    assert [(r["kind"], r["state"], r["tool_ref"]) for r in rows][1] == (
        "TOOL_CALL",
        "COMPLETED",
        "crm/get_customer",
    )

    async with db.begin() as conn:  # flip one bit of step 4's sealed request
        await conn.execute(
            text(
                "UPDATE journal_steps SET request_ciphertext = overlay(request_ciphertext PLACING "
                "decode(lpad(to_hex(get_byte(request_ciphertext, 20) # 1), 2, '0'), 'hex') FROM 21 FOR 1) "
                "WHERE sequence = 4"
            )
        )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await journal(engine, task.id)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert error_info(caught.value).reason == "JOURNAL_INTEGRITY"

    async with db.begin() as conn:  # a valid ciphertext moved to another row fails its associated data
        await conn.execute(
            text(
                "UPDATE journal_steps SET request_ciphertext = (SELECT request_ciphertext FROM journal_steps "
                "WHERE sequence = 2) WHERE sequence = 4"
            )
        )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await journal(engine, task.id)
    assert error_info(caught.value).reason == "JOURNAL_INTEGRITY"


async def test_rows_sealed_under_an_old_key_still_open_after_a_new_key_is_rotated_in(
    engine, crm_credentials, db
):
    task = await leased_task(engine, crm_credentials)
    await scenario_steps(engine, task)  # sealed under k2, the test engine's primary key
    k1 = base64.b64encode(b"\x01" * 32).decode()
    k2 = base64.b64encode(b"\x02" * 32).decode()
    k3 = base64.b64encode(b"\x03" * 32).decode()
    import uuid

    rotated = Journal(
        db,
        DefinitionCatalog(db),
        KeyRing.parse(f"k3:{k3},k2:{k2},k1:{k1}"),
        IdempotencyKeys(b"test-idempotency-secret"),
    )
    opened = await rotated.journal(uuid.UUID(task.id))
    assert [s.sequence for s in opened] == [1, 2, 3]
    assert opened[1].response == {"structuredContent": {"name": "Alice", "tier": "gold"}}
    from abada_engine.runtime.journal import StepRequest

    await rotated.append(
        StepRequest(
            task_id=uuid.UUID(task.id),
            worker_id="w",
            lease_token=task.lease_token,
            attempt=1,
            sequence=4,
            kind="TOOL_CALL",
            state="STARTED",
            tool_ref="crm/create_ticket",
            request={"callId": "call_2"},
            response=None,
            input_tokens=0,
            output_tokens=0,
        )
    )
    async with db.connect() as conn:
        key_ids = (
            (await conn.execute(text("SELECT key_id FROM journal_steps ORDER BY sequence"))).scalars().all()
        )
    assert key_ids == ["k2", "k2", "k2", "k3"]
    # The engine without k3 cannot open the new row, and says so rather than returning garbage.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await journal(engine, task.id)
    assert error_info(caught.value).reason == "JOURNAL_INTEGRITY"


async def test_bad_kind_and_state_are_invalid_arguments(engine, crm_credentials):
    task = await leased_task(engine, crm_credentials)
    for fields, field in (({"kind": 0, "state": 1}, "kind"), ({"kind": 1, "state": 4}, "state")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await engine.tasks.AppendStep(
                et.AppendStepRequest(
                    task_id=task.id,
                    worker_id="w",
                    lease_token=task.lease_token,
                    attempt=1,
                    sequence=1,
                    **fields,
                )
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_info(caught.value).metadata["field"] == field


async def test_two_replicas_journaling_one_task_keep_sequence_and_limits(engine, crm_credentials, db):
    """Each replica remembers where a task stands; what it remembers never lets a step past the checks."""
    import uuid

    from abada_engine.runtime.journal import StepRequest

    task = await leased_task(engine, crm_credentials)
    keys = KeyRing.parse("k2:" + base64.b64encode(b"\x02" * 32).decode())
    replicas = [
        Journal(db, DefinitionCatalog(db), keys, IdempotencyKeys(b"test-idempotency-secret")) for _ in "ab"
    ]
    task_id = uuid.UUID(task.id)

    def model_call(sequence: int, state: str) -> StepRequest:
        return StepRequest(
            task_id=task_id,
            worker_id="w",
            lease_token=task.lease_token,
            attempt=1,
            sequence=sequence,
            kind="MODEL_CALL",
            state=state,
            tool_ref="",
            request={"turn": sequence} if state == "STARTED" else None,
            response={"text": "ok"} if state == "COMPLETED" else None,
            input_tokens=1,
            output_tokens=1,
        )

    async with db.connect() as conn:
        definition_id = (
            await conn.execute(
                text(
                    "SELECT i.definition_id FROM tasks t JOIN instances i ON i.id = t.instance_id WHERE t.id = :id"
                ),
                {"id": task_id},
            )
        ).scalar_one()
    for replica in replicas:  # both know where the task stands, as after a fetch through each of them
        replica.handed_out.place(task_id, definition_id, "triage")
    await replicas[0].append(model_call(1, "STARTED"))
    await replicas[1].append(model_call(1, "COMPLETED"))
    await replicas[1].append(model_call(2, "STARTED"))
    with pytest.raises(Exception) as caught:  # replica a still thinks sequence 2 is free
        await replicas[0].append(
            StepRequest(
                task_id=task_id,
                worker_id="w",
                lease_token=task.lease_token,
                attempt=1,
                sequence=2,
                kind="MODEL_CALL",
                state="STARTED",
                tool_ref="",
                request={"turn": "other"},
                response=None,
                input_tokens=0,
                output_tokens=0,
            )
        )
    assert caught.value.reason_name == "SEQUENCE_CONFLICT"
    await replicas[0].append(model_call(2, "COMPLETED"))
    await replicas[1].append(model_call(3, "STARTED"))  # the third and last model call the limits allow
    with pytest.raises(Exception) as caught:
        await replicas[0].append(model_call(4, "STARTED"))
    assert (caught.value.reason_name, caught.value.metadata["limit"]) == ("LIMIT_EXCEEDED", "max_model_calls")


async def test_idempotency_keys_differ_by_task_attempt_and_sequence_and_are_the_documented_hmac(
    engine, crm_credentials
):
    """Review finding: keys were checked by prefix and length only, so a key derived without the
    sequence (or the task) went unnoticed. Two keyed writes in one task, in two tasks, and a later attempt."""

    def expected(task_id: str, attempt: int, sequence: int) -> str:
        mac = hmac.new(b"test-idempotency-secret", f"{task_id}|{attempt}|{sequence}".encode(), hashlib.sha256)
        return f"abada-{mac.hexdigest()}"

    write = {"callId": "call_w", "arguments": {"customerId": "C-42"}}
    await deploy(engine, BUNDLE.format(url=crm_credentials.url, idempotency="key"))
    await start(engine, "support_triage", customerId="C-42")
    await start(engine, "support_triage", customerId="C-42")
    [first] = await fetch(engine, "w", "abada:agent", lease_ms=3_000)
    [second] = await fetch(engine, "w", "abada:agent")
    keys = {}
    for task in (first, second):
        for sequence in (1, 2):  # two keyed writes of one turn, identical arguments
            appended = await append(
                engine, task, sequence, "TOOL_CALL", "STARTED", "crm/create_ticket", request=write
            )
            keys[(task.id, task.attempt, sequence)] = appended.idempotency_key
    # The first task's lease runs out; its next attempt writes at a new sequence under attempt 2.
    deadline = asyncio.get_running_loop().time() + 15
    again = []
    while not again and asyncio.get_running_loop().time() < deadline:
        again = await fetch(engine, "w2", "abada:agent", wait_ms=500)
    [retry] = again
    assert (retry.id, retry.attempt) == (first.id, 2)
    appended = await append(
        engine, retry, 3, "TOOL_CALL", "STARTED", "crm/create_ticket", request=write, worker_id="w2"
    )
    keys[(retry.id, 2, 3)] = appended.idempotency_key

    assert len(set(keys.values())) == len(keys) == 5
    for (task_id, attempt, sequence), key in keys.items():
        assert key == expected(task_id, attempt, sequence)
