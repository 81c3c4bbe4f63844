"""The states a row moves through. Every state the engine writes or tests is named here, once.

They are `StrEnum`s: a row's `state` column compares equal to its member, and a member formats as
its value, so statements embed them with f-strings instead of spelling the literals.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from sqlalchemy import literal_column


class TaskState(StrEnum):
    READY = "READY"  # fetchable once due (after a retry backoff, due later)
    LEASED = "LEASED"  # under a lease; fetchable again once the lease runs out
    WAITING = "WAITING"  # a user task, waiting for a person
    INCIDENT = "INCIDENT"  # held by an incident until a person resolves it
    # Parked: its journal holds tool calls waiting for a person's approval. No lease, not fetchable
    # (so the broker can issue no credential for it) until every approval is decided.
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    # Parked: a dependency it needs (its model, a tool server, the broker, the secret store) is down.
    # No lease, not fetchable, until the dependency answers a probe (or its outage budget runs out).
    PARKED = "PARKED"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"
    # An item of a `for_each` waiting for a free place (max_concurrency): not fetchable, no lease.
    PENDING = "PENDING"
    # An item of a `for_each` that failed and was left out (`on_item_failure: skip`): finished.
    SKIPPED = "SKIPPED"


# The queue: the states a fetcher can take a task from (the partial index `tasks_fetchable` covers them).
FETCHABLE = (TaskState.READY, TaskState.LEASED)
# What the queue's listing shows of external tasks: the partial indexes `tasks_open_external*` cover them.
OPEN_EXTERNAL_STATES = (TaskState.READY, TaskState.LEASED, TaskState.INCIDENT, TaskState.PARKED)
# A task in one of these still belongs to a live instance: cancelling the instance cancels it.
OPEN_TASK_STATES = (
    TaskState.READY,
    TaskState.LEASED,
    TaskState.WAITING,
    TaskState.INCIDENT,
    TaskState.AWAITING_APPROVAL,
    TaskState.PARKED,
    TaskState.PENDING,
)


class TaskKind(StrEnum):
    EXTERNAL = "external"
    USER = "user"
    # The token waits on the world, in state WAITING: for its timer's due time, or for a message.
    TIMER = "timer"
    RECEIVE = "receive"


class TimerKind(StrEnum):
    """What a due time in the `timers` table does when it passes."""

    TIMER = "TIMER"  # a timer node's: the token moves on to `next`
    RECEIVE_TIMEOUT = "RECEIVE_TIMEOUT"  # no message came: the token moves to `on_timeout`
    DEADLINE = "DEADLINE"  # the task is withdrawn and the token moves to `on_deadline`


class StepKind(StrEnum):
    MODEL_CALL = "MODEL_CALL"
    TOOL_CALL = "TOOL_CALL"


class StepState(StrEnum):
    STARTED = "STARTED"
    COMPLETED = "COMPLETED"
    FAILED = "FAILED"
    OUTCOME_UNKNOWN = "OUTCOME_UNKNOWN"  # the engine's: a write's lease ran out while it was in flight
    # A proposed call of a tool under approval, never sent; a person's decision moves it on:
    # APPROVED (the engine's; the worker then runs the call at a new sequence), or COMPLETED with
    # the rejection as a tool error.
    AWAITING_APPROVAL = "AWAITING_APPROVAL"
    APPROVED = "APPROVED"


# What a worker may journal; OUTCOME_UNKNOWN and APPROVED are only ever set by the engine.
WORKER_STEP_STATES = (StepState.STARTED, StepState.COMPLETED, StepState.FAILED, StepState.AWAITING_APPROVAL)
# Tool steps that stand for a call without being one: they do not count against max_tool_calls.
PROPOSED_STEP_STATES = (StepState.AWAITING_APPROVAL, StepState.APPROVED)
FINISHED_STEP_STATES = (StepState.COMPLETED, StepState.FAILED)


class InstanceState(StrEnum):
    ACTIVE = "ACTIVE"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"


class FanOutState(StrEnum):
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"  # every item finished; the token moved on
    CANCELED = "CANCELED"


class BatchKind(StrEnum):
    """What a batch does to each of its instances (one function per kind in runtime/batches.py)."""

    RETRY_INCIDENTS = "RETRY_INCIDENTS"
    CANCEL = "CANCEL"


class BatchState(StrEnum):
    RUNNING = "RUNNING"  # the job claims its pending instances
    PAUSED = "PAUSED"  # kept, claimed by nobody until resumed
    COMPLETED = "COMPLETED"  # every instance has its outcome
    CANCELED = "CANCELED"  # ended by an operator; its pending instances stay untouched


class BatchOutcome(StrEnum):
    PENDING = "PENDING"
    DONE = "DONE"
    SKIPPED = "SKIPPED"  # nothing left to do for this instance
    FAILED = "FAILED"  # the operation was refused for this instance


class ApprovalState(StrEnum):
    PENDING = "PENDING"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"  # nobody decided within the node's approval_timeout
    CANCELED = "CANCELED"  # the instance was cancelled while the call waited


class DependencyState(StrEnum):
    """A dependency's circuit."""

    UP = "UP"  # closed: its tasks are fetched as usual
    DOWN = "DOWN"  # open: its tasks are parked until the next probe time
    PROBING = "PROBING"  # half-open: one task is out as the probe


class IncidentState(StrEnum):
    OPEN = "OPEN"
    RESOLVED = "RESOLVED"


def sql_list(states: tuple[StrEnum, ...]) -> str:
    """`('READY', 'LEASED')` for an `IN` inside a hand-written statement (values are our own constants)."""
    return "(" + ", ".join(f"'{state}'" for state in states) + ")"


def one_of(column: Any, states: tuple[StrEnum, ...]) -> Any:
    """`column IN ('READY', 'LEASED')` with the states inline, not as parameters: a prepared statement's
    generic plan can then still use the partial indexes whose predicates name them."""
    return column.in_([literal_column(f"'{state}'") for state in states])


def is_(column: Any, state: StrEnum) -> Any:
    """`column = 'LEASED'` inline, for the same reason as `one_of`."""
    return column == literal_column(f"'{state}'")
