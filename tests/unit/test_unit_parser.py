"""The bundle parser on its own: no database, no gRPC; each test runs in milliseconds."""

from __future__ import annotations

import pytest
from abada_engine.definitions.durations import iso_duration_seconds
from abada_engine.definitions.model import NODE_KEYS, Node
from abada_engine.definitions.parser import parse_bundle
from abada_engine.errors import EngineError

TRIAGE = """\
tool_servers:
  - name: crm
    transport: streamable-http
    url: http://127.0.0.1:8765/mcp
    credential: crm-token
    tools:
      get_customer:  { policy: read }
      create_ticket: { policy: write, idempotency: key }
processes:
  - id: support_triage
    start: triage
    inputs: { type: object, required: [customerId, message] }
    nodes:
      - id: triage
        type: agent
        model: gemini-3.6-flash
        prompt: Read the message from ${customerId} and open a ticket.
        inputs: { customerId: "${customerId}", message: "${message}" }
        tools: [crm/get_customer, crm/create_ticket]
        result_variable: triage
        output_schema: { type: object, required: [ticketId, priority] }
        confidence_threshold: 80
        outage_budget: PT10M
        next: notify
      - { id: notify, type: service, topic: notify, next: done }
      - { id: done, type: end }
"""


def refused(text: str) -> EngineError:
    with pytest.raises(EngineError) as refusal:
        parse_bundle(text, "triage.yaml")
    return refusal.value


def test_the_reference_bundle_parses_into_its_processes_nodes_and_tools() -> None:
    bundle = parse_bundle(TRIAGE)
    [process] = bundle.processes
    triage = process.node("triage")
    assert (process.id, process.start, list(process.nodes)) == (
        "support_triage",
        "triage",
        ["triage", "notify", "done"],
    )
    assert triage.tools == ("crm/get_customer", "crm/create_ticket")
    assert triage.provider == "gemini" and triage.confidence_threshold == 80.0
    assert triage.outage_budget_seconds == 600
    assert process.input_schema == {"type": "object", "required": ["customerId", "message"]}
    assert bundle.tool_servers["crm"].tools["create_ticket"].idempotency == "key"


def line_with(text: str, needle: str) -> int:
    return next(number for number, line in enumerate(text.splitlines(), 1) if needle in line)


def test_every_problem_is_named_with_its_line_and_field_in_one_refusal() -> None:
    text = TRIAGE.replace("topic: notify", "topic: abada:notify").replace("PT10M", "ten minutes")
    text = text.replace("confidence_threshold: 80", "confidence_threshold: 120")
    refusal = refused(text)
    where = {(problem.field, problem.line) for problem in refusal.problems}
    assert refusal.reason_name == "DEFINITION_INVALID"
    assert where == {
        ("processes[0].nodes[0].confidence_threshold", line_with(text, "confidence_threshold")),
        ("processes[0].nodes[0].outage_budget", line_with(text, "outage_budget")),
        ("processes[0].nodes[1].topic", line_with(text, "abada:notify")),
    }
    assert all(problem.file == "triage.yaml" for problem in refusal.problems)


def test_a_key_a_node_type_does_not_take_is_refused_naming_the_ones_it_does() -> None:
    refusal = refused(TRIAGE.replace("{ id: done, type: end }", "{ id: done, type: end, next: notify }"))
    [problem] = refusal.problems
    assert problem.field == "processes[0].nodes[2].next"
    assert problem.why == "unknown field (expected one of: id, type)"


@pytest.mark.parametrize("node_type", sorted(NODE_KEYS))
def test_the_keys_a_node_takes_are_the_model_fields_of_its_type(node_type: str) -> None:
    keys = NODE_KEYS[node_type]
    assert {"id", "type"} <= keys
    fields_of_node = set(Node.__dataclass_fields__)
    # A YAML key is either a field's own name, the duration it is parsed from, or `as` (a Python
    # keyword: the field is `item_variable`).
    assert {key.removesuffix("_seconds") for key in keys} <= fields_of_node | {
        "outage_budget",
        "approval_timeout",
        "duration",
        "timeout",
        "deadline",
        "as",
    }


