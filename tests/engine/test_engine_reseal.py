"""`abada-engine reseal` in the engine's own process: what it re-seals besides journal payloads (the
approved call's digest), how it and a running engine stay out of each other's way, and what it
cannot open.

The end-to-end rotation with real processes (seal under A, rotate, re-seal, remove A) is in
tests/faults/test_fault_journal_key_retired.py.
"""

from __future__ import annotations

import base64
import uuid

import pytest
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import EngineError
from abada_engine.runtime.approvals import Approvals
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.crypto.reseal import Resealer
from abada_engine.runtime.crypto.sealing import Place, StepSealer
from abada_engine.runtime.journal import Journal, StepRequest
from abada_engine.store import journal_steps as step_store
from abada_engine.store import resealing as reseal_store
from engine_helpers import append, fetch, journal, plain
from sqlalchemy import text
from test_engine_approvals import CREATE, PROPOSED, call_request, park, proposing_task
from test_engine_journal import leased_task

K1 = "k1:" + base64.b64encode(b"\x01" * 32).decode()
K2 = "k2:" + base64.b64encode(b"\x02" * 32).decode()
IDEMPOTENCY = IdempotencyKeys(b"test-idempotency-secret")  # the test engine's (tests/conftest.py)


def _journal(db, ring: str) -> Journal:
    """The engine's journal holding only `ring` (a replica before the rotation, or after the old key left)."""
    return Journal(db, DefinitionCatalog(db), KeyRing.parse(ring), IDEMPOTENCY)


def _step(task, sequence: int, kind: str, state: str, tool_ref: str = "", request=None, response=None):  # type: ignore[no-untyped-def]
    return StepRequest(
        task_id=uuid.UUID(task.id),
        worker_id="w",
        lease_token=task.lease_token,
        attempt=task.attempt,
        sequence=sequence,
        kind=kind,
        state=state,
        tool_ref=tool_ref,
        request=request,
        response=response,
        input_tokens=0,
        output_tokens=0,
    )


async def _key_ids(db) -> tuple[list[str], list[str]]:
    async with db.connect() as conn:
        steps = (
            (await conn.execute(text("SELECT key_id FROM journal_steps ORDER BY sequence"))).scalars().all()
        )
        approvals = (
            (await conn.execute(text("SELECT key_id FROM approvals WHERE key_id IS NOT NULL")))
            .scalars()
            .all()
        )
    return list(steps), list(approvals)


async def test_an_approval_decided_under_the_old_key_is_still_honoured_once_that_key_is_gone(
    engine, crm, crm_credentials, db
):
    """The approved call's keyed digest is re-keyed too: without that, the call a person approved
    would be refused (its digest names a key the ring no longer has)."""
    _, task = await proposing_task(engine, crm)
    [approval_id] = await park(engine, task)
    # A replica that still seals under k1 records the decision: the approval keeps a digest under k1.
    before_rotation = StepSealer(KeyRing.parse(f"{K1},{K2}"), IDEMPOTENCY)
    await Approvals(db, DefinitionCatalog(db), before_rotation).decide(
        uuid.UUID(approval_id), "APPROVE", "ops", "fine"
    )
    [again] = await fetch(engine, "w", "abada:agent")
    # and journals the approved call's begin.
    old = _journal(db, f"{K1},{K2}")
    await old.append(_step(again, 3, "TOOL_CALL", "STARTED", CREATE, call_request("call_0", PROPOSED)))
    assert await _key_ids(db) == (["k2", "k2", "k1"], ["k1"])

    dry = await Resealer(db, StepSealer(KeyRing.parse(f"{K2},{K1}"), IDEMPOTENCY)).run(dry_run=True)
    assert (dict(dry.steps_resealed), dict(dry.approvals_rekeyed)) == ({("k1", 2): 1}, {"k1": 1})
    assert await _key_ids(db) == (["k2", "k2", "k1"], ["k1"])  # a dry run changes nothing

    # The newest step is k1's (the old replica's): forced, as an operator does once every replica has
    # the new ring (tests/security/test_security_reseal_order.py: unforced, it is refused).
    report = await Resealer(db, StepSealer(KeyRing.parse(f"{K2},{K1}"), IDEMPOTENCY)).run(force=True)
    assert (dict(report.steps_resealed), dict(report.approvals_rekeyed)) == ({("k1", 2): 1}, {"k1": 1})
    assert report.done and report.removable(KeyRing.parse(f"{K2},{K1}")) == ["k1"]
    assert await _key_ids(db) == (["k2", "k2", "k2"], ["k2"])

    # Without k1: the identical begin is recognised (its digest is under k2 now), the call finishes,
    # and the approval still admits exactly the approved call.
    after = _journal(db, K2)
    resent = await after.append(
        _step(again, 3, "TOOL_CALL", "STARTED", CREATE, call_request("call_0", PROPOSED))
    )
    assert resent.step.request == call_request("call_0", PROPOSED)
    await after.append(_step(again, 3, "TOOL_CALL", "COMPLETED", CREATE, response={"ticketId": "T-1"}))
    # The approval was used by the run at 3 (its digest matched under k2): neither the same call again
    # nor another one runs on it.
    for arguments in (PROPOSED, {**PROPOSED, "priority": "low"}):
        with pytest.raises(EngineError) as caught:
            await after.append(
                _step(again, 4, "TOOL_CALL", "STARTED", CREATE, call_request("call_0", arguments))
            )
        assert caught.value.reason_name == "APPROVAL_REQUIRED"
    steps = await journal(engine, again.id)
    assert plain(steps[1].response)["approval"]["arguments"] == PROPOSED
    assert plain(steps[2].response) == {"ticketId": "T-1"}


