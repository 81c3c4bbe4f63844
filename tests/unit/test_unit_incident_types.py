"""Incident types are declared once (the IncidentType enum) and each is documented for operators."""

from __future__ import annotations

import pathlib
import re

from abada.engine.v1.incident_type_pb2 import IncidentType
from abada_engine.runtime import incident_types

OPERATIONS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def declared() -> set[str]:
    return {
        incident_types.type_name(value)
        for value in IncidentType.values()
        if value != IncidentType.INCIDENT_TYPE_UNSPECIFIED
    }


def test_every_incident_type_has_a_row_saying_what_happened_and_what_to_do() -> None:
    rows = re.findall(r"^\| `([A-Z_]+)` \|", OPERATIONS.read_text(), flags=re.MULTILINE)
    assert declared() <= set(rows), declared() - set(rows)


def test_the_types_the_engine_keeps_for_itself_are_declared_and_failed_task_is_not_kept() -> None:
    assert incident_types.ENGINE_INCIDENT_TYPES < declared()
    assert incident_types.TOOL_OUTCOME_UNKNOWN in incident_types.ENGINE_INCIDENT_TYPES
    # A worker that failed a task without a type of its own names FAILED_TASK, the type retries end in.
    assert not incident_types.reserved_for_the_engine(incident_types.FAILED_TASK)
    assert incident_types.reserved_for_the_engine(" approval_timeout ")
