"""Domain errors to gRPC statuses carrying `google.rpc.ErrorInfo` and `BadRequest` details."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common import rpc_status
from google.rpc import status_pb2

from abada_engine.db.outage import conflicted, database_unreachable, unstorable_text
from abada_engine.db.watch import DatabaseWatch
from abada_engine.errors import Category, EngineError
from abada_engine.metrics import RPC_SECONDS

log = logging.getLogger(__name__)

# A request that met PostgreSQL out of reach: send it again shortly (every RPC may be repeated safely).
DATABASE_UNAVAILABLE = EngineError(
    Category.UNAVAILABLE,
    ErrorReason.DATABASE_UNAVAILABLE,
    "the engine cannot reach its database; try again shortly",
)


def _violations(error: EngineError) -> list[rpc_status.Violation]:
    return [rpc_status.Violation(problem.field, str(problem)) for problem in error.problems]


INTERNAL_ERROR = EngineError(Category.INTERNAL, ErrorReason.INTERNAL, "internal error; see the engine log")

# PostgreSQL rolled the call's transaction back on meeting another one (a deadlock between, say, a
# cancel and a completion of the same instance): nothing was written, and the call may be sent again.
CONFLICTED = EngineError(
    Category.ABORTED,
    ErrorReason.CONCURRENT_CHANGE,
    "the call met another change of the same rows at the same moment and was rolled back; send it again",
    retry_after_seconds=0.1,
)

# The checks of each field run first; this catches a text the database refuses that no check named.
UNSTORABLE_TEXT = EngineError(
    Category.INVALID_ARGUMENT,
    ErrorReason.INVALID_ARGUMENT,
    "a text in the request holds a character the database cannot store (such as NUL, U+0000)",
)


def status_of(error: EngineError) -> status_pb2.Status:
    """The refusal as the `google.rpc.Status` a failed call would carry."""
    return rpc_status.status_message(
        error.category,
        error.reason_name,
        error.message,
        field=error.field,
        metadata=error.metadata,
        retry_after_seconds=error.retry_after_seconds,
        violations=_violations(error),
    )


async def abort(context: grpc.aio.ServicerContext, error: EngineError) -> None:
    await rpc_status.abort(context, status_of(error))


Servicer = TypeVar("Servicer", bound=type)


def translates_errors(cls: Servicer) -> Servicer:
    """Wrap every RPC method of a servicer so domain errors become rich gRPC statuses."""
    for name, method in list(vars(cls).items()):
        if name.startswith("_") or not inspect.iscoroutinefunction(method):
            continue
        setattr(cls, name, _wrap(method))
    return cls


def _wrap(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        from .guard import current_caller

        began = time.perf_counter()
        code = "OK"
        try:
            guard = getattr(self, "guard", None)
            if guard is not None:
                current_caller.set(guard.authenticate(context, f"{self.SERVICE}/{method.__name__}"))
            return await method(self, request, context)
        except Exception as error:
            refusal = as_refusal(error, method.__qualname__, getattr(self, "database", None))
            code = rpc_status.CODES[refusal.category].name
            await abort(context, refusal)
        finally:
            RPC_SECONDS.labels(method.__name__, code).observe(time.perf_counter() - began)

    return handler


def as_refusal(error: Exception, where: str, database: DatabaseWatch | None) -> EngineError:
    """What a call that raised `error` answers: a domain error as it is; PostgreSQL out of reach (which
    turns the engine's health NOT_SERVING at once), a text the database cannot store, or anything
    unexpected (logged here, with its traceback) as the engine's own refusals."""
    if isinstance(error, EngineError):
        return error
    if database_unreachable(error):
        if database is not None:
            database.report_unreachable()
        log.warning("%s: the database is unreachable (%s)", where, type(error).__name__)
        return DATABASE_UNAVAILABLE
    if unstorable_text(error):
        return UNSTORABLE_TEXT
    if conflicted(error):
        log.info("%s: rolled back on meeting another transaction (%s)", where, type(error).__name__)
        return CONFLICTED
    log.error("unexpected error in %s", where, exc_info=error)
    return INTERNAL_ERROR
