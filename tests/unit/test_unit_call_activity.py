"""A call node on its own: what the parser keeps of it and what the token's task carries."""

from __future__ import annotations

import pytest
from abada_engine.definitions.parser import parse_bundle
from abada_engine.errors import EngineError
from abada_engine.runtime.flow.navigator import advance
from abada_engine.store.states import TaskKind

CALLS = """\
processes:
  - id: caller
    start: check
    nodes:
      - id: check
        type: call
        process: credit_check
        inputs: { customer: "${applicant}" }
        business_key: "credit-${applicant}"
        result_variable: credit
        next: done
      - { id: done, type: end }
  - id: whole_caller
    start: whole
    nodes:
      - { id: whole, type: call, process: credit_check, version: pinned, next: done }
      - { id: done, type: end }
"""


def test_a_call_waits_in_a_call_task_carrying_the_child_to_start() -> None:
    process = parse_bundle(CALLS).processes[0]
    moved = advance(process, {"applicant": "Ada", "amount": 5}, "check")
    assert moved.task is not None and moved.task.kind is TaskKind.CALL and moved.task.topic is None
    assert moved.task.payload == {
        "process_id": "credit_check",
        "version": 0,
        "variables": {"customer": "Ada"},
        "business_key": "credit-Ada",
    }


def test_without_inputs_the_child_gets_a_copy_of_every_variable_and_the_parents_key() -> None:
    process = parse_bundle(CALLS).processes[1]
    assert process.node("whole").version == "pinned"
    moved = advance(process, {"applicant": "Bo"}, "whole")
    assert moved.task is not None
    assert moved.task.payload["variables"] == {"applicant": "Bo"}
    assert moved.task.payload["business_key"] is None


def test_a_missing_input_is_an_incident_at_the_call() -> None:
    moved = advance(parse_bundle(CALLS).processes[0], {}, "check")
    assert moved.task is None and moved.incident is not None
    assert moved.incident.type == "INPUT_MISSING" and moved.incident.node_id == "check"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("process: credit_check\n        inputs", "processes[0].nodes[0].process"),
        ("version: pinned", "processes[1].nodes[0].version"),
        ("result_variable: credit", "processes[0].nodes[0].result_variable"),
    ],
)
def test_the_parser_names_a_wrong_call_field(change: str, field: str) -> None:
    broken = {
        "process: credit_check\n        inputs": "process: 'not an id'\n        inputs",
        "version: pinned": "version: 3",
        "result_variable: credit": "result_variable: 'bad name'",
    }[change]
    with pytest.raises(EngineError) as refused:
        parse_bundle(CALLS.replace(change, broken))
    assert [p.field for p in refused.value.problems] == [field]
