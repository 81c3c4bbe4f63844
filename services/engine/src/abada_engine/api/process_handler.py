"""ProcessService: thin translation onto instances."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import grpc
from abada.engine.v1 import process_pb2, process_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.errors import Category, EngineError, invalid
from abada_engine.paging import MAX_LISTED, PageTokens, listing
from abada_engine.runtime.instances import MAX_VARIABLES_BYTES, Instances
from abada_engine.runtime.repairs import Modification, Repairs
from abada_engine.runtime.retention import Retention
from abada_engine.runtime.waits import Waits
from abada_engine.store.instances import InstanceListing
from abada_engine.store.states import TaskKind

from . import messages
from .convert import (
    from_struct,
    from_value,
    optional_time,
    optional_uuid,
    parse_uuid,
    storable,
    storable_text,
)
from .guard import ServiceHandler, caller_identity, current_caller

# A request id is the caller's own key for one start (a webhook's delivery id, a UUID).
MAX_REQUEST_ID_CHARS = 200


# Variables a listing may match at once.
MAX_VARIABLE_FILTERS = 10


def _variables_holding(filters: Sequence[process_pb2.VariableEquals]) -> dict[str, Any]:
    """`variables=[customerId = "C-42", ...]` as the object the instance's variables must contain."""
    if len(filters) > MAX_VARIABLE_FILTERS:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "variables", f"at most {MAX_VARIABLE_FILTERS} at once")
    holding: dict[str, Any] = {}
    for index, wanted in enumerate(filters):
        where = f"variables[{index}]"
        if not wanted.name or len(wanted.name) > 200:
            raise invalid(ErrorReason.INVALID_ARGUMENT, f"{where}.name", "must be 1 to 200 characters")
        if not wanted.HasField("value") or wanted.value.WhichOneof("kind") is None:
            raise invalid(ErrorReason.INVALID_ARGUMENT, f"{where}.value", "is required (null is a value)")
        if wanted.name in holding:
            raise invalid(ErrorReason.INVALID_ARGUMENT, f"{where}.name", f"{wanted.name!r} is given twice")
        holding[storable_text(wanted.name, f"{where}.name")] = from_value(wanted.value, f"{where}.value")
    return storable(holding, "variables", MAX_VARIABLES_BYTES)


def _key(row: Any) -> tuple[datetime, uuid.UUID]:
    """The sort key of instances and user tasks: where the next page starts."""
    return (row.created_at, row.id)


def _variables(struct: object, field: str) -> dict:
    return storable(from_struct(struct, field), field, MAX_VARIABLES_BYTES)  # type: ignore[arg-type]


