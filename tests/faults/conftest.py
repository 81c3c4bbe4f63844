"""The fault drills' parts: a scratch database on the suite's PostgreSQL, and a running stack per drill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
from collections.abc import Iterator

import asyncpg
import pytest
from fault_stack import alice_script
from scripted_gemini.testing import running_scripted_gemini


@pytest.fixture(scope="module")
def gemini_url() -> Iterator[str]:
    with running_scripted_gemini(alice_script()) as url:
        yield url


@contextlib.contextmanager
def scratch_database(admin_url: str) -> Iterator[str]:
    name = f"abada_fault_{os.getpid()}_{secrets.token_hex(3)}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(admin_url)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    base, _, query = admin_url.partition("?")
    try:
        yield base.rsplit("/", 1)[0] + f"/{name}" + (f"?{query}" if query else "")
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def shared_database() -> Iterator[str]:
    """A fresh database on the suite's PostgreSQL (or an embedded one): for drills that leave it running."""
    admin_url = os.environ.get("ABADA_TEST_DATABASE_URL")
    if admin_url:
        with scratch_database(admin_url) as url:
            yield url
        return
    import pgserver

    with tempfile.TemporaryDirectory(prefix="abada-fault-pg-") as data_dir:
        server = pgserver.get_server(data_dir, cleanup_mode="stop")
        yield server.get_uri()
        server.cleanup()
