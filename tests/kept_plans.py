"""The plan PostgreSQL keeps for a hand-written statement on the engine's hot connections, explained.

The hot connections keep one plan per statement for any values (`store.hand_written.PLANNED_ONCE`).
`EXPLAIN` of the statement text with values would show a plan made for those values instead: the
plan kept is only seen through a prepared statement's `EXECUTE` on a connection set the same way.
The plans test holds every statement's kept plan to index lookups, and `bench/many_in_flight.py
--explain` prints the hot ones; both read it here. It formats SQL from the statement and the values
given, which the engine's own code never does (`test_engine_review_negatives`), so it lives with the
tests, not in the engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

import asyncpg
from abada_engine.store.hand_written import PLANNED_ONCE, HandWritten

_PROBE = "abada_kept_plan_probe"


@contextlib.asynccontextmanager
async def planned_once(conn: asyncpg.Connection) -> AsyncIterator[asyncpg.Connection]:
    """`conn` planning as the hot connections do, until the block ends."""
    for setting, value in PLANNED_ONCE.items():
        await conn.execute(f"SET {setting} = '{value}'")
    try:
        yield conn
    finally:
        for setting in PLANNED_ONCE:
            await conn.execute(f"RESET {setting}")


async def explain_kept_plan(
    conn: asyncpg.Connection,
    statement: HandWritten,
    options: str,
    values: Mapping[str, Any] | None = None,
) -> list[Any]:
    """`EXPLAIN (options)` of the plan `conn` keeps for `statement`, one item a row of its output.

    Without `values` it is executed with NULLs: a plan kept for any values is the same whatever
    they are, so this suffices without ANALYZE. With them (by the statement's parameter names), each
    goes in as a literal quoted by the server, since EXECUTE takes no bound parameters. It runs in a
    transaction (a savepoint in the caller's) that is rolled back, so an ANALYZE writes nothing."""
    await conn.execute(f"PREPARE {_PROBE} AS {statement.sql}")
    try:
        types: list[str] = await conn.fetchval(
            "SELECT parameter_types::text[] FROM pg_prepared_statements WHERE name = $1", _PROBE
        )
        if values is None:
            literals = ["NULL"] * len(types)
        else:
            literals = [
                await conn.fetchval(f"SELECT quote_nullable(CAST(CAST($1 AS {kind}) AS text))", value)
                for kind, value in zip(types, statement.args(values), strict=True)
            ]
        arguments = ", ".join(
            f"CAST({literal} AS {kind})" for literal, kind in zip(literals, types, strict=True)
        )
        probe = conn.transaction()
        await probe.start()
        try:
            rows = await conn.fetch(f"EXPLAIN ({options}) EXECUTE {_PROBE}({arguments})")
        finally:
            await probe.rollback()
    finally:
        # Outside the rolled-back transaction: a failed EXPLAIN cannot hide its error behind this one.
        await conn.execute(f"DEALLOCATE {_PROBE}")
    return [row[0] for row in rows]
