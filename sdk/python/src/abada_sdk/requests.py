"""The requests of the engine's operator API, built in one place.

`AsyncEngineClient`, `EngineClient` (through it) and the `abada` CLI send the same message for the
same words: a state said as an enum, variables as a dict, an optional result or edited arguments set
only when given (an empty Struct would mean "the tool returned {}").
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any, Literal, TypedDict, Unpack

from abada.engine.v1 import (
    approval_pb2,
    batch_pb2,
    definition_pb2,
    dependency_pb2,
    incident_pb2,
    process_pb2,
    queue_pb2,
)

from .models import ApprovalState, InstanceState, Resolution, to_struct


def deploy(content: str, source_name: str) -> definition_pb2.DeployRequest:
    return definition_pb2.DeployRequest(source_name=source_name, content=content)


def list_definitions(process_id: str = "") -> definition_pb2.ListDefinitionsRequest:
    return definition_pb2.ListDefinitionsRequest(process_id=process_id)


class StartOptions(TypedDict, total=False):
    """How an instance starts, besides its process and variables: `version` (0: the latest), its
    `business_key`, and a `request_id` that makes the start idempotent for a day."""

    business_key: str
    version: int
    request_id: str


class InstanceFilter(TypedDict, total=False):
    """Which instances a listing shows: by `business_key`, started in [`created_after`,
    `created_before`), `where` ({"customerId": "C-42"}) their top-level variables equal those values,
    and `parent_instance_id` the instances that one's call activities started."""

    business_key: str
    created_after: datetime | None
    created_before: datetime | None
    where: dict[str, Any] | None
    parent_instance_id: str


class BatchFilter(TypedDict, total=False):
    """Which instances of a process a batch works on, besides the process: every filter given must
    match. `state` is the instances' (ACTIVE when empty); `incident_type` and `incident_message` (a part
    of it) select by their open incidents."""

    version: int
    state: str
    node_id: str
    business_key: str
    incident_type: str
    incident_message: str


class BatchOptions(BatchFilter, total=False):
    """Everything `create_batch` takes besides the kind and the process: the filter, and what the kind
    does to each instance."""

    reason: str
    to_version: int
    mappings: dict[str, str] | None
    set_variables: dict[str, Any] | None
    unset_variables: Sequence[str]
    moves: Sequence[tuple[str, str]]


def start_instance(
    process_id: str, variables: dict[str, Any] | None = None, **options: Unpack[StartOptions]
) -> process_pb2.StartInstanceRequest:
    return process_pb2.StartInstanceRequest(process_id=process_id, variables=to_struct(variables), **options)


def list_instances(
    process_id: str = "",
    state: InstanceState | None = None,
    *,
    waiting_for: process_pb2.WaitingFor = process_pb2.WAITING_FOR_UNSPECIFIED,
    **filters: Unpack[InstanceFilter],
) -> process_pb2.ListInstancesRequest:
    """Instances of `process_id` in `state` that match `filters`; with `waiting_for`
    (WAITING_FOR_TIMER or WAITING_FOR_MESSAGE), only active ones waiting on that."""
    request = process_pb2.ListInstancesRequest(
        process_id=process_id,
        state=state.to_proto() if state else process_pb2.INSTANCE_STATE_UNSPECIFIED,
        business_key=filters.get("business_key", ""),
        waiting_for=waiting_for,
        parent_instance_id=filters.get("parent_instance_id", ""),
    )
    created_after = filters.get("created_after")
    if created_after is not None:
        request.created_after.FromDatetime(created_after)
    created_before = filters.get("created_before")
    if created_before is not None:
        request.created_before.FromDatetime(created_before)
    for name, value in (filters.get("where") or {}).items():
        request.variables.add(name=name).value.CopyFrom(to_struct({name: value}).fields[name])
    return request


def purge_instances(
    before: datetime, process_id: str = "", *, dry_run: bool = False
) -> process_pb2.PurgeInstancesRequest:
    """Finished instances (of `process_id`, if given) that ended before `before`: deleted now, or with
    `dry_run` counted."""
    request = process_pb2.PurgeInstancesRequest(process_id=process_id, dry_run=dry_run)
    request.before.FromDatetime(before)
    return request


