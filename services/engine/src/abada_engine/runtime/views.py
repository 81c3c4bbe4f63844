"""Read models the engine hands out: plain data, no protobuf; where a store row is already what a
reader may see, the view is that row."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from abada_engine.definitions.model import Limits, ToolBinding
from abada_engine.store.fan_outs import FanOutProgress
from abada_engine.store.history import HistoryRow
from abada_engine.store.incidents import ListedIncident
from abada_engine.store.instances import ListedInstance


@dataclass(slots=True)
class InstanceView(ListedInstance):
    """An instance as the store lists it (with its count of open incidents)."""

    # Its timers, receives and deadlines (GetInstance only).
    waits: tuple[WaitView, ...] = ()
    # Where its live tokens rest, one entry a token (GetInstance only): several between a `parallel`
    # and its join, else the one current node while active.
    active_node_ids: tuple[str, ...] = ()
    # Its `for_each` nodes' progress, oldest first (GetInstance only).
    fan_outs: tuple[FanOutProgress, ...] = ()


@dataclass(frozen=True)
class WaitView:
    kind: str  # TIMER, MESSAGE, RECEIVE_TIMEOUT or DEADLINE
    node_id: str
    task_id: uuid.UUID
    due_at: datetime | None
    fired_at: datetime | None
    message: str | None = None
    correlation_key: str | None = None


# A history event and an incident are handed out as the store reads them: their rows hold nothing a
# reader may not see.
HistoryView = HistoryRow
IncidentView = ListedIncident


@dataclass(frozen=True)
class UserTaskView:
    id: uuid.UUID
    instance_id: uuid.UUID
    node_id: str
    process_id: str
    variables: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class AgentWorkView:
    model: str
    # Which provider serves the model, frozen at deploy; "" when a version older than the field
    # has a model of no known family (the worker then reports it cannot serve the node).
    provider: str
    prompt: str
    tool_bindings: list[ToolBinding]
    limits: Limits
    output_schema: dict[str, Any] | None
    result_variable: str
    confidence_threshold: float | None


@dataclass(frozen=True)
class StepView:
    sequence: int
    attempt: int
    kind: str
    state: str
    tool_ref: str
    request: dict[str, Any] | None
    response: dict[str, Any] | None
    input_tokens: int
    output_tokens: int
    idempotency_key: str
    abandoned: bool
    created_at: datetime
    updated_at: datetime
    # A model call's tokens at its profile's prices; set when the journal is read for a person.
    cost_usd: float = 0.0


@dataclass(frozen=True)
class LockedTask:
    id: uuid.UUID
    topic: str
    instance_id: uuid.UUID
    process_id: str
    node_id: str
    variables: dict[str, Any]
    attempt: int
    lease_token: str
    lease_expires_at: datetime
    definition_id: uuid.UUID | None = None
    agent_work: AgentWorkView | None = None
    steps: list[StepView] = field(default_factory=list)
    business_key: str = ""
    retries_left: int = 0
    # The dependencies (`model:gemini-3.6-flash`) this attempt probes after an outage.
    probes: tuple[str, ...] = ()


@dataclass(frozen=True)
class HeldBack:
    """What a fetch does with the tasks it locked while some dependency is down."""

    parked: dict[uuid.UUID, str]  # task -> the dependency it now waits for, parked
    probes: dict[uuid.UUID, tuple[str, ...]]  # task -> the dependencies it goes out to probe
