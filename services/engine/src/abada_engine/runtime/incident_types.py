"""The incident types the engine itself raises, in one place.

An incident's type decides what an operator may do with it (RETRY on an APPROVAL_TIMEOUT reopens
the task's approvals, HAPPENED on a TOOL_OUTCOME_UNKNOWN journals a write as done). A worker names
its own failures (`Fail.error_code`, which becomes the incident's type when it asks for no retry):
it may never name one of these, or it would choose which of the engine's resolutions an operator's
RETRY runs on a task that never met that situation.
"""

from __future__ import annotations

from abada.engine.v1.incident_type_pb2 import IncidentType


def type_name(value: IncidentType) -> str:
    """An incident's type as `Incident.type` carries it: the enum value's name without its prefix."""
    return IncidentType.Name(value).removeprefix("INCIDENT_TYPE_")


APPROVAL_TIMEOUT = type_name(IncidentType.INCIDENT_TYPE_APPROVAL_TIMEOUT)
CONDITION_FAILED = type_name(IncidentType.INCIDENT_TYPE_CONDITION_FAILED)
DEPENDENCY_UNAVAILABLE = type_name(IncidentType.INCIDENT_TYPE_DEPENDENCY_UNAVAILABLE)
FAILED_TASK = type_name(IncidentType.INCIDENT_TYPE_FAILED_TASK)
FOR_EACH_NOT_A_LIST = type_name(IncidentType.INCIDENT_TYPE_FOR_EACH_NOT_A_LIST)
INPUT_MISSING = type_name(IncidentType.INCIDENT_TYPE_INPUT_MISSING)
INVALID_OUTPUT = type_name(IncidentType.INCIDENT_TYPE_INVALID_OUTPUT)
JOURNAL_INTEGRITY = type_name(IncidentType.INCIDENT_TYPE_JOURNAL_INTEGRITY)
LOW_CONFIDENCE = type_name(IncidentType.INCIDENT_TYPE_LOW_CONFIDENCE)
NO_BRANCH_MATCHED = type_name(IncidentType.INCIDENT_TYPE_NO_BRANCH_MATCHED)
TOO_MANY_HOPS = type_name(IncidentType.INCIDENT_TYPE_TOO_MANY_HOPS)
TOOL_OUTCOME_UNKNOWN = type_name(IncidentType.INCIDENT_TYPE_TOOL_OUTCOME_UNKNOWN)
TOO_MANY_ITEMS = type_name(IncidentType.INCIDENT_TYPE_TOO_MANY_ITEMS)

# The types a worker may not name: each has resolutions of its own (FAILED_TASK has only the
# generic RETRY and CANCEL, so a worker that failed a task without a type of its own may name it).
ENGINE_INCIDENT_TYPES = frozenset(
    {
        APPROVAL_TIMEOUT,
        CONDITION_FAILED,
        DEPENDENCY_UNAVAILABLE,
        FOR_EACH_NOT_A_LIST,
        INPUT_MISSING,
        INVALID_OUTPUT,
        JOURNAL_INTEGRITY,
        LOW_CONFIDENCE,
        NO_BRANCH_MATCHED,
        TOO_MANY_HOPS,
        TOOL_OUTCOME_UNKNOWN,
        TOO_MANY_ITEMS,
    }
)


def reserved_for_the_engine(error_code: str) -> bool:
    return error_code.strip().upper() in ENGINE_INCIDENT_TYPES
