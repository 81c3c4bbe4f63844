"""Building response messages from the engine's read models."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from abada.engine.v1 import (
    common_pb2,
    definition_pb2,
    dependency_pb2,
    external_task_pb2,
    incident_pb2,
    process_pb2,
)
from google.protobuf import struct_pb2

from abada_engine.definitions.catalog import Definition
from abada_engine.definitions.model import Limits, ToolBinding
from abada_engine.runtime.dependencies import dependency_key, split_key
from abada_engine.runtime.views import (
    HistoryView,
    IncidentView,
    InstanceView,
    LockedTask,
    StepView,
    UserTaskView,
    WaitView,
)
from abada_engine.store.dependencies import ListedCircuit
from abada_engine.store.states import DependencyState, IncidentState, InstanceState, StepKind, StepState

from .convert import timestamp, to_struct

_POLICY = {"read": common_pb2.TOOL_POLICY_READ, "write": common_pb2.TOOL_POLICY_WRITE}
_IDEMPOTENCY = {"key": common_pb2.IDEMPOTENCY_KEY, "none": common_pb2.IDEMPOTENCY_NONE}
_INSTANCE_STATE: dict[str, process_pb2.InstanceState] = {
    InstanceState.ACTIVE: process_pb2.INSTANCE_STATE_ACTIVE,
    InstanceState.COMPLETED: process_pb2.INSTANCE_STATE_COMPLETED,
    InstanceState.CANCELED: process_pb2.INSTANCE_STATE_CANCELED,
}
INSTANCE_STATE_NAMES = {v: k for k, v in _INSTANCE_STATE.items()}
_INCIDENT_STATE: dict[str, incident_pb2.IncidentState] = {
    IncidentState.OPEN: incident_pb2.INCIDENT_STATE_OPEN,
    IncidentState.RESOLVED: incident_pb2.INCIDENT_STATE_RESOLVED,
}
INCIDENT_STATE_NAMES = {v: k for k, v in _INCIDENT_STATE.items()}
STEP_KINDS: dict[str, external_task_pb2.StepKind] = {
    StepKind.MODEL_CALL: external_task_pb2.STEP_KIND_MODEL_CALL,
    StepKind.TOOL_CALL: external_task_pb2.STEP_KIND_TOOL_CALL,
}
STEP_STATES: dict[str, external_task_pb2.StepState] = {
    StepState.STARTED: external_task_pb2.STEP_STATE_STARTED,
    StepState.COMPLETED: external_task_pb2.STEP_STATE_COMPLETED,
    StepState.FAILED: external_task_pb2.STEP_STATE_FAILED,
    StepState.OUTCOME_UNKNOWN: external_task_pb2.STEP_STATE_OUTCOME_UNKNOWN,
    StepState.AWAITING_APPROVAL: external_task_pb2.STEP_STATE_AWAITING_APPROVAL,
    StepState.APPROVED: external_task_pb2.STEP_STATE_APPROVED,
}

DEPENDENCY_KINDS: dict[str, dependency_pb2.DependencyKind] = {
    "model": dependency_pb2.DEPENDENCY_KIND_MODEL,
    "tool_server": dependency_pb2.DEPENDENCY_KIND_TOOL_SERVER,
    "broker": dependency_pb2.DEPENDENCY_KIND_BROKER,
    "secret_store": dependency_pb2.DEPENDENCY_KIND_SECRET_STORE,
}
DEPENDENCY_KIND_NAMES = {v: k for k, v in DEPENDENCY_KINDS.items()}
_DEPENDENCY_STATE: dict[str, dependency_pb2.DependencyState] = {
    DependencyState.UP: dependency_pb2.DEPENDENCY_STATE_UP,
    DependencyState.DOWN: dependency_pb2.DEPENDENCY_STATE_DOWN,
    DependencyState.PROBING: dependency_pb2.DEPENDENCY_STATE_PROBING,
}


def dependency(key: str) -> dependency_pb2.Dependency:
    kind, name = split_key(key)
    return dependency_pb2.Dependency(
        kind=DEPENDENCY_KINDS.get(kind, dependency_pb2.DEPENDENCY_KIND_UNSPECIFIED), name=name
    )


def dependency_key_of(message: dependency_pb2.Dependency) -> str:
    """The engine's key for a dependency message ("" for an unknown kind)."""
    kind = DEPENDENCY_KIND_NAMES.get(message.kind)
    return dependency_key(kind, message.name) if kind else ""


