"""Abada's Python SDK: a typed engine client (AsyncEngineClient, EngineClient) and a task Worker."""

from .client import AsyncEngineClient, InstanceHandle, Stubs
from .connection import Connection
from .errors import (
    AbadaError,
    AlreadyExists,
    EngineUnavailable,
    FailedPrecondition,
    InstanceFailed,
    InvalidArgument,
    LeaseLost,
    NotFound,
    PermissionDenied,
    TaskFailed,
    Unauthenticated,
)
from .models import (
    Approval,
    ApprovalState,
    Definition,
    Deployment,
    HistoryEvent,
    Incident,
    Instance,
    InstanceState,
    JournalStep,
    Resolution,
    Task,
    UserTask,
)
from .sync_client import EngineClient, SyncInstanceHandle
from .worker import Worker

__version__ = "0.1.0"

__all__ = [
    "AbadaError",
    "AlreadyExists",
    "Approval",
    "ApprovalState",
    "AsyncEngineClient",
    "Connection",
    "Definition",
    "Deployment",
    "EngineClient",
    "EngineUnavailable",
    "FailedPrecondition",
    "HistoryEvent",
    "Incident",
    "Instance",
    "InstanceFailed",
    "InstanceHandle",
    "InstanceState",
    "InvalidArgument",
    "JournalStep",
    "LeaseLost",
    "NotFound",
    "PermissionDenied",
    "Resolution",
    "Stubs",
    "SyncInstanceHandle",
    "Task",
    "TaskFailed",
    "Unauthenticated",
    "UserTask",
    "Worker",
    "__version__",
]
