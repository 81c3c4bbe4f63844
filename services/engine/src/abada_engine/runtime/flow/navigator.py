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
    FOR_EACH_NOT_A_LIST,
    INPUT_MISSING,
    NO_BRANCH_MATCHED,
    TOO_MANY_HOPS,
    TOO_MANY_ITEMS,
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
class FanOutToStart:
    """A `for_each` node entered: one task per item, each with its own payload (the node's inputs with
    the item under the node's `as`), the first `max_concurrency` of them offered at once."""

    node: Node
    kind: TaskKind
    topic: str | None
    retries: int
    payloads: list[dict[str, Any]]


@dataclass(frozen=True)
class IncidentToRaise:
    node_id: str
    type: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    task_id: uuid.UUID | None = None

    def raised(self, incident_id: uuid.UUID, noted: dict[str, Any] | None = None) -> HistoryEntry:
        """The INCIDENT_RAISED history line, with what `noted` adds."""
        data = {"incident_id": str(incident_id), "type": self.type, "message": self.message}
        return HistoryEntry("INCIDENT_RAISED", self.node_id, {**data, **noted} if noted else data)


@dataclass
class Advance:
    current_node_id: str
    history: list[HistoryEntry] = field(default_factory=list)
    task: TaskToCreate | None = None
    incident: IncidentToRaise | None = None
    completed: bool = False
    # A `parallel` forked: one Advance per branch that rests at a task or an incident (the token that
    # entered the fork is gone; a branch that reached the join in the same move is not here).
    forked: list[Advance] = field(default_factory=list)
    # The token reached a `join` that still waits for other branches: it ends here, resting nowhere.
    joined: bool = False
    # The token passed a `join` with `wait_for: any`: the other branches' tasks are withdrawn.
    withdraw_other_branches: bool = False
    # The token rests at a `for_each` node: its items' tasks (instead of `task`).
    fan_out: FanOutToStart | None = None
    # Variables the walk itself wrote (a `for_each` over an empty list collects []), merged into the
    # instance's by whoever writes the move.
    written: dict[str, Any] = field(default_factory=dict)


class JoinNeedsTokens(Exception):
    """`advance` reached a join without being told how many other tokens are live: the caller reads
    them (under the instance's version guard) and asks again."""

    def __init__(self, join_id: str) -> None:
        super().__init__(f"the join {join_id!r} is decided on the instance's live tokens")
        self.join_id = join_id


# `tokens_elsewhere` inside a fork: stop at the join, the fork decides it for all its branches at once.
_IN_FORK = -1


def advance(
    process: Process,
    variables: dict[str, Any],
    node_id: str,
    context: dict[str, Any] | None = None,
    *,
    tokens_elsewhere: int | None = None,
) -> Advance:
    """Enter `node_id` and keep going until the token has to wait.

    `context` travels into the payload of the first task created (a reviewer
    sees why the output was rejected, for example). `tokens_elsewhere` is how many other tokens of the
    instance are live (resting at a task or an incident), needed only when the token reaches a join;
    without it a join raises `JoinNeedsTokens`.
    """
    result = Advance(current_node_id=node_id)
    _walk(process, variables, node_id, context, result, tokens_elsewhere)
    return result


