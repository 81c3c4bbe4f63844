"""Retiring a journal key with real processes: steps sealed under key A; the ring rotated so B seals
and A only opens; `abada-engine reseal` beside the running engine; A removed from the ring; every
step still opens through the API. Without the re-seal, a reader without A could not open them.

Review finding: nothing re-sealed old steps, so a retired key could never actually leave the ring.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

from abada.engine.v1 import definition_pb2_grpc, external_task_pb2_grpc, process_pb2_grpc
from abada_engine.db.database import create_engine
from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import EngineError
from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.crypto.reseal import Resealer
from abada_engine.runtime.crypto.sealing import StepSealer
from abada_engine.runtime.journal import Journal
from engine_helpers import append, deploy, fetch, journal, plain, start
from fault_stack import clean_environment, engine_service
from sqlalchemy import text

BUNDLE = """
processes:
  - id: rotated
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-3.6-flash
        prompt: decide
        result_variable: answer
        limits: { max_model_calls: 5, max_tokens: 10000 }
        next: done
      - { id: done, type: end }
"""
TASKS = 3


def _ring_entry(name: str) -> str:
    return f"{name}:{base64.b64encode(os.urandom(32)).decode()}"


def _api(channel) -> SimpleNamespace:  # type: ignore[no-untyped-def]
    return SimpleNamespace(
        definitions=definition_pb2_grpc.DefinitionServiceStub(channel),
        processes=process_pb2_grpc.ProcessServiceStub(channel),
        tasks=external_task_pb2_grpc.ExternalTaskServiceStub(channel),
    )


async def _journals(api, tasks) -> dict[str, list[tuple]]:  # type: ignore[no-untyped-def]
    opened = {}
    for task in tasks:
        opened[task.id] = [
            (s.sequence, s.state, plain(s.request), plain(s.response)) for s in await journal(api, task.id)
        ]
    return opened


async def _keys_in_use(url: str) -> dict[tuple[str, int], int]:
    db = create_engine(url, 1)
    try:
        async with db.connect() as conn:
            rows = await conn.execute(
                text("SELECT key_id, aad_version, count(*) AS n FROM journal_steps GROUP BY 1, 2")
            )
            return {(r.key_id, r.aad_version): r.n for r in rows}
    finally:
        await db.dispose()


async def _opens_with(url: str, ring: str, task_ids: list[str]) -> str:
    """Read every journal with the engine's own journal reader holding only `ring`: "" or the refusal."""
    db = create_engine(url, 1)
    reader = Journal(db, DefinitionCatalog(db), KeyRing.parse(ring), IdempotencyKeys(b"x" * 32))
    try:
        for task_id in task_ids:
            await reader.journal(uuid.UUID(task_id))
        return ""
    except EngineError as error:
        return error.reason_name
    finally:
        await db.dispose()


async def _reseal_here(url: str, ring: str, dry_run: bool = False) -> str:
    """The re-seal in this process (the command's own code, without starting another interpreter)."""
    db = create_engine(url, 1)
    keys = KeyRing.parse(ring)
    try:
        report = await Resealer(db, StepSealer(keys, IdempotencyKeys(b"x" * 32))).run(dry_run=dry_run)
    finally:
        await db.dispose()
    return "\n".join(report.lines(keys))


