"""Moving a token through a process, on its own: no database, no gRPC."""

from __future__ import annotations

from abada_engine.definitions.parser import parse_bundle
from abada_engine.runtime.flow.navigator import advance, leave_node
from abada_engine.store.states import TaskKind

ROUTED = """\
processes:
  - id: route
    start: decide
    nodes:
      - id: decide
        type: exclusive
        branches:
          - { when: "amount > 100", next: review }
          - { when: "amount > 0", next: pay }
      - { id: review, type: user_task, inputs: { amount: "${amount}" }, next: pay }
      - { id: pay, type: service, topic: payments, inputs: { amount: "${amount}" }, next: done }
      - { id: done, type: end }
"""


def route():  # type: ignore[no-untyped-def]
    return parse_bundle(ROUTED).processes[0]


def test_a_gateway_takes_the_first_branch_that_holds_and_the_token_waits_at_the_next_task() -> None:
    moved = advance(route(), {"amount": 500}, "decide")
    assert moved.current_node_id == "review"
    assert moved.task is not None and moved.task.kind is TaskKind.USER
    assert moved.task.payload == {"inputs": {"amount": 500}}
    assert [entry.type for entry in moved.history] == ["NODE_ENTERED", "BRANCH_TAKEN", "NODE_ENTERED"]


def test_no_branch_matching_and_no_default_is_an_incident_not_a_guess() -> None:
    moved = advance(route(), {"amount": 0}, "decide")
    assert moved.task is None and moved.incident is not None
    assert moved.incident.type == "NO_BRANCH_MATCHED" and moved.incident.node_id == "decide"


def test_a_condition_over_a_missing_variable_is_an_incident() -> None:
    moved = advance(route(), {}, "decide")
    assert moved.incident is not None and moved.incident.type == "CONDITION_FAILED"


def test_a_task_left_with_written_variables_moves_on_and_the_end_completes_the_instance() -> None:
    process = route()
    variables, history, moved = leave_node(process, process.node("pay"), {"amount": 5}, {"paid": True})
    assert variables == {"amount": 5, "paid": True}
    assert [entry.type for entry in history] == ["VARIABLE_WRITTEN", "NODE_COMPLETED"]
    assert moved.completed and moved.current_node_id == "done"


def test_an_input_reference_to_a_missing_variable_is_an_incident_at_the_task() -> None:
    moved = advance(route(), {"amount": 5, "other": 1}, "pay")
    assert moved.task is not None
    missing = advance(route(), {"other": 1}, "pay")
    assert missing.task is None and missing.incident is not None and missing.incident.type == "INPUT_MISSING"


WAITING = """\
processes:
  - id: wait
    start: pause
    nodes:
      - { id: pause, type: timer, until: "${at}", next: reply }
      - id: reply
        type: receive
        message: reply
        correlation_key: "${order.id}"
        timeout: PT30S
        on_timeout: done
        deadline: PT1M
        on_deadline: done
        next: done
      - { id: done, type: end }
"""


def test_a_timer_waits_until_its_rfc3339_time_and_refuses_one_without_an_offset() -> None:
    process = parse_bundle(WAITING).processes[0]
    moved = advance(process, {"at": "2026-12-05T09:00:00+01:00"}, "pause")
    assert moved.task is not None and moved.task.kind is TaskKind.TIMER
    [timer] = moved.task.timers
    assert timer.at is not None and timer.at.isoformat() == "2026-12-05T09:00:00+01:00"
    for wrong in ("2026-12-05T09:00:00", "tomorrow", 1733389200):
        refused = advance(process, {"at": wrong}, "pause")
        assert refused.task is None and refused.incident is not None
        assert refused.incident.type == "INPUT_MISSING"


def test_a_receive_waits_for_its_key_with_its_timeout_and_deadline() -> None:
    process = parse_bundle(WAITING).processes[0]
    moved = advance(process, {"order": {"id": 7031}}, "reply")
    assert moved.task is not None and moved.task.kind is TaskKind.RECEIVE
    assert moved.task.payload == {"message": "reply", "correlation_key": "7031"}
    assert [(t.kind.value, t.delay_seconds) for t in moved.task.timers] == [
        ("RECEIVE_TIMEOUT", 30),
        ("DEADLINE", 60),
    ]
    missing = advance(process, {}, "reply")
    assert missing.incident is not None and missing.task is None
