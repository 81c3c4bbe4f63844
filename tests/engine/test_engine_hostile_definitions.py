"""Bundles and data written to hurt the engine: remote `$ref`, YAML alias bombs, costly conditions and patterns.

Each case is refused with a clear reason (at deploy where the bundle is at fault, as an incident or a
rejected answer where the data is), nothing is fetched, and the engine keeps answering other callers
while it works: the engine runs on this test's event loop, so a heartbeat on the loop sees any stall.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2, process_pb2
from engine_helpers import bad_request, complete, deploy, error_info, fetch, start
from sqlalchemy import text

# A stall the heartbeat must not see; the unfixed engine stalled for many seconds on each case below.
LONGEST_ACCEPTABLE_STALL_SECONDS = 2.0


class _RecordingServer:
    """A real HTTP server on loopback that records every request and serves a schema."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        recorded = self.paths

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                recorded.append(self.path)
                body = json.dumps({"type": "string"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/schema.json"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def schema_server() -> Iterator[_RecordingServer]:
    server = _RecordingServer()
    yield server
    server.close()


class _Heartbeat:
    """Ticks on the event loop every 10 ms and remembers the longest gap between two ticks."""

    def __init__(self) -> None:
        self.longest_gap = 0.0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> _Heartbeat:
        async def beat() -> None:
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                self.longest_gap = max(self.longest_gap, now - last)
                last = now

        self._task = asyncio.create_task(beat())
        await asyncio.sleep(0.02)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def _agent_bundle(schema: str, process_id: str = "hostile") -> str:
    return f"""
processes:
  - id: {process_id}
    start: agent
    nodes:
      - id: agent
        type: agent
        model: gemini-m
        prompt: decide
        result_variable: answer
        output_schema: {schema}
        on_invalid_output: review
        next: done
      - {{ id: review, type: user_task, next: done }}
      - {{ id: done, type: end }}
"""


async def _refusal(engine, bundle: str) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await deploy(engine, bundle, "hostile.yaml")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).reason == "DEFINITION_INVALID"
    return caught.value


# --- item 1: references -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["remote", "file"])
async def test_a_non_local_ref_is_refused_at_deploy_with_file_line_and_field(engine, schema_server, where):
    target = schema_server.url if where == "remote" else "file:///etc/passwd"
    error = await _refusal(
        engine, _agent_bundle(f'{{ type: object, properties: {{ x: {{ $ref: "{target}" }} }} }}')
    )
    field = "processes[0].nodes[0].output_schema"
    assert error.details().startswith(f"hostile.yaml:11: {field}: ")
    assert "properties/x/$ref" in error.details() and "outside the schema" in error.details()
    assert error_info(error).metadata["field"] == field
    assert schema_server.paths == []


async def test_a_local_ref_still_validates(engine):
    schema = "{ $defs: { id: { type: string, pattern: '^T-[0-9]+$' } }, type: object, properties: { ticketId: { $ref: '#/$defs/id' } }, required: [ticketId] }"
    await deploy(engine, _agent_bundle(schema))
    await start(engine, "hostile")
    [task] = await fetch(engine, "w", "abada:agent")
    done = await complete(engine, task, "w", {"answer": {"ticketId": "X-1"}})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "does not match" in done.reason
    await start(engine, "hostile")
    [task] = await fetch(engine, "w", "abada:agent")
    done = await complete(engine, task, "w", {"answer": {"ticketId": "T-981"}})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED


async def test_a_frozen_definition_with_a_remote_ref_fetches_nothing_at_complete(engine, db, schema_server):
    """A definition frozen before deploy refused references: Complete fails closed, no request goes out."""
    deployed = await deploy(engine, _agent_bundle("{ type: object }"))
    [definition] = deployed.definitions
    async with db.begin() as conn:
        row = (
            await conn.execute(
                text("SELECT spec, tool_bindings FROM definitions WHERE id = :id"), {"id": definition.id}
            )
        ).one()
        spec = row.spec
        spec["nodes"][0]["output_schema"] = {
            "type": "object",
            "properties": {"x": {"$ref": schema_server.url}},
        }
        await conn.execute(
            text(
                "INSERT INTO definitions (id, process_id, version, content_sha256, source_name, spec, "
                "tool_bindings, created_at) VALUES (:id, 'hostile', 2, :sha, 'old.yaml', CAST(:spec AS jsonb), "
                "CAST(:bindings AS jsonb), now())"
            ),
            {
                "id": uuid.uuid4(),
                "sha": "0" * 64,
                "spec": json.dumps(spec),
                "bindings": json.dumps(row.tool_bindings),
            },
        )
    await start(engine, "hostile")
    [task] = await fetch(engine, "w", "abada:agent")
    done = await complete(engine, task, "w", {"answer": {"x": 1}})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "not resolved" in done.reason
    assert schema_server.paths == []


# --- item 4: YAML aliases -----------------------------------------------------------------------


async def test_yaml_aliases_are_refused_before_they_expand(engine):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 5):
        levels.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * 9) + "]")
    bomb = "\n".join(levels) + "\nprocesses: []\n"  # 9^5 = 59,049 strings once expanded, 300 bytes here
    async with _Heartbeat() as heartbeat:
        error = await _refusal(engine, bomb)
    assert error.details().startswith("hostile.yaml:2: (bundle): aliases (*name) are not allowed")
    assert heartbeat.longest_gap < LONGEST_ACCEPTABLE_STALL_SECONDS


