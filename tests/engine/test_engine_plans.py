"""The engine's statements at volume answer from an index: every listing query reads a page of one
(EXPLAIN, no sequential scan, no sort of more than a page), and every hot statement's plan, made once
per connection for any values, looks its rows up by key."""

from __future__ import annotations

import importlib
import json
import pkgutil
import uuid
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from abada_engine import store
from abada_engine.store import approvals as approval_store
from abada_engine.store import definitions as definition_store
from abada_engine.store import incidents as incident_store
from abada_engine.store import instances as instance_store
from abada_engine.store import tasks as task_store
from abada_engine.store.approvals import ApprovalListing
from abada_engine.store.hand_written import HandWritten
from abada_engine.store.incidents import IncidentListing
from abada_engine.store.instances import InstanceListing
from kept_plans import explain_kept_plan, planned_once
from sqlalchemy import event, text
from sqlalchemy.ext.asyncio import AsyncEngine

INSTANCES = 20_000
ACTIVE = 100
PAGE = 50


async def _fill(db: AsyncEngine) -> dict[str, Any]:
    """INSTANCES instances of two processes, nearly all finished, with a task, an incident and an approval
    per ten instances: enough that the planner prefers an index where one fits, and sorts when none does."""
    statements = [
        """INSERT INTO definitions (id, process_id, version, content_sha256, source_name, spec, tool_bindings,
                                    created_at)
           SELECT gen_random_uuid(), p, 1, p, 'x', '{}', '[]', now() FROM unnest(ARRAY['a', 'b']) p""",
        f"""INSERT INTO instances (id, definition_id, process_id, version, state, variables, current_node_id,
                                   business_key, created_at, ended_at)
            SELECT gen_random_uuid(), d.id, d.process_id, 1,
                   CASE WHEN n <= {ACTIVE} THEN 'ACTIVE' WHEN n % 50 = 0 THEN 'CANCELED' ELSE 'COMPLETED' END,
                   jsonb_build_object('customerId', 'C-' || (n % 1000), 'n', n), 'done', 'key-' || n,
                   now() - n * interval '1 second', now()
            FROM generate_series(1, {INSTANCES}) n
            JOIN definitions d ON d.process_id = CASE WHEN n % 2 = 0 THEN 'a' ELSE 'b' END""",
        """INSERT INTO tasks (id, instance_id, node_id, kind, topic, state, payload, attempt, retries_left, due_at,
                              created_at, outage_waits)
           SELECT gen_random_uuid(), i.id, 'work', CASE WHEN i.state = 'ACTIVE' AND i.business_key LIKE '%7'
                                                       THEN 'user' ELSE 'external' END,
                  't' || (abs(hashtext(i.id::text)) % 5),
                  CASE WHEN i.state = 'ACTIVE' AND i.business_key LIKE '%7' THEN 'WAITING'
                       WHEN i.state = 'ACTIVE' THEN 'READY' ELSE 'COMPLETED' END,
                  '{}', 1, 0, now(), i.created_at, 0
           FROM instances i""",
        """INSERT INTO incidents (id, instance_id, task_id, node_id, type, message, details, state, created_at)
           SELECT gen_random_uuid(), t.instance_id, t.id, 'work',
                  CASE WHEN abs(hashtext(t.id::text)) % 20 = 0 THEN 'FAILED_TASK' ELSE 'INVALID_OUTPUT' END, 'm', '{}',
                  CASE WHEN t.state = 'READY' THEN 'OPEN' ELSE 'RESOLVED' END, t.created_at
           FROM tasks t WHERE abs(hashtext(t.id::text)) % 10 = 0 OR t.state = 'READY'""",
        """INSERT INTO journal_steps (task_id, sequence, attempt, kind, state, tool_ref, key_id, aad_version,
                                      input_tokens, output_tokens, abandoned, created_at, updated_at)
           SELECT t.id, 1, 1, 'TOOL_CALL', 'AWAITING_APPROVAL', 'crm/x', 'k', 1, 0, 0, false, now(), now()
           FROM tasks t""",
        """INSERT INTO approvals (id, task_id, sequence, instance_id, node_id, tool_ref, state, created_at)
           SELECT gen_random_uuid(), t.id, 1, t.instance_id, 'work', 'crm/x',
                  CASE WHEN t.state = 'READY' THEN 'PENDING' ELSE 'APPROVED' END, t.created_at
           FROM tasks t WHERE abs(hashtext(t.id::text)) % 10 = 1 OR t.state = 'READY'""",
    ]
    async with db.begin() as conn:
        for statement in statements:
            await conn.execute(text(statement))
    async with db.connect() as conn:
        await conn.execution_options(isolation_level="AUTOCOMMIT")
        await conn.execute(text("ANALYZE definitions, instances, tasks, incidents, journal_steps, approvals"))
        deep = (
            await conn.execute(
                text(
                    "SELECT created_at, id FROM instances ORDER BY created_at DESC, id DESC OFFSET 15000 LIMIT 1"
                )
            )
        ).one()
        task = (
            await conn.execute(text("SELECT created_at, id FROM tasks WHERE state = 'READY' LIMIT 1"))
        ).one()
    return {"deep": (deep.created_at, deep.id), "task": (task.created_at, task.id)}