class ProcessHandler(ServiceHandler, process_pb2_grpc.ProcessServiceServicer):
    _instances: Instances
    _pages: PageTokens
    _waits: Waits
    _retention: Retention
    _repairs: Repairs

    async def StartInstance(
        self, request: process_pb2.StartInstanceRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.StartInstanceResponse:
        if request.version < 0:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "version", "must be 0 (latest) or a version number")
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                "request_id",
                f"must be at most {MAX_REQUEST_ID_CHARS} characters",
            )
        started = await self._instances.start(
            request.process_id,
            request.version,
            _variables(request.variables, "variables"),
            storable_text(request.business_key, "business_key"),
            storable_text(request.request_id, "request_id"),
        )
        return process_pb2.StartInstanceResponse(
            instance=messages.instance(started.instance), already_started=started.already_started
        )

    async def GetInstance(
        self, request: process_pb2.GetInstanceRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.GetInstanceResponse:
        found = await self._instances.get(parse_uuid(request.instance_id, "instance_id"))
        return process_pb2.GetInstanceResponse(instance=messages.instance(found))

    async def ListInstances(
        self, request: process_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.ListInstancesResponse:
        state = messages.INSTANCE_STATE_NAMES.get(request.state, "")
        created_after = optional_time(request, "created_after")
        created_before = optional_time(request, "created_before")
        holding = _variables_holding(request.variables)
        parent = (
            parse_uuid(request.parent_instance_id, "parent_instance_id")
            if request.parent_instance_id
            else None
        )
        which = InstanceListing(
            process_id=request.process_id,
            state=state,
            business_key=request.business_key,
            created_after=created_after,
            created_before=created_before,
            variables_holding=holding,
            waiting_for=_WAITING_FOR.get(request.waiting_for),
            parent_instance_id=parent,
        )
        shown, next_token = await self._pages.read(
            request,
            listing(
                "instances",
                process_id=request.process_id,
                state=state,
                business_key=request.business_key,
                created_after=created_after,
                created_before=created_before,
                variables=json.dumps(holding, sort_keys=True),
                waiting_for=str(request.waiting_for or ""),
                # Only when set: tokens issued before the filter existed stay valid.
                **({"parent_instance_id": request.parent_instance_id} if request.parent_instance_id else {}),
            ),
            (datetime, uuid.UUID),
            lambda limit, after: self._instances.list(which, limit=limit, after_key=after),
            _key,
        )
        return process_pb2.ListInstancesResponse(
            instances=[messages.instance(i) for i in shown], next_page_token=next_token
        )

    async def GetHistory(
        self, request: process_pb2.GetHistoryRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.GetHistoryResponse:
        events = await self._instances.history(parse_uuid(request.instance_id, "instance_id"))
        return process_pb2.GetHistoryResponse(events=[messages.history_event(e) for e in events])

    async def CancelInstance(
        self, request: process_pb2.CancelInstanceRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.CancelInstanceResponse:
        canceled = await self._instances.cancel(
            parse_uuid(request.instance_id, "instance_id"), request.reason
        )
        return process_pb2.CancelInstanceResponse(instance=messages.instance(canceled))

    async def ListUserTasks(
        self, request: process_pb2.ListUserTasksRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.ListUserTasksResponse:
        shown, next_token = await self._pages.read(
            request,
            listing("user_tasks", instance_id=request.instance_id),
            (datetime, uuid.UUID),
            lambda limit, after: self._instances.user_tasks(
                optional_uuid(request.instance_id, "instance_id"), limit, after
            ),
            _key,
            default_size=MAX_LISTED,
            max_size=MAX_LISTED,
        )
        return process_pb2.ListUserTasksResponse(
            user_tasks=[messages.user_task(t) for t in shown], next_page_token=next_token
        )

    async def CompleteUserTask(
        self, request: process_pb2.CompleteUserTaskRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.CompleteUserTaskResponse:
        instance = await self._instances.complete_user_task(
            parse_uuid(request.user_task_id, "user_task_id"), _variables(request.variables, "variables")
        )
        return process_pb2.CompleteUserTaskResponse(instance=messages.instance(instance))

    async def PublishMessage(
        self, request: process_pb2.PublishMessageRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.PublishMessageResponse:
        caller = current_caller.get()
        if not request.name:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "name", "name the message")
        if not request.correlation_key:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "correlation_key", "give the key a receive waits for")
        if caller is not None and not caller.may_publish(request.name):
            raise EngineError(
                Category.PERMISSION_DENIED,
                ErrorReason.MESSAGE_NOT_ALLOWED,
                f"{caller.identity!r} may not publish {request.name!r}",
                field="name",
            )
        ttl = request.ttl.ToTimedelta().total_seconds() if request.HasField("ttl") else 0.0
        if ttl < 0:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "ttl", "must not be negative")
        published = await self._waits.publish(
            storable_text(request.name, "name"),
            storable_text(request.correlation_key, "correlation_key"),
            _variables(request.variables, "variables"),
            ttl,
            storable_text(request.message_id, "message_id") or None,
            caller_identity(),
        )
        instance_id = published.correlated_instance_id
        return process_pb2.PublishMessageResponse(
            message_key=str(published.message_key),
            instance_id=str(instance_id) if instance_id else "",
            correlated=instance_id is not None,
            duplicate=published.duplicate,
        )

    async def PurgeInstances(
        self, request: process_pb2.PurgeInstancesRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.PurgeInstancesResponse:
        before = optional_time(request, "before")
        if before is None:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "before", "is required: instances that ended before it go"
            )
        purged = await self._retention.purge(
            before, storable_text(request.process_id, "process_id"), request.dry_run
        )
        return process_pb2.PurgeInstancesResponse(
            instances=purged.instances, rows=purged.rows, dry_run=purged.dry_run
        )

    async def EraseInstances(
        self, request: process_pb2.EraseInstancesRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.EraseInstancesResponse:
        holding = _variables_holding(request.variables)
        if not request.business_key and not holding:
            raise invalid(
                ErrorReason.INVALID_ARGUMENT, "business_key", "name the customer: a business key or variables"
            )
        erased = await self._retention.erase(
            storable_text(request.business_key, "business_key"),
            holding,
            request.cancel_active,
            caller_identity(),
        )
        return process_pb2.EraseInstancesResponse(
            instances=erased.instances, canceled=erased.canceled, rows=erased.rows, erasure_id=erased.audit_id
        )

    async def ModifyInstance(
        self, request: process_pb2.ModifyInstanceRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.ModifyInstanceResponse:
        instance_id = parse_uuid(request.instance_id, "instance_id")
        change = Modification(
            reason=storable_text(request.reason, "reason"),
            set_variables=_variables(request.set_variables, "set_variables"),
            unset_variables=tuple(storable_text(n, "unset_variables") for n in request.unset_variables),
            moves=tuple(
                (storable_text(m.from_node_id, "moves"), storable_text(m.to_node_id, "moves"))
                for m in request.moves
            ),
        )
        await self._repairs.modify(instance_id, change, caller_identity())
        return process_pb2.ModifyInstanceResponse(
            instance=messages.instance(await self._instances.get(instance_id))
        )

    async def MigrateInstances(
        self, request: process_pb2.MigrateInstancesRequest, context: grpc.aio.ServicerContext
    ) -> process_pb2.MigrateInstancesResponse:
        if not request.process_id:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "process_id", "is required")
        migrated = await self._repairs.migrate(
            storable_text(request.process_id, "process_id"),
            request.from_version,
            request.to_version,
            {
                storable_text(m.from_node_id, "mappings"): storable_text(m.to_node_id, "mappings")
                for m in request.mappings
            },
            [parse_uuid(i, "instance_ids") for i in request.instance_ids],
            request.dry_run,
            caller_identity(),
        )
        return process_pb2.MigrateInstancesResponse(
            plan=[
                process_pb2.NodeMapping(from_node_id=old, to_node_id=new)
                for old, new in migrated.nodes.items()
            ],
            instances=migrated.instances,
            dry_run=migrated.dry_run,
        )


_WAITING_FOR = {
    process_pb2.WAITING_FOR_TIMER: TaskKind.TIMER,
    process_pb2.WAITING_FOR_MESSAGE: TaskKind.RECEIVE,
}
