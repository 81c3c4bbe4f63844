"""The incident types the engine itself raises, in one place.

An incident's type decides what an operator may do with it (RETRY on an APPROVAL_TIMEOUT reopens
the task's approvals, HAPPENED on a TOOL_OUTCOME_UNKNOWN journals a write as done). A worker names
its own failures (`Fail.error_code`, which becomes the incident's type when it asks for no retry):
it may never name one of these, or it would choose which of the engine's resolutions an operator's
RETRY runs on a task that never met that situation.
"""

from __future__ import annotations

APPROVAL_TIMEOUT = "APPROVAL_TIMEOUT"
CONDITION_FAILED = "CONDITION_FAILED"
DEPENDENCY_UNAVAILABLE = "DEPENDENCY_UNAVAILABLE"
FAILED_TASK = "FAILED_TASK"
INPUT_MISSING = "INPUT_MISSING"
INVALID_OUTPUT = "INVALID_OUTPUT"
JOURNAL_INTEGRITY = "JOURNAL_INTEGRITY"
LOW_CONFIDENCE = "LOW_CONFIDENCE"
NO_BRANCH_MATCHED = "NO_BRANCH_MATCHED"
TOO_MANY_HOPS = "TOO_MANY_HOPS"
TOOL_OUTCOME_UNKNOWN = "TOOL_OUTCOME_UNKNOWN"

ENGINE_INCIDENT_TYPES = frozenset(
    {
        APPROVAL_TIMEOUT,
        CONDITION_FAILED,
        DEPENDENCY_UNAVAILABLE,
        FAILED_TASK,
        INPUT_MISSING,
        INVALID_OUTPUT,
        JOURNAL_INTEGRITY,
        LOW_CONFIDENCE,
        NO_BRANCH_MATCHED,
        TOO_MANY_HOPS,
        TOOL_OUTCOME_UNKNOWN,
    }
)


def reserved_for_the_engine(error_code: str) -> bool:
    return error_code.strip().upper() in ENGINE_INCIDENT_TYPES
