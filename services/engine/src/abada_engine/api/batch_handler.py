"""BatchService: thin translation onto batches."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from abada.engine.v1 import batch_pb2, batch_pb2_grpc, process_pb2

from abada_engine.runtime.batches import Batches, BatchView, Migration
from abada_engine.runtime.instances import MAX_VARIABLES_BYTES
from abada_engine.runtime.repairs import Modification
from abada_engine.store.batches import BatchFilter, BatchItemRow
from abada_engine.store.states import BatchKind, BatchOutcome, BatchState, InstanceState

from .convert import (
    chosen,
    from_struct,
    optional_uuid,
    parse_uuid,
    storable,
    storable_text,
    timestamp,
    to_struct,
)
from .guard import ServiceHandler, caller_identity

_KINDS = {
    batch_pb2.BATCH_KIND_RETRY_INCIDENTS: BatchKind.RETRY_INCIDENTS,
    batch_pb2.BATCH_KIND_CANCEL: BatchKind.CANCEL,
    batch_pb2.BATCH_KIND_MIGRATE: BatchKind.MIGRATE,
    batch_pb2.BATCH_KIND_MODIFY: BatchKind.MODIFY,
}
_KIND_NUMBERS = {v: k for k, v in _KINDS.items()}
_STATES = {
    BatchState.RUNNING: batch_pb2.BATCH_STATE_RUNNING,
    BatchState.PAUSED: batch_pb2.BATCH_STATE_PAUSED,
    BatchState.COMPLETED: batch_pb2.BATCH_STATE_COMPLETED,
    BatchState.CANCELED: batch_pb2.BATCH_STATE_CANCELED,
}
_OUTCOMES = {
    BatchOutcome.PENDING: batch_pb2.BATCH_OUTCOME_PENDING,
    BatchOutcome.DONE: batch_pb2.BATCH_OUTCOME_DONE,
    BatchOutcome.SKIPPED: batch_pb2.BATCH_OUTCOME_SKIPPED,
    BatchOutcome.FAILED: batch_pb2.BATCH_OUTCOME_FAILED,
}
_OUTCOME_NAMES = {v: k for k, v in _OUTCOMES.items()}
MAX_BATCHES_LISTED = 100
MAX_ITEMS_LISTED = 1000


class BatchHandler(ServiceHandler, batch_pb2_grpc.BatchServiceServicer):
    _batches: Batches

    async def CreateBatch(
        self, request: batch_pb2.CreateBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.CreateBatchResponse:
        kind = chosen(_KINDS, request.kind, "kind", "is required: RETRY_INCIDENTS, CANCEL, MIGRATE or MODIFY")
        given = request.filter
        which = BatchFilter(
            process_id=storable_text(given.process_id, "filter.process_id"),
            version=given.version,
            state=storable_text(given.state.upper(), "filter.state") or InstanceState.ACTIVE,
            node_id=storable_text(given.node_id, "filter.node_id"),
            business_key=storable_text(given.business_key, "filter.business_key"),
            incident_type=storable_text(given.incident_type, "filter.incident_type"),
            incident_message=storable_text(given.incident_message, "filter.incident_message"),
        )
        reason = storable_text(request.reason, "reason")
        created = await self._batches.create(
            kind,
            which,
            reason,
            caller_identity(),
            migration=_migration(request) if request.HasField("migration") else None,
            modification=_modification(request, reason) if request.HasField("modification") else None,
        )
        return batch_pb2.CreateBatchResponse(batch=_batch(created))

    async def ListBatches(
        self, request: batch_pb2.ListBatchesRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.ListBatchesResponse:
        size = request.page_size if 0 < request.page_size <= MAX_BATCHES_LISTED else MAX_BATCHES_LISTED
        return batch_pb2.ListBatchesResponse(batches=[_batch(b) for b in await self._batches.list(size)])

    async def GetBatch(
        self, request: batch_pb2.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.GetBatchResponse:
        batch_id = parse_uuid(request.batch_id, "batch_id")
        view = await self._batches.get(batch_id)
        size = request.page_size if 0 < request.page_size <= MAX_ITEMS_LISTED else 100
        items = await self._batches.items(
            batch_id,
            size,
            optional_uuid(request.after_instance_id, "after_instance_id"),
            _OUTCOME_NAMES.get(request.outcome, ""),
        )
        return batch_pb2.GetBatchResponse(batch=_batch(view), items=[_item(i) for i in items])

    async def PauseBatch(
        self, request: batch_pb2.PauseBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.PauseBatchResponse:
        changed = await self._batches.pause(parse_uuid(request.batch_id, "batch_id"))
        return batch_pb2.PauseBatchResponse(batch=_batch(changed))

    async def ResumeBatch(
        self, request: batch_pb2.ResumeBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.ResumeBatchResponse:
        changed = await self._batches.resume(parse_uuid(request.batch_id, "batch_id"))
        return batch_pb2.ResumeBatchResponse(batch=_batch(changed))

    async def CancelBatch(
        self, request: batch_pb2.CancelBatchRequest, context: grpc.aio.ServicerContext
    ) -> batch_pb2.CancelBatchResponse:
        changed = await self._batches.cancel(parse_uuid(request.batch_id, "batch_id"))
        return batch_pb2.CancelBatchResponse(batch=_batch(changed))


def _pairs(mappings: Iterable[process_pb2.NodeMapping], field: str) -> list[tuple[str, str]]:
    return [(storable_text(m.from_node_id, field), storable_text(m.to_node_id, field)) for m in mappings]


def _migration(request: batch_pb2.CreateBatchRequest) -> Migration:
    return Migration(
        to_version=request.migration.to_version,
        mappings=dict(_pairs(request.migration.mappings, "migration.mappings")),
    )


def _modification(request: batch_pb2.CreateBatchRequest, reason: str) -> Modification:
    given = request.modification
    field = "modification.set_variables"
    return Modification(
        reason=reason,
        set_variables=storable(from_struct(given.set_variables, field), field, MAX_VARIABLES_BYTES),
        unset_variables=tuple(
            storable_text(n, "modification.unset_variables") for n in given.unset_variables
        ),
        moves=tuple(_pairs(given.moves, "modification.moves")),
    )


def _node_mappings(pairs: Iterable[tuple[str, str]]) -> list[process_pb2.NodeMapping]:
    return [process_pb2.NodeMapping(from_node_id=old, to_node_id=new) for old, new in pairs]


def _batch(view: BatchView) -> batch_pb2.Batch:
    which, row = view.filter, view.row
    return batch_pb2.Batch(
        id=str(row.id),
        kind=_KIND_NUMBERS.get(BatchKind(row.kind), batch_pb2.BATCH_KIND_UNSPECIFIED)
        if row.kind in tuple(BatchKind)
        else batch_pb2.BATCH_KIND_UNSPECIFIED,
        state=_STATES.get(BatchState(row.state), batch_pb2.BATCH_STATE_UNSPECIFIED),
        filter=batch_pb2.BatchFilter(
            process_id=which.process_id,
            version=which.version,
            state=which.state,
            node_id=which.node_id,
            business_key=which.business_key,
            incident_type=which.incident_type,
            incident_message=which.incident_message,
        ),
        reason=view.reason,
        created_by=row.created_by,
        create_time=timestamp(row.created_at),
        end_time=timestamp(row.ended_at),
        total=row.total,
        done=row.done,
        skipped=row.skipped,
        failed=row.failed,
        pending=view.pending,
        migration=batch_pb2.BatchMigration(
            to_version=view.migration.to_version, mappings=_node_mappings(view.migration.mappings.items())
        )
        if view.migration is not None
        else None,
        modification=batch_pb2.BatchModification(
            set_variables=to_struct(view.modification.set_variables),
            unset_variables=list(view.modification.unset_variables),
            moves=_node_mappings(view.modification.moves),
        )
        if view.modification is not None
        else None,
    )


def _item(row: BatchItemRow) -> batch_pb2.BatchItem:
    return batch_pb2.BatchItem(
        instance_id=str(row.instance_id),
        outcome=_OUTCOMES.get(BatchOutcome(row.outcome), batch_pb2.BATCH_OUTCOME_UNSPECIFIED),
        message=row.message,
        finish_time=timestamp(row.finished_at),
    )
