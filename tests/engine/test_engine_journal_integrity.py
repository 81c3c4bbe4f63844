"""One unreadable journal row stops its own task, never the batch it was fetched with.

Review finding: a flipped byte in one task's journal made FetchAndLock fail with DATA_LOSS; a healthy task
locked in the same batch stayed LEASED with its token never delivered, and this repeated each time the
bad task came due. Now that one task becomes a JOURNAL_INTEGRITY incident and the rest are handed out.
"""

from __future__ import annotations

import asyncio
import time

from abada.engine.v1 import incident_pb2
from engine_helpers import append, deploy, fetch, start
from sqlalchemy import text

BUNDLE = """
processes:
  - id: journaled
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: decide
        result_variable: answer
        next: done
      - { id: done, type: end }
"""

FLIP_ONE_BYTE = (
    "UPDATE journal_steps SET response_ciphertext = overlay(response_ciphertext PLACING "
    "decode(lpad(to_hex(get_byte(response_ciphertext, 20) # 1), 2, '0'), 'hex') FROM 21 FOR 1) "
    "WHERE task_id = CAST(:task AS uuid) AND sequence = 1"
)


async def _fetch_when_due(engine, expected: int, timeout: float = 20.0):
    """Fetch until `expected` tasks come back (their 1 s leases must run out first)."""
    deadline = time.monotonic() + timeout
    fetched = []
    while time.monotonic() < deadline:
        fetched = await fetch(engine, "w2", "abada:agent", max_tasks=10, wait_ms=500)
        if len(fetched) >= expected:
            return fetched
        if fetched:
            return fetched
        await asyncio.sleep(0.05)
    return fetched


async def test_an_unreadable_row_holds_its_task_and_the_rest_of_the_batch_is_handed_out(engine, db):
    await deploy(engine, BUNDLE)
    await start(engine, "journaled")
    await start(engine, "journaled")
    first = await fetch(engine, "w1", "abada:agent", max_tasks=2, lease_ms=1_000)
    assert len(first) == 2
    for task in first:
        await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0}, worker_id="w1")
        await append(
            engine, task, 1, "MODEL_CALL", "COMPLETED", response={"text": "thinking"}, worker_id="w1"
        )
    broken, healthy = first
    async with db.begin() as conn:
        await conn.execute(text(FLIP_ONE_BYTE), {"task": broken.id})

    # Both leases run out; one fetch locks both. The healthy one is handed out with its journal.
    handed_out = await _fetch_when_due(engine, expected=1)
    assert [t.id for t in handed_out] == [healthy.id]
    assert [(s.sequence, s.state) for s in handed_out[0].steps] == [(1, 2)]  # STEP_STATE_COMPLETED

    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest())
    [incident] = listed.incidents
    assert (incident.type, incident.task_id) == ("JOURNAL_INTEGRITY", broken.id)
    assert "failed authentication" in incident.message
    async with db.connect() as conn:
        state, attempt = (
            await conn.execute(
                text("SELECT state, attempt FROM tasks WHERE id = CAST(:t AS uuid)"), {"t": broken.id}
            )
        ).one()
    assert str(state).upper().endswith("INCIDENT")
    assert attempt == 1  # the lock that found the bad row gave its attempt back

    # The held task does not come back to break later fetches.
    assert await fetch(engine, "w3", "abada:agent", max_tasks=10) == []