def dependency_status(row: ListedCircuit) -> dependency_pb2.DependencyStatus:
    return dependency_pb2.DependencyStatus(
        dependency=dependency(row.key),
        state=_DEPENDENCY_STATE.get(row.state, dependency_pb2.DEPENDENCY_STATE_UNSPECIFIED),
        down_since=timestamp(row.down_since),
        failed_probes=row.failed_probes,
        last_error=row.last_error,
        next_probe_time=timestamp(row.next_probe_at),
        probe_task_id=str(row.probe_task_id) if row.probe_task_id else "",
        held_tasks=row.held_tasks,
        update_time=timestamp(row.updated_at),
    )


def binding(value: ToolBinding) -> common_pb2.ToolBinding:
    return common_pb2.ToolBinding(
        server=value.server,
        tool=value.tool,
        policy=_POLICY[value.policy],
        idempotency=_IDEMPOTENCY[value.idempotency],
        url=value.url,
        transport=value.transport,
        credential=value.credential,
        input_schema_sha256=value.input_schema_sha256,
        approval_required=value.approval_required,
        description_sha256=value.description_sha256,
    )


def limits(value: Limits) -> common_pb2.AgentLimits:
    return common_pb2.AgentLimits(
        max_model_calls=value.max_model_calls,
        max_tool_calls=value.max_tool_calls,
        max_tokens=value.max_tokens,
    )


def definition(value: Definition) -> definition_pb2.Definition:
    return definition_pb2.Definition(
        id=str(value.id),
        process_id=value.process_id,
        version=value.version,
        content_sha256=value.content_sha256,
        source_name=value.source_name,
        create_time=timestamp(value.created_at),
        tool_bindings=[binding(b) for b in value.tool_bindings],
        spec=to_struct(value.spec_json()),
    )


def instance(value: InstanceView) -> process_pb2.Instance:
    return process_pb2.Instance(
        id=str(value.id),
        definition_id=str(value.definition_id),
        process_id=value.process_id,
        version=value.version,
        state=_INSTANCE_STATE[value.state],
        variables=to_struct(value.variables),
        current_node_id=value.current_node_id or "",
        business_key=value.business_key,
        create_time=timestamp(value.created_at),
        end_time=timestamp(value.ended_at),
        open_incidents=value.open_incidents,
        waits=[wait(w) for w in value.waits],
        active_node_ids=list(value.active_node_ids),
        fan_outs=[
            process_pb2.FanOut(
                node_id=f.node_id,
                state=f.state,
                items_total=f.total,
                items_done=f.done,
                items_running=f.running,
                items_failed=f.failed,
                items_skipped=f.skipped,
            )
            for f in value.fan_outs
        ],
    )


_WAIT_KINDS = {
    "TIMER": process_pb2.Wait.KIND_TIMER,
    "MESSAGE": process_pb2.Wait.KIND_MESSAGE,
    "RECEIVE_TIMEOUT": process_pb2.Wait.KIND_RECEIVE_TIMEOUT,
    "DEADLINE": process_pb2.Wait.KIND_DEADLINE,
}


def wait(value: WaitView) -> process_pb2.Wait:
    return process_pb2.Wait(
        kind=_WAIT_KINDS.get(value.kind, process_pb2.Wait.KIND_UNSPECIFIED),
        node_id=value.node_id,
        task_id=str(value.task_id),
        due_time=timestamp(value.due_at),
        fire_time=timestamp(value.fired_at),
        message=value.message or "",
        correlation_key=value.correlation_key or "",
    )