def _problems(plan: dict[str, Any], limit: int) -> list[str]:
    found = []
    node = plan["Node Type"]
    if node == "Seq Scan" and plan["Relation Name"] != "definitions":
        found.append(f"a sequential scan of {plan['Relation Name']}")
    if node in ("Sort", "Incremental Sort") and plan["Actual Rows"] > limit:
        found.append(f"a sort of {plan['Actual Rows']} rows")
    # An index that yields rows the query then throws away reads more than a page to fill one.
    if plan.get("Rows Removed by Filter", 0) > limit:
        found.append(
            f"{node} on {plan.get('Index Name', '')} read {plan['Rows Removed by Filter']} rows it dropped"
        )
    for child in plan.get("Plans", []):
        found += _problems(child, limit)
    return found


async def test_every_listing_query_reads_one_page_from_an_index_at_volume(engine, db):
    keys = await _fill(db)
    deep: tuple[datetime, uuid.UUID] = keys["deep"]
    after_task: tuple[datetime, uuid.UUID] = keys["task"]
    limit = PAGE + 1
    hour = timedelta(hours=1)
    listings: dict[str, Callable[[Any], Awaitable[Any]]] = {
        "instances": lambda c: instance_store.listed(c, limit=limit),
        "instances, deep": lambda c: instance_store.listed(c, limit=limit, after_key=deep),
        "active instances": lambda c: instance_store.listed(c, InstanceListing(state="ACTIVE"), limit=limit),
        "active instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(state="ACTIVE"), limit=limit, after_key=deep
        ),
        "completed instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(state="COMPLETED"), limit=limit, after_key=deep
        ),
        "canceled instances": lambda c: instance_store.listed(
            c, InstanceListing(state="CANCELED"), limit=limit
        ),
        "one process's instances": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a"), limit=limit
        ),
        "one process's instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a"), limit=limit, after_key=deep
        ),
        "one process's active instances": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a", state="ACTIVE"), limit=limit
        ),
        "one process's completed instances, deep": lambda c: instance_store.listed(
            c, InstanceListing(process_id="a", state="COMPLETED"), limit=limit, after_key=deep
        ),
        "a business key's instances": lambda c: instance_store.listed(
            c, InstanceListing(business_key="key-77"), limit=limit
        ),
        "instances of an hour, deep": lambda c: instance_store.listed(
            c,
            InstanceListing(created_after=deep[0] - hour, created_before=deep[0] + hour),
            limit=limit,
            after_key=deep,
        ),
        "one process's completed instances of an hour, deep": lambda c: instance_store.listed(
            c,
            InstanceListing(process_id="a", state="COMPLETED", created_after=deep[0] - hour),
            limit=limit,
            after_key=deep,
        ),
        "instances with a variable's value": lambda c: instance_store.listed(
            c, InstanceListing(variables_holding={"customerId": "C-77"}), limit=limit
        ),
        "one process's instances with two variables' values": lambda c: instance_store.listed(
            c, InstanceListing(process_id="b", variables_holding={"customerId": "C-77", "n": 77}), limit=limit
        ),
        "completed instances before a time": lambda c: instance_store.listed(
            c, InstanceListing(state="COMPLETED", created_before=deep[0]), limit=limit
        ),
        "one instance": lambda c: instance_store.listed(c, instance_id=deep[1], limit=1),
        "queued tasks": lambda c: task_store.open_external_tasks(c, None, None, limit),
        "queued tasks, after": lambda c: task_store.open_external_tasks(c, None, None, limit, after_task),
        "one topic's queued tasks": lambda c: task_store.open_external_tasks(
            c, "t1", None, limit, after_task
        ),
        "one instance's queued tasks": lambda c: task_store.open_external_tasks(c, None, deep[1], limit),
        "waiting user tasks": lambda c: task_store.waiting_user_tasks(c, None, limit, after_task),
        "open incidents": lambda c: incident_store.listed(c, IncidentListing(state="OPEN"), limit=limit),
        "open incidents of a type, after": lambda c: incident_store.listed(
            c, IncidentListing(state="OPEN", type="FAILED_TASK"), limit=limit, after_key=after_task
        ),
        "resolved incidents": lambda c: incident_store.listed(
            c, IncidentListing(state="RESOLVED"), limit=limit
        ),
        "pending approvals": lambda c: approval_store.listed(
            c, ApprovalListing(state="PENDING"), limit=limit
        ),
        "approved approvals, after": lambda c: approval_store.listed(
            c, ApprovalListing(state="APPROVED"), limit=limit, after_key=(after_task[0], after_task[1], 1)
        ),
        "definitions": lambda c: definition_store.listed(c, limit=limit, after_key=("a", 1)),
    }
    captured: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        captured.append((statement, parameters))

    failures = {}
    for name, run in listings.items():
        captured.clear()
        async with db.connect() as conn:
            # Only this connection's statements: the engine under test shares the connection pool.
            event.listen(conn.sync_connection, "before_cursor_execute", capture)
            await run(conn)
        [(statement, parameters)] = captured
        async with db.connect() as conn:
            raw = (await conn.get_raw_connection()).driver_connection
            plan = await raw.fetchval("EXPLAIN (ANALYZE, FORMAT JSON) " + statement, *parameters)
        problems = _problems(_json(plan)[0]["Plan"], limit)
        if problems:
            failures[name] = problems
    assert failures == {}


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