async def test_a_merge_key_is_an_alias_too(engine):
    bundle = "base: &base { type: end }\nprocesses:\n  - id: p\n    start: done\n    nodes:\n      - { <<: *base, id: done }\n"
    error = await _refusal(engine, bundle)
    assert "aliases" in error.details() and error_info(error).metadata["line"] == "6"


async def test_a_big_bundle_is_parsed_off_the_event_loop(engine):
    """Within the node cap a bundle still takes a while to read (pure-Python YAML): other calls are
    served meanwhile. Measured against the deploy's own time, so a slow machine does not decide."""
    big = "processes: []\nnotes: [" + ", ".join(["a note long enough to take scanning time"] * 15_000) + "]\n"
    async with _Heartbeat() as heartbeat:
        began = time.monotonic()
        await _refusal(engine, big)
        took = time.monotonic() - began
    # On the event loop the longest gap would be the whole parse, most of `took`; off it, the loop
    # still waits its turns for the interpreter beside the parsing thread, longer on a loaded machine
    # (a third of `took` was passed once under the suite's other process), never most of it.
    assert heartbeat.longest_gap < min(LONGEST_ACCEPTABLE_STALL_SECONDS, took / 2), (
        heartbeat.longest_gap,
        took,
    )


@pytest.mark.parametrize("form", ["scalar", "sequence"])
async def test_a_python_tag_constructs_nothing(engine, tmp_path, form):
    """The review's negative finding stays true: bundles are read with SafeLoader, no tag runs code."""
    marker = tmp_path / "ran"
    argument = f"'touch {marker}'" if form == "scalar" else f"['touch {marker}']"
    await _refusal(engine, f"processes: !!python/object/apply:os.system {argument}\n")
    assert not marker.exists()


# --- item 5: conditions -------------------------------------------------------------------------

_GATEWAY = """
processes:
  - id: gate
    start: choose
    nodes:
      - id: choose
        type: exclusive
        branches:
          - when: '{when}'
            next: hit
        default: miss
      - {{ id: hit, type: end }}
      - {{ id: miss, type: end }}
"""


@pytest.mark.parametrize(
    ("when", "why"),
    [
        ("a.all(x, x.all(y, y.all(z, z > 0)))", "nests comprehensions"),
        ("a.exists(x, " * 1 + "(" * 14 + "x" + ")" * 14 + " > 0)", "nests deeper than"),
        ("a == 1 || " * 120 + "true", "longer than 1000 characters"),
    ],
)
async def test_a_costly_condition_is_refused_at_deploy(engine, when, why):
    error = await _refusal(engine, _GATEWAY.format(when=when))
    assert why in error.details()
    assert error_info(error).metadata["field"] == "processes[0].nodes[0].branches[0].when"


async def _incident(engine, instance_id: str) -> incident_pb2.Incident:
    listed = await engine.incidents.ListIncidents(incident_pb2.ListIncidentsRequest(instance_id=instance_id))
    [incident] = listed.incidents
    return incident


