"""Which handler runs a fetched task, by topic; the agent loop is the handler of `abada:agent`."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from abada.engine.v1 import external_task_pb2

from .errors import AttemptFailed
from .interruption import TaskInterruption

TaskHandler = Callable[[external_task_pb2.ExternalTask, TaskInterruption], Coroutine[Any, Any, None]]


class TaskRouter:
    def __init__(self) -> None:
        self._handlers: dict[str, TaskHandler] = {}

    def add(self, topic: str, handler: TaskHandler) -> None:
        if topic in self._handlers:
            raise ValueError(f"topic {topic!r} already has a handler")
        self._handlers[topic] = handler

    @property
    def topics(self) -> list[str]:
        return list(self._handlers)

    def handler_for(self, task: external_task_pb2.ExternalTask) -> TaskHandler:
        handler = self._handlers.get(task.topic_name)
        if handler is None:
            raise AttemptFailed(
                "NO_HANDLER", f"this worker has no handler for topic {task.topic_name!r}", no_retry=False
            )
        return handler