# The tables `_fill` fills: a plan that reads one of them whole would read thousands of rows per call.
_FILLED = {"instances", "tasks", "incidents", "journal_steps", "approvals"}


def _hand_written() -> dict[str, HandWritten]:
    """Every hand-written statement of the store, by module and name."""
    found: dict[str, HandWritten] = {}
    for module_info in pkgutil.iter_modules(store.__path__):
        module = importlib.import_module(f"{store.__name__}.{module_info.name}")
        for name, value in vars(module).items():
            if isinstance(value, HandWritten) and value not in found.values():
                found[f"{module_info.name}.{name}"] = value
    return found


def _scanned_whole(plan: dict[str, Any]) -> list[str]:
    found = [plan["Relation Name"]] if plan["Node Type"] == "Seq Scan" else []
    for child in plan.get("Plans", []):
        found += _scanned_whole(child)
    return found


async def test_every_hot_statement_planned_once_looks_its_rows_up_by_key_at_volume(engine, db):
    """The hot statements run on connections that keep one plan per statement for any values
    (`PLANNED_ONCE`): that plan, the one made without knowing how many tasks or moves a call carries,
    reads no filled table whole."""
    await _fill(db)
    statements = _hand_written()
    assert {"tasks.LEASE_DUE", "moves.MOVE_TOKENS", "journal_steps.INSERT_CHECKED"} <= statements.keys()
    whole_scans = {}
    async with db.connect() as conn:
        raw = (await conn.get_raw_connection()).driver_connection
        async with planned_once(raw):
            for name, statement in statements.items():
                plan = (await explain_kept_plan(raw, statement, "FORMAT JSON"))[0]
                scanned = sorted(set(_scanned_whole(_json(plan)[0]["Plan"])) & _FILLED)
                if scanned:
                    whole_scans[name] = scanned
    assert whole_scans == {}
