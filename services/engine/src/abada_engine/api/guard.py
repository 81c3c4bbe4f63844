"""Authenticating every gRPC call and deciding which role it needs."""

from __future__ import annotations

import contextvars
import dataclasses
import importlib
from typing import Any, ClassVar, dataclass_transform

import grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.auth import Caller, CallerRegistry, require_role
from abada_engine.db.watch import DatabaseWatch
from abada_engine.errors import Category, EngineError

from .errors import translates_errors

current_caller: contextvars.ContextVar[Caller | None] = contextvars.ContextVar("abada_caller", default=None)


def caller_identity(unauthenticated: str = "") -> str:
    """Who sent the current call, as recorded with what it changes; `unauthenticated` when the server
    does not authenticate calls."""
    caller = current_caller.get()
    return caller.identity if caller is not None else unauthenticated


# The role each service needs; the worker's own calls are narrowed further in the handlers.
_SERVICE_ROLES = {
    "abada.engine.v1.DefinitionService": "operator",
    "abada.engine.v1.ProcessService": "operator",
    "abada.engine.v1.IncidentService": "operator",
    "abada.engine.v1.LeaseService": "broker",
    "abada.engine.v1.QueueService": "operator",
    "abada.engine.v1.DependencyService": "operator",
    "abada.engine.v1.BatchService": "operator",
}
# Deciding a tool call is a person's job: an approver's, and an operator may too.
_SERVICE_ANY_ROLE: dict[str, tuple[str, ...]] = {
    "abada.engine.v1.ApprovalService": ("approver", "operator"),
}
_METHOD_ROLES: dict[str, str | tuple[str, ...]] = {
    "abada.engine.v1.ExternalTaskService/GetJournal": "operator",
    # A webhook's identity may publish the messages it is named for, and nothing else (the handler
    # checks the name).
    "abada.engine.v1.ProcessService/PublishMessage": ("operator", "publisher"),
}


def required_role(method: str) -> str | tuple[str, ...]:
    service, _, name = method.strip("/").partition("/")
    return (
        _METHOD_ROLES.get(f"{service}/{name}")
        or _SERVICE_ANY_ROLE.get(service)
        or _SERVICE_ROLES.get(service, "worker")
    )


class Guard:
    def __init__(self, registry: CallerRegistry) -> None:
        self._registry = registry

    def authenticate(self, context: grpc.aio.ServicerContext, method: str) -> Caller:
        caller = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization" and isinstance(value, str) and value.lower().startswith("bearer "):
                caller = self._registry.by_token(value[7:].strip())
                if caller is None:
                    raise EngineError(
                        Category.UNAUTHENTICATED,
                        ErrorReason.UNKNOWN_CREDENTIAL,
                        "the bearer token is not known",
                    )
        if caller is None:
            names = list((context.auth_context() or {}).get("x509_common_name") or [])
            if names:
                caller = self._registry.by_certificate(names[0].decode())
        if caller is None:
            raise EngineError(
                Category.UNAUTHENTICATED,
                ErrorReason.UNAUTHENTICATED,
                "send 'authorization: Bearer <token>' or a client certificate the engine knows",
            )
        require_role(caller, required_role(method), method)
        return caller


@dataclass_transform(eq_default=False)
class ServiceHandler:
    """What every service's handler carries: its service's full name, which the guard checks roles by,
    and what the server gives it (`start_grpc_server`): the guard (None: calls are not authenticated)
    and the watch on whether PostgreSQL answers.

    A handler is declared as `class XHandler(ServiceHandler, x_pb2_grpc.XServiceServicer)`: its
    service's name is read from the descriptor of the servicer it implements, and its RPCs translate
    domain errors (`translates_errors`), so neither can be forgotten or fall out of step with the proto.
    The attributes it annotates are its collaborators, the constructor's parameters in that order (a
    dataclass: a handler's constructor only keeps what it is given)."""

    SERVICE: ClassVar[str]
    guard: Guard | None = None
    database: DatabaseWatch | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.SERVICE = _service_name(cls)
        translates_errors(cls)
        dataclasses.dataclass(eq=False)(cls)


def _service_name(handler: type) -> str:
    """The full name of the service whose generated servicer (`x_pb2_grpc.XServiceServicer`) the
    handler implements, as its descriptor in `x_pb2` gives it."""
    servicer = next(base for base in handler.__bases__ if base.__module__.endswith("_pb2_grpc"))
    descriptors = importlib.import_module(servicer.__module__.removesuffix("_grpc")).DESCRIPTOR
    return str(descriptors.services_by_name[servicer.__name__.removesuffix("Servicer")].full_name)
