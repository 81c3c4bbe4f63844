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


# A client refuses trailers over 8 KiB (gRPC's default metadata limit) and then reports
# RESOURCE_EXHAUSTED instead of the real status. The message travels twice (grpc-message,
# percent-encoded: up to 3 bytes per byte; and inside grpc-status-details-bin, base64: 4/3), so an
# error repeats at most this much of what it was given, whatever the caller sent.
MAX_MESSAGE_BYTES = 1_000
MAX_METADATA_VALUE_CHARS = 200
MAX_DETAILS_BYTES = 3_600


def bounded(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, saying how much was left out."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    kept = raw[: max(0, limit - 40)].decode(errors="ignore")
    return f"{kept}… ({len(raw) - len(kept.encode())} more bytes)"


def status_details(error: EngineError) -> tuple[grpc.StatusCode, str, bytes]:
    """The status code, the (bounded) message and the serialized google.rpc.Status for `error`."""
    code = _CODES[error.category]
    message = bounded(error.message, MAX_MESSAGE_BYTES)
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=DOMAIN)
    if error.field:
        info.metadata["field"] = bounded(error.field, MAX_METADATA_VALUE_CHARS)
    for key, value in error.metadata.items():
        info.metadata[bounded(key, 60)] = bounded(value, MAX_METADATA_VALUE_CHARS)
    status = status_pb2.Status(code=getattr(code_pb2, code.name), message=message)
    _pack(status, info)
    if error.retry_after_seconds is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(max(0, round(error.retry_after_seconds * 1000)))
        _pack(status, retry)
    if error.problems:
        _pack(status, _bad_request(error, MAX_DETAILS_BYTES - status.ByteSize()))
    return code, message, status.SerializeToString()


def _pack(status: status_pb2.Status, detail: Any) -> None:
    packed = any_pb2.Any()
    packed.Pack(detail)
    status.details.append(packed)


def _bad_request(error: EngineError, budget: int) -> error_details_pb2.BadRequest:
    """Every problem while they fit in `budget` bytes, then one line saying how many more there are."""
    bad_request = error_details_pb2.BadRequest()
    for index, problem in enumerate(error.problems):
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=bounded(problem.field, MAX_METADATA_VALUE_CHARS), description=bounded(str(problem), 500)
        )
        if bad_request.ByteSize() + violation.ByteSize() + 120 > budget:
            left = len(error.problems) - index
            bad_request.field_violations.add(
                field="", description=f"… and {left} more problem{'s' if left != 1 else ''}, not shown"
            )
            break
        bad_request.field_violations.append(violation)
    return bad_request


async def abort(context: grpc.aio.ServicerContext, error: EngineError) -> None:
    code, message, details = status_details(error)
    await context.abort(code, message, trailing_metadata=(("grpc-status-details-bin", details),))


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
                watch = getattr(self, "database", None)
                if watch is not None:
                    watch.report_unreachable()
                log.warning("%s: the database is unreachable (%s)", method.__qualname__, type(error).__name__)
                await abort(context, DATABASE_UNAVAILABLE)
            else:
                code = "INTERNAL"
                log.exception("unexpected error in %s", method.__qualname__)
                await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the engine log")
        finally:
            RPC_SECONDS.labels(method.__name__, code).observe(time.perf_counter() - began)

    return handler
