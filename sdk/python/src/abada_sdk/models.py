"""Plain typed views of the engine's messages: variables as dicts, times as datetimes, states as enums."""

from __future__ import annotations

import dataclasses
import datetime
import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from abada.engine.v1 import approval_pb2, definition_pb2, external_task_pb2, incident_pb2, process_pb2
from google.protobuf import json_format, struct_pb2, timestamp_pb2
from google.protobuf.message import Message


def to_struct(values: dict[str, Any] | None) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    if values:
        message.update(values)
    return message


def from_struct(message: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct as JSON values; whole numbers come back as ints (Struct carries every number as a double)."""
    values: dict[str, Any] = plain_numbers(json_format.MessageToDict(message))
    return values


def plain_numbers(value: Any) -> Any:
    """Struct holds every number as a double: `3.0` back as `3`, as the user wrote it, at any depth."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: plain_numbers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_numbers(item) for item in value]
    return value


def _time(stamp: timestamp_pb2.Timestamp) -> datetime.datetime | None:
    if not (stamp.seconds or stamp.nanos):
        return None
    return stamp.ToDatetime(tzinfo=datetime.UTC)


View = TypeVar("View")


def _copied(cls: type[View], message: Message, **converted: Any) -> View:
    """A view of `message`: every field of `cls` not in `converted` is the message's field of the same
    name, as it is (ids, names, counts); `converted` gives the others (structs, times, enums)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    plain = {name: getattr(message, name) for name in names if name not in converted}
    return cls(**plain, **converted)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


class InstanceState(enum.StrEnum):
    ACTIVE = "ACTIVE"
    COMPLETED = "COMPLETED"
    CANCELED = "CANCELED"

    @classmethod
    def of(cls, value: int) -> InstanceState:
        return cls(process_pb2.InstanceState.Name(value).removeprefix("INSTANCE_STATE_"))

    def to_proto(self) -> process_pb2.InstanceState:
        # `Value` is typed int; the number is one of the enum's (protobuf enum values are ints).
        return cast(
            process_pb2.InstanceState, process_pb2.InstanceState.Value(f"INSTANCE_STATE_{self.value}")
        )


class Resolution(enum.StrEnum):
    RETRY = "RETRY"
    HAPPENED = "HAPPENED"
    DID_NOT_HAPPEN = "DID_NOT_HAPPEN"
    CANCEL_INSTANCE = "CANCEL_INSTANCE"

    def to_proto(self) -> incident_pb2.Resolution:
        # `Value` is typed int; the number is one of the enum's (protobuf enum values are ints).
        return cast(incident_pb2.Resolution, incident_pb2.Resolution.Value(f"RESOLUTION_{self.value}"))


class ApprovalState(enum.StrEnum):
    PENDING = "PENDING"
    APPROVED = "APPROVED"
    REJECTED = "REJECTED"
    EXPIRED = "EXPIRED"
    CANCELED = "CANCELED"

    @classmethod
    def of(cls, value: int) -> ApprovalState:
        return cls(approval_pb2.ApprovalState.Name(value).removeprefix("APPROVAL_STATE_"))

    def to_proto(self) -> approval_pb2.ApprovalState:
        # `Value` is typed int; the number is one of the enum's (protobuf enum values are ints).
        return cast(
            approval_pb2.ApprovalState, approval_pb2.ApprovalState.Value(f"APPROVAL_STATE_{self.value}")
        )


@dataclass(frozen=True)
class Approval:
    """A tool call under `approval: required`, waiting for (or given) a person's decision."""

    id: str
    state: ApprovalState
    tool_ref: str
    # What the model proposed, and what it said in that turn.
    arguments: dict[str, Any]
    model_text: str
    instance_id: str
    process_id: str
    business_key: str
    node_id: str
    task_id: str
    sequence: int
    created_at: datetime.datetime | None
    expires_at: datetime.datetime | None
    decided_by: str
    decided_at: datetime.datetime | None
    comment: str
    # The arguments the call runs with, once approved (edited or as proposed).
    approved_arguments: dict[str, Any] | None

    @classmethod
    def from_proto(cls, message: approval_pb2.Approval) -> Approval:
        return _copied(
            cls,
            message,
            state=ApprovalState.of(message.state),
            arguments=from_struct(message.arguments),
            created_at=_time(message.create_time),
            expires_at=_time(message.expire_time),
            decided_at=_time(message.decide_time),
            approved_arguments=(
                from_struct(message.approved_arguments) if message.HasField("approved_arguments") else None
            ),
        )


@dataclass(frozen=True)
class Instance:
    id: str
    process_id: str
    version: int
    definition_id: str
    state: InstanceState
    variables: dict[str, Any]
    current_node_id: str
    business_key: str
    open_incidents: int
    created_at: datetime.datetime | None
    ended_at: datetime.datetime | None
    # The instance whose call activity started this one; "" for a top-level instance.
    parent_instance_id: str = ""

    @property
    def ended(self) -> bool:
        return self.state is not InstanceState.ACTIVE

    @classmethod
    def from_proto(cls, message: process_pb2.Instance) -> Instance:
        return _copied(
            cls,
            message,
            state=InstanceState.of(message.state),
            variables=from_struct(message.variables),
            created_at=_time(message.create_time),
            ended_at=_time(message.end_time),
        )


@dataclass(frozen=True)
class HistoryEvent:
    id: int
    type: str
    node_id: str
    task_id: str
    data: dict[str, Any]
    created_at: datetime.datetime | None

    @classmethod
    def from_proto(cls, message: process_pb2.HistoryEvent) -> HistoryEvent:
        return _copied(cls, message, data=from_struct(message.data), created_at=_time(message.create_time))


@dataclass(frozen=True)
class Publication:
    """What became of a published message: correlated to an instance now, or buffered for its ttl."""

    message_key: str
    # The instance it went to; empty while it waits in the buffer.
    instance_id: str
    correlated: bool
    # Its message_id repeated an earlier publication within the ttl: this is that one's answer.
    duplicate: bool

    @classmethod
    def from_proto(cls, message: process_pb2.PublishMessageResponse) -> Publication:
        return _copied(cls, message)


@dataclass(frozen=True)
class Incident:
    id: str
    type: str
    instance_id: str
    process_id: str
    node_id: str
    task_id: str
    message: str
    details: dict[str, Any]
    open: bool
    resolution: str
    created_at: datetime.datetime | None

    @classmethod
    def from_proto(cls, message: incident_pb2.Incident) -> Incident:
        return _copied(
            cls,
            message,
            details=from_struct(message.details),
            open=message.state == incident_pb2.INCIDENT_STATE_OPEN,
            created_at=_time(message.create_time),
        )


@dataclass(frozen=True)
class UserTask:
    id: str
    instance_id: str
    process_id: str
    node_id: str
    variables: dict[str, Any]
    created_at: datetime.datetime | None

    @classmethod
    def from_proto(cls, message: process_pb2.UserTask) -> UserTask:
        return _copied(
            cls, message, variables=from_struct(message.variables), created_at=_time(message.create_time)
        )


@dataclass(frozen=True)
class JournalStep:
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

    @classmethod
    def from_proto(cls, message: external_task_pb2.JournalStep) -> JournalStep:
        return _copied(
            cls,
            message,
            kind=external_task_pb2.StepKind.Name(message.kind).removeprefix("STEP_KIND_"),
            state=external_task_pb2.StepState.Name(message.state).removeprefix("STEP_STATE_"),
            request=from_struct(message.request) if message.HasField("request") else None,
            response=from_struct(message.response) if message.HasField("response") else None,
            input_tokens=message.tokens.input_tokens,
            output_tokens=message.tokens.output_tokens,
        )


@dataclass(frozen=True)
class Definition:
    id: str
    process_id: str
    version: int
    content_sha256: str
    source_name: str
    created_at: datetime.datetime | None
    tools: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, message: definition_pb2.Definition) -> Definition:
        return _copied(
            cls,
            message,
            created_at=_time(message.create_time),
            tools=tuple(f"{b.server}/{b.tool}" for b in message.tool_bindings),
        )