def test_aliases_are_refused_before_they_can_expand() -> None:
    refusal = refused("a: &x [1, 2]\nb: *x\n")
    assert "aliases" in refusal.problems[0].why


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("PT10S", 10), ("PT1H30M", 5400), ("P2D", 172_800), ("P1W", 604_800), ("PT0.5S", 0.5)],
)
def test_iso_durations_read_as_seconds(text: str, seconds: float) -> None:
    assert iso_duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["P", "PT", "P1DT", "10s", "P1M2", "P1Y"])
def test_what_is_no_iso_duration_reads_as_none(text: str) -> None:
    assert iso_duration_seconds(text) is None


def test_unique_business_key_is_a_yes_or_no_that_travels_with_the_version() -> None:
    [process] = parse_bundle(
        TRIAGE.replace("    start: triage\n", "    start: triage\n    unique_business_key: true\n")
    ).processes
    assert process.unique_business_key
    assert type(process).from_json(process.to_json()).unique_business_key
    [plain] = parse_bundle(TRIAGE).processes
    # Off by default, and then absent from the frozen spec, so earlier versions keep their digest.
    assert not plain.unique_business_key
    assert "unique_business_key" not in plain.to_json()
    problem = refused(
        TRIAGE.replace("    start: triage\n", '    start: triage\n    unique_business_key: "yes"\n')
    )
    assert "processes[0].unique_business_key: must be true or false" in str(problem.problems[0])


@pytest.mark.parametrize(("text", "seconds"), [("P7D", 7 * 86_400.0), ("PT12H", 43_200.0), ("P0D", 0.0)])
def test_retention_is_an_iso_duration_that_travels_with_the_version(text: str, seconds: float) -> None:
    [process] = parse_bundle(
        TRIAGE.replace("    start: triage\n", f"    start: triage\n    retention: {text}\n")
    ).processes
    assert process.retention_seconds == seconds
    assert type(process).from_json(process.to_json()).retention_seconds == seconds


def test_retention_defaults_to_thirty_days_absent_from_the_frozen_spec() -> None:
    [plain] = parse_bundle(TRIAGE).processes
    assert plain.retention_seconds == 30 * 86_400
    assert "retention_seconds" not in plain.to_json()
    problem = refused(TRIAGE.replace("    start: triage\n", "    start: triage\n    retention: 30 days\n"))
    assert "processes[0].retention: '30 days' is not an ISO-8601 duration" in str(problem.problems[0])


WAITING = """
processes:
  - id: waiting
    start: pause
    nodes:
      - { id: pause, type: timer, duration: PT10S, next: reply }
      - id: reply
        type: receive
        message: customer_reply
        correlation_key: "${ticket.id}"
        timeout: P2D
        on_timeout: escalate
        deadline: P3D
        on_deadline: escalate
        next: done
      - { id: escalate, type: user_task, deadline: PT1H, on_deadline: done, next: done }
      - { id: done, type: end }
"""


def test_timer_and_receive_nodes_parse_with_their_due_times_in_seconds() -> None:
    [process] = parse_bundle(WAITING).processes
    pause, reply, escalate = (process.node(n) for n in ("pause", "reply", "escalate"))
    assert (pause.type, pause.duration_seconds, pause.next) == ("timer", 10, "reply")
    assert (reply.message, reply.correlation_key) == ("customer_reply", "${ticket.id}")
    assert (reply.timeout_seconds, reply.on_timeout) == (172_800, "escalate")
    assert (reply.deadline_seconds, reply.on_deadline) == (259_200, "escalate")
    assert (escalate.deadline_seconds, escalate.on_deadline) == (3600, "done")


@pytest.mark.parametrize(
    ("old", "new", "field", "why"),
    [
        ("duration: PT10S, ", "", "processes[0].nodes[0]", "exactly one of duration"),
        ("duration: PT10S", "duration: PT10S, until: '${x}'", "processes[0].nodes[0]", "exactly one of"),
        ("on_timeout: escalate", "", "processes[0].nodes[1].on_timeout", "is required with timeout"),
        ("deadline: PT1H, ", "", "processes[0].nodes[2].on_deadline", "needs a deadline"),
        ("message: customer_reply", "message: 'no spaces'", "processes[0].nodes[1].message", "message name"),
    ],
)
def test_timer_and_receive_mistakes_are_refused_where_they_are(
    old: str, new: str, field: str, why: str
) -> None:
    refusal = refused(WAITING.replace(old, new, 1))
    assert any(p.field == field and why in p.why for p in refusal.problems), refusal.problems