def _reseal(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "abada_engine.main", "reseal", *args],
        env={**clean_environment(), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


async def test_a_retired_key_leaves_the_ring_after_reseal_and_every_step_still_opens(
    shared_database, tmp_path
):
    credentials = tmp_path / "credentials.yaml"
    credentials.write_text("{}\n")
    engine = engine_service(tmp_path, shared_database, credentials)
    key_a, key_b = _ring_entry("ka"), _ring_entry("kb")

    # 1. Key A seals: each task journals a finished model call and begins another.
    engine.service.env["ABADA_JOURNAL_KEYS"] = key_a
    await engine.start()
    try:
        async with engine.channel() as channel:
            api = _api(channel)
            await deploy(api, BUNDLE)
            for _ in range(TASKS):
                await start(api, "rotated")
            tasks = await fetch(api, "w", "abada:agent", max_tasks=TASKS, lease_ms=300_000)
            assert len(tasks) == TASKS
            for n, task in enumerate(tasks):
                await append(api, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0, "case": n})
                await append(
                    api, task, 1, "MODEL_CALL", "COMPLETED", response={"text": f"one {n}"}, tokens=(3, 1)
                )
                await append(api, task, 2, "MODEL_CALL", "STARTED", request={"turn": 1, "case": n})
    finally:
        engine.service.stop()
    assert await _keys_in_use(shared_database) == {("ka", 2): 2 * TASKS}

    # 2. Rotated: B seals, A still opens. The engine finishes steps A sealed (under A, as their rows
    #    are) and begins new ones under B; the first task's second step stays begun for now.
    engine.service.env["ABADA_JOURNAL_KEYS"] = f"{key_b},{key_a}"
    await engine.start()
    try:
        async with engine.channel() as channel:
            api = _api(channel)
            for n, task in enumerate(tasks[1:], 1):
                await append(
                    api, task, 2, "MODEL_CALL", "COMPLETED", response={"text": f"two {n}"}, tokens=(3, 1)
                )
                await append(api, task, 3, "MODEL_CALL", "STARTED", request={"turn": 2, "case": n})
            assert await _keys_in_use(shared_database) == {("ka", 2): 2 * TASKS, ("kb", 2): TASKS - 1}
            # Without the re-seal, a reader that no longer has A cannot open these journals.
            assert await _opens_with(shared_database, key_b, [t.id for t in tasks]) == "JOURNAL_INTEGRITY"

            dry = await _reseal_here(shared_database, f"{key_b},{key_a}", dry_run=True)
            assert f"would re-seal under kb: {2 * TASKS} journal steps (ka (v2): {2 * TASKS})" in dry
            assert await _keys_in_use(shared_database) == {("ka", 2): 2 * TASKS, ("kb", 2): TASKS - 1}

            # The re-seal runs beside the engine, which meanwhile finishes the step A sealed and the
            # re-seal is about to seal again: whichever writes second sees the row changed and
            # reads it again, so the step ends under B either way.
            resealing = asyncio.create_task(asyncio.to_thread(_reseal, dict(engine.service.env)))
            await append(
                api, tasks[0], 2, "MODEL_CALL", "COMPLETED", response={"text": "two 0"}, tokens=(3, 1)
            )
            done = await resealing
            assert done.returncode == 0, done.stdout + done.stderr
            assert f"re-sealed under kb: {2 * TASKS} journal steps (ka (v2): {2 * TASKS})" in done.stdout
            assert "ka (v2): 6" in done.stdout.splitlines()[1]  # the counts per key id before
            assert "(may leave ABADA_JOURNAL_KEYS): ka" in done.stdout
            assert await _keys_in_use(shared_database) == {("kb", 2): 3 * TASKS - 1}

            again = await _reseal_here(shared_database, f"{key_b},{key_a}")
            assert "re-sealed under kb: 0 journal steps" in again
            expected = await _journals(api, tasks)
            assert [s[3] for s in expected[tasks[0].id]] == [{"text": "one 0"}, {"text": "two 0"}]
    finally:
        engine.service.stop()

    # 3. A leaves the ring: every step still opens through the API, and the journal goes on.
    engine.service.env["ABADA_JOURNAL_KEYS"] = key_b
    await engine.start()
    try:
        async with engine.channel() as channel:
            api = _api(channel)
            assert await _journals(api, tasks) == expected
            await append(
                api, tasks[1], 3, "MODEL_CALL", "COMPLETED", response={"text": "three 1"}, tokens=(3, 1)
            )
            [*_, third] = await journal(api, tasks[1].id)
            assert plain(third.response) == {"text": "three 1"}
    finally:
        engine.service.stop()
    assert await _opens_with(shared_database, key_b, [t.id for t in tasks]) == ""