async def test_a_condition_over_a_huge_variable_becomes_an_incident_without_stalling(engine):
    await deploy(engine, _GATEWAY.format(when="items.exists(x, x == -1)"))
    async with _Heartbeat() as heartbeat:
        started = await start(engine, "gate", items=list(range(100_000)))
    incident = await _incident(engine, started.id)
    assert (incident.type, incident.node_id) == ("CONDITION_FAILED", "choose")
    assert "more than 10000 values" in incident.message
    assert heartbeat.longest_gap < LONGEST_ACCEPTABLE_STALL_SECONDS


async def test_a_slow_condition_is_stopped_at_its_budget_and_others_are_served_meanwhile(engine):
    await deploy(engine, _GATEWAY.format(when="items.all(x, items.all(y, x + y >= 0))"))
    async with _Heartbeat() as heartbeat:
        slow = asyncio.create_task(start(engine, "gate", items=list(range(300))))
        # Served while the condition is being evaluated: the evaluation is not on the event loop.
        listed = await engine.processes.ListInstances(process_pb2.ListInstancesRequest())
        assert not slow.done()
        started = await slow
    assert len(listed.instances) <= 1
    incident = await _incident(engine, started.id)
    assert incident.type == "CONDITION_FAILED"
    assert "budget" in incident.message
    assert heartbeat.longest_gap < LONGEST_ACCEPTABLE_STALL_SECONDS


async def test_conditions_within_the_limits_still_decide(engine):
    await deploy(engine, _GATEWAY.format(when='items.exists(x, x.tags.exists(t, t == "vip"))'))
    started = await start(engine, "gate", items=[{"tags": ["a"]}, {"tags": ["vip"]}])
    shown = await engine.processes.GetInstance(process_pb2.GetInstanceRequest(instance_id=started.id))
    assert shown.instance.current_node_id == "hit"


# --- item 5: patterns and sizes -----------------------------------------------------------------


async def test_a_backtracking_pattern_runs_in_linear_time(engine):
    await deploy(engine, _agent_bundle("{ type: string, pattern: '^([a-z]+ ?)+$' }"))
    await start(engine, "hostile")
    [task] = await fetch(engine, "w", "abada:agent")
    async with _Heartbeat() as heartbeat:
        # 29 characters: Python's `re` backtracks for about 12 s here (x4 for every two more).
        done = await complete(engine, task, "w", {"answer": "a" * 28 + "!"})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "does not match" in done.reason
    assert heartbeat.longest_gap < LONGEST_ACCEPTABLE_STALL_SECONDS


async def test_backtracking_pattern_properties_and_additional_properties_run_in_linear_time(engine):
    schema = "{ type: object, patternProperties: { '^([a-z]+ ?)+$': { type: integer } }, additionalProperties: false }"
    await deploy(engine, _agent_bundle(schema))
    await start(engine, "hostile")
    [task] = await fetch(engine, "w", "abada:agent")
    done = await complete(engine, task, "w", {"answer": {"a" * 28 + "!": 1, "ok": "x"}})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_INVALID_OUTPUT_ROUTED
    assert "Additional properties" in done.reason or "not of type" in done.reason


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        (
            "{ type: string, pattern: '(?=a)b' }",
            "pattern: '(?=a)b' is not a pattern this engine runs in linear time",
        ),
        (
            "{ type: object, patternProperties: { '^x': {} }, unevaluatedProperties: false }",
            "patternProperties cannot be combined with unevaluatedProperties",
        ),
    ],
)
async def test_a_pattern_without_a_linear_time_engine_is_refused_at_deploy(engine, schema, why):
    error = await _refusal(engine, _agent_bundle(schema))
    assert why in error.details()
    assert any(why in line for line in bad_request(error))


async def test_complete_refuses_variables_over_the_size_limit(engine):
    await deploy(engine, _agent_bundle("{ type: string }"))
    await start(engine, "hostile")
    [task] = await fetch(engine, "w", "abada:agent")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await complete(engine, task, "w", {"answer": "x" * 1_100_000})
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_info(caught.value).metadata["field"] == "variables"
    # Nothing changed: the same lease still completes.
    done = await complete(engine, task, "w", {"answer": "fine"})
    assert done.outcome == external_task_pb2.COMPLETE_OUTCOME_ADVANCED
