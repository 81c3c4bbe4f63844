"""Domain errors: what went wrong, in terms a caller can act on.

The gRPC layer (api/errors.py, through abada_common.rpc_status) maps each category onto a status
code and each reason onto a `google.rpc.ErrorInfo`; the domain never imports gRPC.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from dataclasses import field as dataclass_field

from abada.engine.v1.error_reason_pb2 import ErrorReason
from abada_common.errors import Category as Category  # the services' one list of categories


@dataclass(frozen=True)
class FieldProblem:
    """One offending field: where it is and why it is wrong."""

    field: str
    why: str
    file: str = ""
    line: int = 0

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}: " if self.file else ""
        return f"{where}{self.field}: {self.why}"


@dataclass
class EngineError(Exception):
    category: Category
    # Declared once, in the protos: its name is the ErrorInfo reason the caller reads.
    reason: ErrorReason
    message: str
    field: str = ""
    problems: list[FieldProblem] = dataclass_field(default_factory=list)
    metadata: dict[str, str] = dataclass_field(default_factory=dict)
    # When asking again makes sense (a quota frees up): sent as google.rpc.RetryInfo.
    retry_after_seconds: float | None = None

    def __post_init__(self) -> None:
        super().__init__(self.message)

    def __str__(self) -> str:
        return self.message

    @property
    def reason_name(self) -> str:
        return ErrorReason.Name(self.reason)


def invalid(reason: ErrorReason, field_name: str, why: str) -> EngineError:
    return EngineError(Category.INVALID_ARGUMENT, reason, f"{field_name}: {why}", field=field_name)


def not_found(what: str, ident: str, field_name: str) -> EngineError:
    return EngineError(
        Category.NOT_FOUND, ErrorReason.NOT_FOUND, f"{what} {ident!r} not found", field=field_name
    )


def precondition(
    reason: ErrorReason, message: str, field_name: str = "", metadata: dict[str, str] | None = None
) -> EngineError:
    return EngineError(
        Category.FAILED_PRECONDITION, reason, message, field=field_name, metadata=metadata or {}
    )


def not_active(instance_id: uuid.UUID, state: str, field: str = "instance_id") -> EngineError:
    """The instance has ended (or was never started): what it was asked needs it running. `field` is
    the request's field that led to it (an incident's id names its instance too)."""
    return precondition(ErrorReason.INSTANCE_NOT_ACTIVE, f"instance {instance_id} is {state.lower()}", field)