def history_event(value: HistoryView) -> process_pb2.HistoryEvent:
    return process_pb2.HistoryEvent(
        id=value.id,
        instance_id=str(value.instance_id),
        type=value.type,
        node_id=value.node_id or "",
        task_id=str(value.task_id) if value.task_id else "",
        data=to_struct(value.data),
        create_time=timestamp(value.created_at),
    )


def user_task(value: UserTaskView) -> process_pb2.UserTask:
    return process_pb2.UserTask(
        id=str(value.id),
        instance_id=str(value.instance_id),
        node_id=value.node_id,
        process_id=value.process_id,
        variables=to_struct(value.variables),
        create_time=timestamp(value.created_at),
    )


def incident(value: IncidentView) -> incident_pb2.Incident:
    return incident_pb2.Incident(
        id=str(value.id),
        type=value.type,
        instance_id=str(value.instance_id),
        task_id=str(value.task_id) if value.task_id else "",
        node_id=value.node_id,
        message=value.message,
        details=to_struct(value.details),
        state=_INCIDENT_STATE[value.state],
        create_time=timestamp(value.created_at),
        resolve_time=timestamp(value.resolved_at),
        resolution=value.resolution or "",
        process_id=value.process_id,
    )


def step(
    value: StepView, sent: Sequence[tuple[dict[str, Any], struct_pb2.Struct]] = ()
) -> external_task_pb2.JournalStep:
    """The step as a message. `sent` pairs the payloads the caller sent with the Structs they came in:
    a payload of the step that is one of them (the same object) is copied back as it came, not
    converted twice."""
    message = external_task_pb2.JournalStep(
        sequence=value.sequence,
        attempt=value.attempt,
        kind=STEP_KINDS[value.kind],
        state=STEP_STATES[value.state],
        tool_ref=value.tool_ref,
        tokens=external_task_pb2.TokenUsage(
            input_tokens=value.input_tokens, output_tokens=value.output_tokens
        ),
        idempotency_key=value.idempotency_key,
        abandoned=value.abandoned,
        create_time=timestamp(value.created_at),
        update_time=timestamp(value.updated_at),
        cost_usd=value.cost_usd,
    )
    for payload, field in ((value.request, message.request), (value.response, message.response)):
        if payload is None:
            continue
        as_sent = next((struct for plain, struct in sent if plain is payload), None)
        if as_sent is not None:
            field.CopyFrom(as_sent)
        else:
            field.update(payload)
    return message


def locked_task(value: LockedTask) -> external_task_pb2.ExternalTask:
    message = external_task_pb2.ExternalTask(
        id=str(value.id),
        topic_name=value.topic,
        instance_id=str(value.instance_id),
        process_id=value.process_id,
        node_id=value.node_id,
        variables=to_struct(value.variables),
        attempt=value.attempt,
        lease_token=value.lease_token,
        lease_expires_at=timestamp(value.lease_expires_at),
        steps=[step(s) for s in value.steps],
        business_key=value.business_key,
        retries_left=value.retries_left,
        probes=[dependency(key) for key in value.probes],
    )
    work = value.agent_work
    if work is not None:
        agent = external_task_pb2.AgentWork(
            profile_version="abada.agent/v1",
            model=work.model,
            provider=work.provider,
            prompt=work.prompt,
            tool_bindings=[binding(b) for b in work.tool_bindings],
            limits=limits(work.limits),
            result_variable=work.result_variable,
        )
        if work.output_schema is not None:
            agent.output_schema.CopyFrom(to_struct(work.output_schema))
        if work.confidence_threshold is not None:
            agent.confidence_threshold = work.confidence_threshold
        message.agent_work.CopyFrom(agent)
    return message