def erase_instances(
    business_key: str = "", where: dict[str, Any] | None = None, *, cancel_active: bool = False
) -> process_pb2.EraseInstancesRequest:
    """One customer's instances, by business key and/or top-level variable values (as `list_instances`'
    `where`), erased whatever their age; active ones cancelled first with `cancel_active`."""
    request = process_pb2.EraseInstancesRequest(business_key=business_key, cancel_active=cancel_active)
    for name, value in (where or {}).items():
        request.variables.add(name=name).value.CopyFrom(to_struct({name: value}).fields[name])
    return request


def modify_instance(
    instance_id: str,
    reason: str,
    set_variables: dict[str, Any] | None = None,
    unset_variables: Sequence[str] = (),
    moves: Sequence[tuple[str, str]] = (),
) -> process_pb2.ModifyInstanceRequest:
    """Repair an active instance: set (whole values) and remove variables, and move the token resting at
    each `(from_node, to_node)` pair's first node to its second; `reason` is kept in the history."""
    request = process_pb2.ModifyInstanceRequest(
        instance_id=instance_id, reason=reason, unset_variables=list(unset_variables)
    )
    if set_variables:
        request.set_variables.CopyFrom(to_struct(set_variables))
    for from_node, to_node in moves:
        request.moves.add(from_node_id=from_node, to_node_id=to_node)
    return request


def migrate_instances(
    process_id: str,
    from_version: int,
    to_version: int,
    mappings: dict[str, str] | None = None,
    instance_ids: Sequence[str] = (),
    *,
    dry_run: bool = False,
) -> process_pb2.MigrateInstancesRequest:
    """Move the active instances of `process_id` v`from_version` (only `instance_ids`, if given) to
    `to_version`; `mappings` names the nodes whose id changed (old id to new id)."""
    request = process_pb2.MigrateInstancesRequest(
        process_id=process_id,
        from_version=from_version,
        to_version=to_version,
        instance_ids=list(instance_ids),
        dry_run=dry_run,
    )
    for old, new in (mappings or {}).items():
        request.mappings.add(from_node_id=old, to_node_id=new)
    return request


def create_batch(
    kind: Literal["retry-incidents", "cancel", "migrate", "modify"],
    process_id: str,
    *,
    reason: str = "",
    to_version: int = 0,
    mappings: dict[str, str] | None = None,
    set_variables: dict[str, Any] | None = None,
    unset_variables: Sequence[str] = (),
    moves: Sequence[tuple[str, str]] = (),
    **filters: Unpack[BatchFilter],
) -> batch_pb2.CreateBatchRequest:
    """A batch over the instances of `process_id` matching `filters`: `retry-incidents` retries their
    open incidents, `cancel` cancels them with `reason`, `migrate` moves them from the filter's `version`
    to `to_version` (`mappings`: nodes renamed, old id to new id), `modify` sets `set_variables`, removes
    `unset_variables` and moves the tokens of `moves` (from node, to node) with `reason`."""
    request = batch_pb2.CreateBatchRequest(
        kind=_BATCH_KINDS[kind],
        filter=batch_pb2.BatchFilter(process_id=process_id, **filters),
        reason=reason,
    )
    if kind == "migrate":
        request.migration.to_version = to_version
        for old, new in (mappings or {}).items():
            request.migration.mappings.add(from_node_id=old, to_node_id=new)
    if kind == "modify":
        request.modification.SetInParent()
        if set_variables:
            request.modification.set_variables.CopyFrom(to_struct(set_variables))
        request.modification.unset_variables.extend(unset_variables)
        for from_node, to_node in moves:
            request.modification.moves.add(from_node_id=from_node, to_node_id=to_node)
    return request


def get_batch(
    batch_id: str, *, outcome: str = "", after_instance_id: str = "", page_size: int = 1000
) -> batch_pb2.GetBatchRequest:
    """A batch with a page of its instances' outcomes (only `outcome`'s: PENDING, DONE, SKIPPED or
    FAILED, when given), by instance id after `after_instance_id`."""
    return batch_pb2.GetBatchRequest(
        batch_id=batch_id,
        outcome=f"BATCH_OUTCOME_{outcome.upper()}" if outcome else None,
        after_instance_id=after_instance_id,
        page_size=page_size,
    )


