"""Moving a token through a process: pure decisions, no I/O.

Given where the token enters and the instance's variables, `advance` walks
through nodes that decide on their own (exclusive gateways, end events) and
stops where the process must wait: an external task, a user task, an incident
or the end. The caller persists what it returns in one transaction.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from abada_engine.definitions.expressions import ExpressionError, evaluate_condition, render, render_prompt
from abada_engine.definitions.model import Node, Process
from abada_engine.runtime.incident_types import (
    CONDITION_FAILED,
    INPUT_MISSING,
    NO_BRANCH_MATCHED,
    TOO_MANY_HOPS,
)
from abada_engine.store.states import TaskKind, TimerKind

# A cycle of gateways that never waits would spin forever; no real process takes this many hops.
MAX_HOPS = 1000


@dataclass(frozen=True)
class HistoryEntry:
    type: str
    node_id: str | None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TimerToSet:
    """A due time set with a task: `delay_seconds` after the move is written (the database's clock), or
    at `at`. `kind` is what firing does (runtime/waits.py)."""

    kind: TimerKind
    delay_seconds: float | None = None
    at: datetime | None = None


@dataclass(frozen=True)
class TaskToCreate:
    node: Node
    kind: TaskKind
    topic: str | None
    payload: dict[str, Any]
    retries: int
    timers: tuple[TimerToSet, ...] = ()


@dataclass(frozen=True)
class IncidentToRaise:
    node_id: str
    type: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    task_id: uuid.UUID | None = None


@dataclass
class Advance:
    current_node_id: str
    history: list[HistoryEntry] = field(default_factory=list)
    task: TaskToCreate | None = None
    incident: IncidentToRaise | None = None
    completed: bool = False


def advance(
    process: Process, variables: dict[str, Any], node_id: str, context: dict[str, Any] | None = None
) -> Advance:
    """Enter `node_id` and keep going until the token has to wait.

    `context` travels into the payload of the first task created (a reviewer
    sees why the output was rejected, for example).
    """
    result = Advance(current_node_id=node_id)
    for _ in range(MAX_HOPS):
        node = process.node(node_id)
        result.current_node_id = node_id
        result.history.append(HistoryEntry("NODE_ENTERED", node_id))
        if node.type == "end":
            result.history.append(HistoryEntry("INSTANCE_COMPLETED", node_id))
            result.completed = True
            return result
        if node.type == "exclusive":
            try:
                chosen = _choose_branch(node, variables)
            except ExpressionError as error:
                result.incident = IncidentToRaise(node_id, CONDITION_FAILED, str(error))
                return result
            if chosen is None:
                result.incident = IncidentToRaise(
                    node_id, NO_BRANCH_MATCHED, f"no branch of {node_id!r} matched and it has no default"
                )
                return result
            condition, target = chosen
            result.history.append(HistoryEntry("BRANCH_TAKEN", node_id, {"when": condition, "next": target}))
            node_id = target
            continue
        try:
            payload = task_payload(node, variables)
            timers = _timers(node, variables)
        except ExpressionError as error:
            result.incident = IncidentToRaise(node_id, INPUT_MISSING, str(error))
            return result
        if context:
            payload["context"] = context
        kind = _TASK_KINDS.get(node.type, TaskKind.EXTERNAL)
        result.task = TaskToCreate(node, kind, node.topic, payload, node.retries, timers)
        return result
    result.incident = IncidentToRaise(node_id, TOO_MANY_HOPS, f"more than {MAX_HOPS} hops without waiting")
    return result


def leave_node(
    process: Process, node: Node, variables: dict[str, Any], written: dict[str, Any]
) -> tuple[dict[str, Any], list[HistoryEntry], Advance]:
    """A task node finished and wrote `written`: the new variables, the history of leaving, and the move on."""
    new_variables = {**variables, **written}
    history = [HistoryEntry("VARIABLE_WRITTEN", node.id, {"name": k, "value": v}) for k, v in written.items()]
    history.append(HistoryEntry("NODE_COMPLETED", node.id))
    assert node.next is not None
    return new_variables, history, advance(process, new_variables, node.next)


def evaluates_conditions(process: Process, node_id: str) -> bool:
    """Whether `advance` into `node_id` evaluates conditions: only a gateway does, and its branches
    lead on from there; any other node creates its task (or ends the instance) at once."""
    return process.node(node_id).type == "exclusive"


_TASK_KINDS = {"user_task": TaskKind.USER, "timer": TaskKind.TIMER, "receive": TaskKind.RECEIVE}


def _timers(node: Node, variables: dict[str, Any]) -> tuple[TimerToSet, ...]:
    """The due times a node's task is created with: a timer's own, a receive's timeout, a deadline."""
    timers: list[TimerToSet] = []
    if node.type == "timer":
        if node.until is not None:
            timers.append(TimerToSet(TimerKind.TIMER, at=until_time(node.until, variables)))
        else:
            timers.append(TimerToSet(TimerKind.TIMER, delay_seconds=node.duration_seconds or 0.0))
    if node.timeout_seconds is not None:
        timers.append(TimerToSet(TimerKind.RECEIVE_TIMEOUT, delay_seconds=node.timeout_seconds))
    if node.deadline_seconds is not None:
        timers.append(TimerToSet(TimerKind.DEADLINE, delay_seconds=node.deadline_seconds))
    return tuple(timers)


def until_time(template: str, variables: dict[str, Any]) -> datetime:
    """The RFC 3339 time a timer's `until` renders to; a time without an offset is refused, not guessed."""
    text = render(template, variables)
    if not isinstance(text, str):
        raise ExpressionError(f"until must give an RFC 3339 time, not {text!r}")
    try:
        at = datetime.fromisoformat(text.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise ExpressionError(f"until gave {text!r}, which is not an RFC 3339 time") from None
    if at.tzinfo is None:
        raise ExpressionError(f"until gave {text!r}, an RFC 3339 time needs an offset (Z or +hh:mm)")
    return at


def correlation_key(node: Node, variables: dict[str, Any]) -> str:
    """The key a message must carry to reach this receive: the template's value, numbers as text."""
    value = render(node.correlation_key, variables)
    if isinstance(value, bool) or not isinstance(value, str | int | float) or value == "":
        raise ExpressionError(f"correlation_key of {node.id!r} gave {value!r}, not a string or number")
    return value if isinstance(value, str) else format(value, "g") if isinstance(value, float) else str(value)


def task_payload(node: Node, variables: dict[str, Any]) -> dict[str, Any]:
    """The resolved inputs (and for agents the rendered prompt) a task carries."""
    if node.type == "timer":
        return {}
    if node.type == "receive":
        assert node.message is not None
        return {"message": node.message, "correlation_key": correlation_key(node, variables)}
    inputs = render(node.inputs, variables) if node.inputs is not None else dict(variables)
    if node.type == "agent":
        # References in a prompt point at inputs; no value is pasted into the instructions.
        prompt, inputs = render_prompt(node.prompt or "", inputs, variables)
        return {"inputs": inputs, "prompt": prompt}
    return {"inputs": inputs}


def _choose_branch(node: Node, variables: dict[str, Any]) -> tuple[str, str] | None:
    for branch in node.branches:
        if evaluate_condition(branch.when, variables):
            return branch.when, branch.next
    if node.default:
        return "default", node.default
    return None