@dataclass(frozen=True)
class Deployment:
    definitions: list[Definition]
    # Processes this deploy created a new version for; the others were identical to their latest.
    created_process_ids: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Task:
    """One external task handed to a worker handler, under a lease the worker keeps alive."""

    id: str
    topic: str
    instance_id: str
    process_id: str
    node_id: str
    business_key: str
    # The variables the node hands over (its resolved inputs, or all instance variables).
    variables: dict[str, Any]
    # 1 for the first try; each retry or takeover after a lost lease adds one.
    attempt: int
    # How many more failures the engine retries before it raises an incident.
    retries_left: int
    lease_expires_at: datetime.datetime | None

    @classmethod
    def from_proto(cls, message: external_task_pb2.ExternalTask) -> Task:
        return _copied(
            cls,
            message,
            topic=message.topic_name,
            variables=from_struct(message.variables),
            lease_expires_at=_time(message.lease_expires_at),
        )


# The views the package re-exports (`abada_sdk.Instance`, ...); the struct helpers stay this module's.
__all__ = [
    "Approval",
    "ApprovalState",
    "Definition",
    "Deployment",
    "HistoryEvent",
    "Incident",
    "Instance",
    "InstanceState",
    "JournalStep",
    "Publication",
    "Resolution",
    "Task",
    "UserTask",
]
