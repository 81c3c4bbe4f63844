"""QueueService: the operator's view of the task queue (open tasks, per-topic figures)."""

from __future__ import annotations

import uuid
from datetime import datetime

import grpc
from abada.engine.v1 import queue_pb2, queue_pb2_grpc

from abada_engine import metrics
from abada_engine.paging import PageTokens, listing
from abada_engine.runtime.queue_stats import MAX_LISTED_TASKS, QueuedTask, QueueStats

from .convert import optional_uuid, timestamp
from .guard import ServiceHandler

_DEFAULT_PAGE = 100


def _queued(task: QueuedTask) -> queue_pb2.QueuedTask:
    row = task.row
    return queue_pb2.QueuedTask(
        id=str(row.id),
        topic_name=row.topic,
        instance_id=str(row.instance_id),
        process_id=row.process_id,
        node_id=row.node_id,
        state=task.standing,
        attempt=row.attempt,
        retries_left=row.retries_left,
        lease_owner=row.lease_owner or "",
        lease_expires_at=timestamp(row.lease_expires_at),
        due_time=timestamp(row.due_at),
        create_time=timestamp(row.created_at),
        parked_on=row.parked_on or "",
    )


class QueueHandler(ServiceHandler, queue_pb2_grpc.QueueServiceServicer):
    _stats: QueueStats
    _pages: PageTokens

    async def ListTasks(
        self, request: queue_pb2.ListTasksRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.ListTasksResponse:
        shown, next_token = await self._pages.read(
            request,
            listing("tasks", topic_name=request.topic_name, instance_id=request.instance_id),
            (datetime, uuid.UUID),
            lambda limit, after: self._stats.open_tasks(
                request.topic_name or None, optional_uuid(request.instance_id, "instance_id"), limit, after
            ),
            lambda t: (t.row.created_at, t.row.id),
            default_size=_DEFAULT_PAGE,
            max_size=MAX_LISTED_TASKS,
        )
        return queue_pb2.ListTasksResponse(tasks=[_queued(t) for t in shown], next_page_token=next_token)

    async def ListTopics(
        self, request: queue_pb2.ListTopicsRequest, context: grpc.aio.ServicerContext
    ) -> queue_pb2.ListTopicsResponse:
        topics = sorted(await self._stats.topics(), key=lambda t: t.topic)
        return queue_pb2.ListTopicsResponse(
            topics=[
                queue_pb2.TopicStats(
                    name=t.topic,
                    ready=t.ready,
                    leased=t.leased,
                    delayed=t.delayed,
                    demand=t.demand,
                    oldest_ready_age_seconds=round(t.oldest_ready_age_seconds, 3),
                    quota_waiting=t.quota_waiting,
                    parked=t.parked,
                )
                for t in topics
            ],
            models=[
                queue_pb2.ModelQuotaStats(
                    name=m.name,
                    admitted=m.admitted,
                    tokens=m.tokens,
                    waiting=m.waiting,
                    refused_by_this_replica=metrics.refused_total(m.name),
                )
                for m in await self._stats.models()
            ],
        )
