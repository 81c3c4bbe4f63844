"""Finding 8: `abada-engine reseal` went on after seeing a misordered ring.

With the engines still sealing under k2 and the re-seal run with "k1,k2" (the old key first, or a
ring that is not the engines'), it re-sealed everything under k1, and an engine without k1 then
answered GetJournal with DATA_LOSS. It now refuses, changing nothing, unless forced.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys

from abada_engine.runtime.crypto.keys import IdempotencyKeys, KeyRing
from abada_engine.runtime.crypto.reseal import Resealer
from abada_engine.runtime.crypto.sealing import StepSealer
from engine_helpers import ONE_AGENT_TASK, append, deploy, fetch, journal, start
from sqlalchemy import text

K1 = "k1:" + base64.b64encode(b"\x01" * 32).decode()
K2 = "k2:" + base64.b64encode(b"\x02" * 32).decode()


async def _keys_in_use(db) -> set[str]:
    async with db.connect() as conn:
        return set((await conn.execute(text("SELECT DISTINCT key_id FROM journal_steps"))).scalars().all())


async def _a_step_sealed_by_the_engine(engine) -> str:
    """The test engine's ring is "k2,k1": its steps are sealed under k2."""
    await deploy(engine, ONE_AGENT_TASK)
    await start(engine, "think")
    [task] = await fetch(engine, "w", "abada:agent")
    await append(engine, task, 1, "MODEL_CALL", "STARTED", request={"turn": 0})
    return task.id


async def test_a_misordered_ring_is_refused_and_nothing_changes(engine, db):
    task_id = await _a_step_sealed_by_the_engine(engine)
    misordered = KeyRing.parse(f"{K1},{K2}")
    report = await Resealer(db, StepSealer(misordered, IdempotencyKeys(b"x" * 32))).run()
    assert report.refused
    assert any(
        line.startswith("refused: the newest journal step is sealed under k2")
        for line in report.lines(misordered)
    )
    assert await _keys_in_use(db) == {"k2"}
    assert len(await journal(engine, task_id)) == 1  # the running engine still opens its journal


async def test_forced_it_goes_on(engine, db):
    await _a_step_sealed_by_the_engine(engine)
    misordered = KeyRing.parse(f"{K1},{K2}")
    report = await Resealer(db, StepSealer(misordered, IdempotencyKeys(b"x" * 32))).run(force=True)
    assert not report.refused and report.done
    assert await _keys_in_use(db) == {"k1"}


async def test_the_command_exits_non_zero_without_force(engine, db, database_url, tmp_path):
    await _a_step_sealed_by_the_engine(engine)
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "abada_engine.main", "reseal"],
        env={
            "PATH": os.environ.get("PATH", ""),
            "ABADA_DATABASE_URL": database_url,
            "ABADA_JOURNAL_KEYS": f"{K1},{K2}",
            "ABADA_STATE_DIR": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "run again with --force" in done.stdout
    assert await _keys_in_use(db) == {"k2"}
