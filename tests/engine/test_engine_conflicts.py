"""A transaction PostgreSQL rolls back for meeting another one is a refusal to send again, not an
internal error: nothing of it was written."""

from __future__ import annotations

import asyncio

from abada_engine.api.errors import as_refusal
from abada_engine.errors import Category
from abada_sdk.errors import AbadaError
from grpc import StatusCode
from sqlalchemy import text


async def _deadlock(db) -> BaseException:  # type: ignore[no-untyped-def]
    """Two transactions taking two rows in opposite orders: PostgreSQL rolls one of them back."""
    async with db.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS conflict_rows (id int PRIMARY KEY)"))
        await conn.execute(text("INSERT INTO conflict_rows VALUES (1), (2) ON CONFLICT DO NOTHING"))
    both_hold_one = asyncio.Barrier(2)

    async def take(first: int, second: int) -> None:
        async with db.begin() as conn:
            await conn.execute(text("SELECT 1 FROM conflict_rows WHERE id = :i FOR UPDATE"), {"i": first})
            await both_hold_one.wait()
            await conn.execute(text("SELECT 1 FROM conflict_rows WHERE id = :i FOR UPDATE"), {"i": second})

    outcomes = await asyncio.gather(take(1, 2), take(2, 1), return_exceptions=True)
    failures = [o for o in outcomes if isinstance(o, BaseException)]
    assert len(failures) == 1, outcomes
    return failures[0]


async def test_a_deadlock_is_aborted_to_send_again_not_an_internal_error(db):
    error = await _deadlock(db)
    refusal = as_refusal(error, "test", None)
    assert refusal.category is Category.ABORTED
    assert refusal.reason_name == "CONCURRENT_CHANGE"
    assert refusal.retry_after_seconds is not None


async def test_an_unexpected_error_stays_internal():
    refusal = as_refusal(RuntimeError("boom"), "test", None)
    assert (refusal.category, refusal.reason_name) == (Category.INTERNAL, "INTERNAL")


def test_the_sdk_sends_a_call_rolled_back_on_a_conflict_again():
    assert AbadaError("met another change", code=StatusCode.ABORTED, reason="CONCURRENT_CHANGE").transient
    assert not AbadaError("refused", code=StatusCode.FAILED_PRECONDITION, reason="NOT_LEASE_HOLDER").transient
