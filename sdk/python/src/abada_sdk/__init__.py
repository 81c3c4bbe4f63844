"""Abada's Python SDK: a typed engine client (AsyncEngineClient, EngineClient) and a task Worker."""

from . import models
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

# The model views are named once, in models.__all__.
from .models import *  # noqa: F403
from .sync_client import EngineClient, SyncInstanceHandle
from .worker import Worker

__version__ = "0.1.0"

__all__ = [
    "AbadaError",
    "AlreadyExists",
    "AsyncEngineClient",
    "Connection",
    "EngineClient",
    "EngineUnavailable",
    "FailedPrecondition",
    "InstanceFailed",
    "InstanceHandle",
    "InvalidArgument",
    "LeaseLost",
    "NotFound",
    "PermissionDenied",
    "Stubs",
    "SyncInstanceHandle",
    "TaskFailed",
    "Unauthenticated",
    "Worker",
    "__version__",
]
__all__ += models.__all__
