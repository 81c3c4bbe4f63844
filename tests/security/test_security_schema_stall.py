"""Finding 1: one output could stall schema checking for every tenant.

`uniqueItems` compared every pair of items (4,000 objects took 17 s), a schema could multiply work
without end, the check ran on a thread nobody stopped, and a Complete's output was checked on the
replica's memory of the lease before anyone proved they held it.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import uuid

from abada.engine.v1 import external_task_pb2
from abada_engine.runtime.background.handed_out import HandedOut, LeaseHeld
from engine_helpers import complete, deploy, fetch, start, struct

UNIQUE_LIST = """
processes:
  - id: collect
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: list them
        result_variable: items
        output_schema: { type: array, uniqueItems: true, items: { type: object } }
        on_invalid_output: rejected
        next: done
      - { id: rejected, type: end }
      - { id: done, type: end }
"""

# Every branch fails, so every branch is tried: 2**30 evaluations for the smallest value.
DEPTH = 30
BRANCHING = "\n".join(
    f"            d{i}: {{ anyOf: [{{ $ref: '#/$defs/d{i + 1}' }}, {{ $ref: '#/$defs/d{i + 1}' }}] }}"
    for i in range(DEPTH)
)
EXPONENTIAL = f"""
processes:
  - id: branching
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: answer
        result_variable: answer
        output_schema:
          $ref: '#/$defs/d0'
          $defs:
{BRANCHING}
            d{DEPTH}: {{ type: string }}
        on_invalid_output: rejected
        next: done
      - {{ id: rejected, type: end }}
      - {{ id: done, type: end }}
"""


async def test_ten_thousand_distinct_objects_are_checked_in_one_pass(engine):
    await deploy(engine, UNIQUE_LIST)
    await start(engine, "collect")
    [task] = await fetch(engine, "w", "abada:agent")
    items = [{"id": n, "name": f"item {n}"} for n in range(10_000)]
    # Pairwise comparison needed minutes for this list; a linear check answers well inside a minute.
    done = await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id,
            worker_id="w",
            lease_token=task.lease_token,
            variables=struct({"items": items}),
        ),
        timeout=60,
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
    assert done.next_node_id == "done"


async def test_a_duplicate_is_still_found_by_value(engine):
    await deploy(engine, UNIQUE_LIST)
    await start(engine, "collect")
    [task] = await fetch(engine, "w", "abada:agent")
    items = [{"id": n, "tags": ["a", "b"]} for n in range(3_000)]
    items.append({"tags": ["a", "b"], "id": 1_234.0})  # the same object: keys reordered, 1234 as a float
    done = await complete(engine, task, "w", {"items": items})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "non-unique" in done.reason


async def test_a_check_that_multiplies_work_is_stopped_and_fails_closed(engine):
    await deploy(engine, EXPONENTIAL)
    await start(engine, "branching")
    [task] = await fetch(engine, "w", "abada:agent")
    done = await engine.tasks.Complete(
        external_task_pb2.CompleteRequest(
            task_id=task.id, worker_id="w", lease_token=task.lease_token, variables=struct({"answer": 1})
        ),
        timeout=60,
    )
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "was stopped" in done.reason


def test_a_remembered_lease_serves_only_its_holder():
    """An intruder's Complete neither gets its output checked on memory nor spends the holder's."""
    memory = HandedOut()
    task_id = uuid.uuid4()
    token_hash = hashlib.sha256(b"the holder's token").digest()
    memory.leased(
        LeaseHeld(
            task_id,
            uuid.uuid4(),
            uuid.uuid4(),
            "agent",
            1,
            0,
            dt.datetime.now(dt.UTC) + dt.timedelta(minutes=5),
            {},
            "ACTIVE",
            lease_owner="holder",
            lease_token_hash=token_hash,
        )
    )
    assert memory.take_lease(task_id, "intruder", token_hash) is None
    assert memory.take_lease(task_id, "holder", hashlib.sha256(b"a guess").digest()) is None
    held = memory.take_lease(task_id, "holder", token_hash)
    assert held is not None and held.task_id == task_id
    assert memory.take_lease(task_id, "holder", token_hash) is None  # once per grant