_BATCH_KINDS = {
    "retry-incidents": batch_pb2.BATCH_KIND_RETRY_INCIDENTS,
    "cancel": batch_pb2.BATCH_KIND_CANCEL,
    "migrate": batch_pb2.BATCH_KIND_MIGRATE,
    "modify": batch_pb2.BATCH_KIND_MODIFY,
}


def publish_message(
    name: str,
    correlation_key: str,
    variables: dict[str, Any] | None = None,
    *,
    ttl: timedelta = timedelta(0),
    message_id: str = "",
) -> process_pb2.PublishMessageRequest:
    """A message for the oldest instance waiting for `name` with this `correlation_key`, or buffered for
    `ttl`; a `message_id` sent again within the ttl answers the first publication."""
    request = process_pb2.PublishMessageRequest(
        name=name, correlation_key=correlation_key, variables=to_struct(variables), message_id=message_id
    )
    request.ttl.FromTimedelta(ttl)
    return request


def incident_states(include_resolved: bool) -> list[incident_pb2.IncidentState]:
    """The states an incident listing asks for, one request each: open, then (if asked) resolved."""
    states = [incident_pb2.INCIDENT_STATE_OPEN]
    if include_resolved:
        states.append(incident_pb2.INCIDENT_STATE_RESOLVED)
    return states


def list_incidents(
    state: incident_pb2.IncidentState,
    *,
    instance_id: str = "",
    type: str = "",
    dependency: dependency_pb2.Dependency | None = None,
) -> incident_pb2.ListIncidentsRequest:
    return incident_pb2.ListIncidentsRequest(
        instance_id=instance_id, state=state, type=type, dependency=dependency
    )


def resolve_incident(
    incident_id: str, resolution: Resolution, *, result: dict[str, Any] | None = None, comment: str = ""
) -> incident_pb2.ResolveIncidentRequest:
    request = incident_pb2.ResolveIncidentRequest(
        incident_id=incident_id, resolution=resolution.to_proto(), comment=comment
    )
    if result is not None:
        request.result.CopyFrom(to_struct(result))
    return request


def resolve_incidents(
    type: str,
    resolution: Resolution,
    *,
    dependency: dependency_pb2.Dependency | None = None,
    process_id: str = "",
    comment: str = "",
) -> incident_pb2.ResolveIncidentsRequest:
    """Every open incident of `type` (and `dependency`, `process_id`) at once: RETRY or CANCEL_INSTANCE."""
    return incident_pb2.ResolveIncidentsRequest(
        type=type,
        dependency=dependency,
        process_id=process_id,
        resolution=resolution.to_proto(),
        comment=comment,
    )


def list_user_tasks(instance_id: str = "") -> process_pb2.ListUserTasksRequest:
    return process_pb2.ListUserTasksRequest(instance_id=instance_id)


def complete_user_task(
    user_task_id: str, variables: dict[str, Any] | None = None
) -> process_pb2.CompleteUserTaskRequest:
    return process_pb2.CompleteUserTaskRequest(user_task_id=user_task_id, variables=to_struct(variables))


def list_approvals(
    *,
    process_id: str = "",
    business_key: str = "",
    tool_ref: str = "",
    state: ApprovalState = ApprovalState.PENDING,
) -> approval_pb2.ListApprovalsRequest:
    return approval_pb2.ListApprovalsRequest(
        process_id=process_id, business_key=business_key, tool_ref=tool_ref, state=state.to_proto()
    )


def approve(
    approval_id: str, *, arguments: dict[str, Any] | None = None, comment: str = ""
) -> approval_pb2.DecideApprovalRequest:
    request = approval_pb2.DecideApprovalRequest(
        approval_id=approval_id, decision=approval_pb2.APPROVAL_DECISION_APPROVE, comment=comment
    )
    if arguments is not None:
        request.arguments.CopyFrom(to_struct(arguments))
    return request


def reject(approval_id: str, reason: str) -> approval_pb2.DecideApprovalRequest:
    return approval_pb2.DecideApprovalRequest(
        approval_id=approval_id, decision=approval_pb2.APPROVAL_DECISION_REJECT, comment=reason
    )


def list_open_tasks(topic_name: str = "", instance_id: str = "") -> queue_pb2.ListTasksRequest:
    return queue_pb2.ListTasksRequest(topic_name=topic_name, instance_id=instance_id)