async def test_a_step_the_engine_finishes_while_it_is_resealed_ends_under_one_key(
    engine, crm_credentials, db
):
    """Neither side may write over the other: the re-seal writes a row only if it still holds what was
    read, and the engine finishes a step only under the key and version it read for the row."""
    task = await leased_task(engine, crm_credentials)
    old = _journal(db, f"{K1},{K2}")
    await old.append(_step(task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}))
    await old.append(_step(task, 1, "MODEL_CALL", "COMPLETED", response={"text": "one"}))
    await old.append(_step(task, 2, "MODEL_CALL", "STARTED", request={"turn": 1}))
    await old.append(_step(task, 2, "MODEL_CALL", "COMPLETED", response={"text": "two"}))
    await old.append(_step(task, 3, "MODEL_CALL", "STARTED", request={"turn": 2}))
    await old.append(_step(task, 4, "TOOL_CALL", "STARTED", "crm/get_customer", request={"callId": "c"}))
    sealer = StepSealer(KeyRing.parse(f"{K2},{K1}"), IDEMPOTENCY)

    # The re-seal reads step 3; the engine finishes it (under k1, as its row is); the re-seal's write
    # finds the row changed and leaves it.
    async with db.connect() as conn:
        [*_, read] = await reseal_store.stale_steps(conn, "k2", 2, (uuid.UUID(task.id), 2), 1)
    assert read.sequence == 3
    request, request_digest = sealer.reseal(read, "request")
    await append(engine, task, 3, "MODEL_CALL", "COMPLETED", response={"text": "three"})
    async with db.begin() as conn:
        stale = reseal_store.Resealed(read, "k2", 2, request, None, request_digest, None)
        assert not await reseal_store.replace_step_seal(conn, stale)

    # The engine read step 4 under k1 and sealed its response so; the re-seal moves the row to k2
    # first; the engine's write finds the key changed and is refused (its careful path reads again).
    async with db.connect() as conn:
        row = await step_store.step_at(conn, uuid.UUID(task.id), 4)
    assert row is not None and row.key_id == "k1"
    late = _step(task, 4, "TOOL_CALL", "COMPLETED", "crm/get_customer", response={"name": "Alice"})
    sealed_as_read = old._write_params(late, Place.of(row), with_request=False)
    report = await Resealer(db, sealer).run(force=True)  # the newest step is the old replica's
    assert sum(report.steps_resealed.values()) == 4 and report.done
    async with db.connect() as conn:
        assert await step_store.finish_guarded(conn, sealed_as_read) is None
    await append(engine, task, 4, "TOOL_CALL", "COMPLETED", "crm/get_customer", response={"name": "Alice"})

    opened = await _journal(db, K2).journal(uuid.UUID(task.id))
    assert [s.response for s in opened] == [
        {"text": "one"},
        {"text": "two"},
        {"text": "three"},
        {"name": "Alice"},
    ]
    assert await _key_ids(db) == (["k2"] * 4, [])


async def test_a_step_it_cannot_open_is_named_and_left_as_it_is(engine, crm_credentials, db):
    task = await leased_task(engine, crm_credentials)
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    async with db.begin() as conn:
        await conn.execute(text("UPDATE journal_steps SET key_id = 'k9'"))
    report = await Resealer(db, StepSealer(KeyRing.parse(f"{K2},{K1}"), IDEMPOTENCY)).run(force=True)
    assert not report.done
    assert report.unreadable == [f"step {task.id}/1 under k9"]
    assert any("could not be opened, left as they are: 1" in line for line in report.lines(KeyRing.parse(K2)))
    assert await _key_ids(db) == (["k9"], [])
