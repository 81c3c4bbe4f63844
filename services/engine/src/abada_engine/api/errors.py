"""Domain errors to gRPC statuses carrying `google.rpc.ErrorInfo` and `BadRequest` details."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from abada_engine.db.outage import database_unreachable
from abada_engine.errors import Category, EngineError
from abada_engine.metrics import RPC_SECONDS

log = logging.getLogger(__name__)

DOMAIN = "abada.dev"

_CODES: dict[Category, grpc.StatusCode] = {
    Category.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Category.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Category.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Category.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Category.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Category.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Category.ABORTED: grpc.StatusCode.ABORTED,
    Category.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Category.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Category.DATA_LOSS: grpc.StatusCode.DATA_LOSS,
}


# A request that met PostgreSQL out of reach: send it again shortly (every RPC may be repeated safely).
DATABASE_UNAVAILABLE = EngineError(
    Category.UNAVAILABLE, "DATABASE_UNAVAILABLE", "the engine cannot reach its database; try again shortly"
)


def status_details(error: EngineError) -> tuple[grpc.StatusCode, bytes]:
    code = _CODES[error.category]
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN)
    if error.field:
        info.metadata["field"] = error.field
    for key, value in error.metadata.items():
        info.metadata[key] = value
    details: list[Any] = [info]
    if error.retry_after_seconds is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(max(0, round(error.retry_after_seconds * 1000)))
        details.append(retry)
    if error.problems:
        bad_request = error_details_pb2.BadRequest()
        for problem in error.problems:
            bad_request.field_violations.add(field=problem.field, description=str(problem))
        details.append(bad_request)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=error.message)
    for detail in details:
        packed = any_pb2.Any()
        packed.Pack(detail)
        status.details.append(packed)
    return code, status.SerializeToString()


async def abort(context: grpc.aio.ServicerContext, error: EngineError) -> None:
    code, details = status_details(error)
    await context.abort(code, error.message, trailing_metadata=(("grpc-status-details-bin", details),))


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
        except EngineError as error:
            code = _CODES[error.category].name
            await abort(context, error)
        except Exception as error:
            if database_unreachable(error):
                code = "UNAVAILABLE"
                log.warning("%s: the database is unreachable (%s)", method.__qualname__, type(error).__name__)
                await abort(context, DATABASE_UNAVAILABLE)
            else:
                code = "INTERNAL"
                log.exception("unexpected error in %s", method.__qualname__)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the engine log")
        finally:
            RPC_SECONDS.labels(method.__name__, code).observe(time.perf_counter() - began)

    return handler
