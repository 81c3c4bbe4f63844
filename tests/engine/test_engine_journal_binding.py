"""What a sealed journal payload is bound to: its task, sequence and field, and (associated data v2)
the attempt, kind, tool and key id the engine acts on when it reads the step back.

Review finding: the associated data bound task, sequence and field only, so whoever could write the
database could move a payload to a step of another attempt (a keyed write's idempotency key derives
from the attempt), kind or tool, and it still opened. Rows sealed before (v1) still open.
"""

from __future__ import annotations

import base64
import json
import os
import uuid

import grpc
import pytest
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import EngineError
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.journal import Journal, StepRequest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from engine_helpers import append, error_info, journal, plain
from sqlalchemy import text
from test_engine_journal import leased_task, scenario_steps

K2 = b"\x02" * 32  # the test engine's primary key (tests/conftest.py)


async def _column(db, sequence: int, column: str, value) -> None:
    async with db.begin() as conn:
        await conn.execute(
            text(f"UPDATE journal_steps SET {column} = :value WHERE sequence = :sequence"),
            {"value": value, "sequence": sequence},
        )


async def _refused(engine, task_id: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await journal(engine, task_id)
    assert caught.value.code() == grpc.StatusCode.DATA_LOSS
    assert error_info(caught.value).reason == "JOURNAL_INTEGRITY"
    return caught.value.details()


@pytest.mark.parametrize(
    ("sequence", "column", "moved_to"),
    [
        (2, "attempt", 2),  # the read of attempt 1 claimed by attempt 2
        (1, "kind", "TOOL_CALL"),  # a model turn passed off as a tool call
        (2, "tool_ref", "crm/create_ticket"),  # a read's result passed off as the write's
    ],
)
async def test_a_payload_moved_to_a_step_of_another_attempt_kind_or_tool_does_not_open(
    engine, crm_credentials, db, sequence, column, moved_to
):
    task = await leased_task(engine, crm_credentials)
    await scenario_steps(engine, task)
    async with db.connect() as conn:
        versions = (
            (await conn.execute(text("SELECT DISTINCT aad_version FROM journal_steps"))).scalars().all()
        )
    assert versions == [2]  # new rows are sealed with associated data v2
    await _column(db, sequence, column, moved_to)
    why = await _refused(engine, task.id)
    assert "failed authentication" in why

    # The same move on a row sealed with v1 (task, sequence, field) would have gone unnoticed: that is
    # what v2 closes. Re-sealed the old way and marked v1, the moved row opens.
    async with db.connect() as conn:
        row = (
            await conn.execute(
                text("SELECT request_ciphertext, response_ciphertext FROM journal_steps WHERE sequence = :s"),
                {"s": sequence},
            )
        ).one()
    original = {
        1: ({"turn": 0}, {"functionCalls": [{"id": "call_1", "name": "crm__get_customer"}]}),
        2: (
            {"callId": "call_1", "arguments": {"customerId": "C-42"}},
            {"structuredContent": {"name": "Alice", "tier": "gold"}},
        ),
    }[sequence]
    assert row.request_ciphertext is not None and row.response_ciphertext is not None
    await _write_v1(db, task.id, sequence, *original)
    steps = await journal(engine, task.id)
    assert plain(steps[sequence - 1].response) == original[1]


def _old_seal(task_id: str, sequence: int, field: str, value: dict) -> bytes:
    """What the engine wrote before associated data v2, spelled out here rather than borrowed."""
    nonce = os.urandom(12)
    aad = f"abada.journal/v1|{task_id}|{sequence}|{field}".encode()
    return nonce + AESGCM(K2).encrypt(nonce, json.dumps(value, separators=(",", ":")).encode(), aad)


async def _write_v1(db, task_id: str, sequence: int, request: dict, response: dict | None) -> None:
    async with db.begin() as conn:
        await conn.execute(
            text(
                "UPDATE journal_steps SET aad_version = 1, key_id = 'k2', request_ciphertext = :req, "
                "response_ciphertext = :resp WHERE task_id = CAST(:task AS uuid) AND sequence = :s"
            ),
            {
                "req": _old_seal(task_id, sequence, "request", request),
                "resp": _old_seal(task_id, sequence, "response", response) if response is not None else None,
                "task": task_id,
                "s": sequence,
            },
        )


async def test_a_row_sealed_by_the_earlier_engine_still_opens_and_is_finished_as_it_was_sealed(
    engine, crm_credentials, db
):
    task = await leased_task(engine, crm_credentials)
    request = {"turn": 0, "contents": "Alice's parcel"}
    # A model call the earlier engine began: its insert named no associated data version.
    async with db.begin() as conn:
        await conn.execute(
            text(
                "INSERT INTO journal_steps (task_id, sequence, attempt, kind, state, tool_ref, key_id, "
                "request_ciphertext, request_digest, input_tokens, output_tokens, abandoned, created_at, "
                "updated_at) VALUES (CAST(:task AS uuid), 1, 1, 'MODEL_CALL', 'STARTED', '', 'k2', :req, "
                "NULL, 0, 0, false, now(), now())"
            ),
            {"task": task.id, "req": _old_seal(task.id, 1, "request", request)},
        )
    [started] = await journal(engine, task.id)
    assert plain(started.request) == request

    # This engine finishes it: the response is sealed the way the row is (v1), so the row still opens.
    await append(engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "done"}, tokens=(5, 1))
    [finished] = await journal(engine, task.id)
    assert (plain(finished.request), plain(finished.response)) == (request, {"text": "done"})
    async with db.connect() as conn:
        assert (await conn.execute(text("SELECT aad_version FROM journal_steps"))).scalar_one() == 1
    # And a new row next to it is v2.
    await append(engine, task, 2, "MODEL_CALL", "STARTED", request={"turn": 1})
    async with db.connect() as conn:
        versions = (
            (await conn.execute(text("SELECT aad_version FROM journal_steps ORDER BY sequence")))
            .scalars()
            .all()
        )
    assert versions == [1, 2]


async def test_two_key_ids_sharing_key_bytes_still_keep_their_rows_apart(engine, crm_credentials, db):
    """A ciphertext relabelled with another key id fails even when that id holds the same key bytes
    (an operator who re-added a key under a new name): the key id is bound too."""
    task = await leased_task(engine, crm_credentials)
    same = base64.b64encode(os.urandom(32)).decode()
    replica = Journal(
        db,
        DefinitionCatalog(db),
        KeyRing.parse(f"ka:{same},kb:{same}"),
        IdempotencyKeys(b"test-idempotency-secret"),
    )
    task_id = uuid.UUID(task.id)
    await replica.append(
        StepRequest(
            task_id=task_id,
            worker_id="w",
            lease_token=task.lease_token,
            attempt=1,
            sequence=1,
            kind="MODEL_CALL",
            state="STARTED",
            tool_ref="",
            request={"turn": 0},
            response=None,
            input_tokens=0,
            output_tokens=0,
        )
    )
    [opened] = await replica.journal(task_id)
    assert opened.request == {"turn": 0}
    await _column(db, 1, "key_id", "kb")
    with pytest.raises(EngineError) as caught:
        await replica.journal(task_id)
    assert caught.value.reason_name == "JOURNAL_INTEGRITY"