def _walk(
    process: Process,
    variables: dict[str, Any],
    node_id: str,
    context: dict[str, Any] | None,
    result: Advance,
    tokens_elsewhere: int | None,
) -> None:
    for _ in range(MAX_HOPS):
        node = process.node(node_id)
        result.current_node_id = node_id
        result.history.append(HistoryEntry("NODE_ENTERED", node_id))
        if node.type == "join":
            if tokens_elsewhere == _IN_FORK:
                return
            if tokens_elsewhere is None:
                raise JoinNeedsTokens(node_id)
            if node.wait_for == "any":
                result.withdraw_other_branches = tokens_elsewhere > 0
                result.history.append(HistoryEntry("JOIN_PASSED", node_id, {"wait_for": "any"}))
            elif tokens_elsewhere > 0:
                result.joined = True
                result.history.append(
                    HistoryEntry("JOIN_WAITING", node_id, {"branches_left": tokens_elsewhere})
                )
                return
            else:
                result.history.append(HistoryEntry("JOIN_PASSED", node_id, {"wait_for": "all"}))
            assert node.next is not None
            node_id = node.next
            tokens_elsewhere = None
            continue
        if node.type == "parallel":
            passed_to = _fork(process, variables, node, context, result)
            if passed_to is None:
                return
            node_id = passed_to
            continue
        if node.type == "end":
            result.history.append(HistoryEntry("INSTANCE_COMPLETED", node_id))
            result.completed = True
            return
        if node.type == "exclusive":
            try:
                chosen = _choose_branch(node, variables)
            except ExpressionError as error:
                result.incident = IncidentToRaise(node_id, CONDITION_FAILED, str(error))
                return
            if chosen is None:
                result.incident = IncidentToRaise(
                    node_id, NO_BRANCH_MATCHED, f"no branch of {node_id!r} matched and it has no default"
                )
                return
            condition, target = chosen
            result.history.append(HistoryEntry("BRANCH_TAKEN", node_id, {"when": condition, "next": target}))
            node_id = target
            continue
        kind = _TASK_KINDS.get(node.type, TaskKind.EXTERNAL)
        if node.fans_out:
            passed_to = _fan_out(node, kind, variables, context, result)
            if passed_to is None:
                return
            variables = {**variables, **result.written}
            node_id = passed_to
            continue
        try:
            payload = task_payload(node, variables)
            timers = _timers(node, variables)
        except ExpressionError as error:
            result.incident = IncidentToRaise(node_id, INPUT_MISSING, str(error))
            return
        if context:
            payload["context"] = context
        result.task = TaskToCreate(node, kind, node.topic, payload, node.retries, timers)
        return
    result.incident = IncidentToRaise(node_id, TOO_MANY_HOPS, f"more than {MAX_HOPS} hops without waiting")


def _fan_out(
    node: Node, kind: TaskKind, variables: dict[str, Any], context: dict[str, Any] | None, result: Advance
) -> str | None:
    """Enter a `for_each` node: its items' tasks, or an incident naming the node when the list is not
    one or is too long. An empty list has nothing to wait for: it collects [] and answers the next
    node (else None: the token rests at the items)."""
    assert node.for_each is not None and node.item_variable is not None
    try:
        items = render(node.for_each, variables)
    except ExpressionError as error:
        result.incident = IncidentToRaise(node.id, INPUT_MISSING, f"for_each of {node.id!r}: {error}")
        return None
    if not isinstance(items, list):
        result.incident = IncidentToRaise(
            node.id,
            FOR_EACH_NOT_A_LIST,
            f"for_each of {node.id!r} gave {_kind(items)}, not a list",
            {"for_each": node.for_each},
        )
        return None
    if len(items) > node.item_limit:
        result.incident = IncidentToRaise(
            node.id,
            TOO_MANY_ITEMS,
            f"for_each of {node.id!r} gave {len(items)} items, more than its max_items {node.item_limit}",
            {"for_each": node.for_each, "items": len(items), "max_items": node.item_limit},
        )
        return None
    if not items:
        if node.collect:
            result.written[node.collect] = []
        result.history.append(HistoryEntry("FAN_OUT_COMPLETED", node.id, {"items": 0}))
        assert node.next is not None
        return node.next
    payloads: list[dict[str, Any]] = []
    shared = variables
    if node.inputs is None:
        # Without `inputs` each item carries a copy of the instance's variables: all but the list it
        # iterates, which would make n copies of n items.
        iterated = _bare_reference(node.for_each or "")
        shared = {name: value for name, value in variables.items() if name != iterated}
    for index, item in enumerate(items):
        try:
            payload = task_payload(node, {**shared, node.item_variable: item})
        except ExpressionError as error:
            result.incident = IncidentToRaise(
                node.id, INPUT_MISSING, f"item {index} of {node.id!r}: {error}", {"item_index": index}
            )
            return None
        if context:
            payload["context"] = context
        payloads.append(payload)
    result.fan_out = FanOutToStart(node, kind, node.topic, node.retries, payloads)
    return None


def _bare_reference(template: str) -> str | None:
    """The variable a template names when it is nothing but `${name}`, else None."""
    inner = template.strip()
    if inner.startswith("${") and inner.endswith("}"):
        name = inner[2:-1].strip()
        if name.isidentifier():
            return name
    return None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "an object", str: "a string", bool: "a boolean"}.get(type(value), "a number")


def _fork(
    process: Process, variables: dict[str, Any], node: Node, context: dict[str, Any] | None, result: Advance
) -> str | None:
    """Give each branch of a `parallel` a token of its own and walk each until it waits or reaches the
    join. Branches that reach the join at once are decided here, as the join would decide them: the
    node after the join when that lets the token on, else None (the branches rest in `result.forked`)."""
    result.history.append(HistoryEntry("FORKED", node.id, {"branches": list(node.forks)}))
    resting: list[Advance] = []
    arrived: list[Advance] = []
    for first in node.forks:
        branch = Advance(current_node_id=first)
        _walk(process, variables, first, context, branch, _IN_FORK)
        at_join = process.node(branch.current_node_id).type == "join" and branch.task is None
        (arrived if at_join and branch.incident is None else resting).append(branch)
    join_id = arrived[0].current_node_id if arrived else None
    for branch in arrived:
        result.history += branch.history
    if join_id is not None:
        join = process.node(join_id)
        if join.wait_for == "any" or not resting:
            result.history.append(HistoryEntry("JOIN_PASSED", join_id, {"wait_for": join.wait_for}))
            for branch in resting:
                # Never created: the join let a branch through before these waited anywhere.
                result.history += branch.history
                result.history.append(HistoryEntry("BRANCH_WITHDRAWN", branch.current_node_id))
            assert join.next is not None
            return join.next
        for _ in arrived:
            result.history.append(HistoryEntry("JOIN_WAITING", join_id, {"branches_left": len(resting)}))
    result.forked = resting
    return None


def leave_node(
    process: Process,
    node: Node,
    variables: dict[str, Any],
    written: dict[str, Any],
    tokens_elsewhere: int | None = None,
) -> tuple[dict[str, Any], list[HistoryEntry], Advance]:
    """A task node finished and wrote `written`: the new variables, the history of leaving, and the move on
    (`tokens_elsewhere` as `advance` takes it)."""
    new_variables = {**variables, **written}
    history = [HistoryEntry("VARIABLE_WRITTEN", node.id, {"name": k, "value": v}) for k, v in written.items()]
    history.append(HistoryEntry("NODE_COMPLETED", node.id))
    assert node.next is not None
    return (
        new_variables,
        history,
        advance(process, new_variables, node.next, tokens_elsewhere=tokens_elsewhere),
    )


def evaluates_conditions(process: Process, node_id: str) -> bool:
    """Whether `advance` into `node_id` evaluates conditions: only a gateway does, and its branches
    lead on from there; any other node creates its task (or ends the instance) at once."""
    return process.node(node_id).type == "exclusive"


_TASK_KINDS = {
    "user_task": TaskKind.USER,
    "timer": TaskKind.TIMER,
    "receive": TaskKind.RECEIVE,
    "call": TaskKind.CALL,
}


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
    if node.type == "call":
        return call_payload(node, variables)
    inputs = render(node.inputs, variables) if node.inputs is not None else dict(variables)
    if node.type == "agent":
        # References in a prompt point at inputs; no value is pasted into the instructions.
        prompt, inputs = render_prompt(node.prompt or "", inputs, variables)
        return {"inputs": inputs, "prompt": prompt}
    return {"inputs": inputs}


def call_payload(node: Node, variables: dict[str, Any]) -> dict[str, Any]:
    """What a call activity's task carries: the process and version (0: the latest) of the child to
    start, the child's variables (`inputs` rendered, else a copy of the parent's, as Camunda's
    call activity passes them all) and its business key (None: the parent's)."""
    child_variables = render(node.inputs, variables) if node.inputs is not None else dict(variables)
    business_key = render(node.business_key, variables) if node.business_key is not None else None
    if business_key is not None and not isinstance(business_key, str):
        business_key = str(business_key)
    return {
        "process_id": node.process,
        "version": node.pinned_version or 0,
        "variables": child_variables,
        "business_key": business_key,
    }


def _choose_branch(node: Node, variables: dict[str, Any]) -> tuple[str, str] | None:
    for branch in node.branches:
        if evaluate_condition(branch.when, variables):
            return branch.when, branch.next
    if node.default:
        return "default", node.default
    return None
