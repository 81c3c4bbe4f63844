"""IncidentService: thin translation onto incidents."""

from __future__ import annotations

import uuid
from datetime import datetime

import grpc
from abada.engine.v1 import incident_pb2, incident_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.errors import invalid
from abada_engine.paging import MAX_LISTED, PageTokens, listing
from abada_engine.runtime.incidents import MAX_BULK, IncidentFilter, Incidents
from abada_engine.store.incidents import IncidentListing
from abada_engine.store.states import IncidentState

from . import messages
from .convert import chosen, from_struct, optional_uuid, parse_uuid
from .guard import ServiceHandler

_RESOLUTIONS = {
    incident_pb2.RESOLUTION_RETRY: "RETRY",
    incident_pb2.RESOLUTION_HAPPENED: "HAPPENED",
    incident_pb2.RESOLUTION_DID_NOT_HAPPEN: "DID_NOT_HAPPEN",
    incident_pb2.RESOLUTION_CANCEL_INSTANCE: "CANCEL_INSTANCE",
}


class IncidentHandler(ServiceHandler, incident_pb2_grpc.IncidentServiceServicer):
    _incidents: Incidents
    _pages: PageTokens

    async def ListIncidents(
        self, request: incident_pb2.ListIncidentsRequest, context: grpc.aio.ServicerContext
    ) -> incident_pb2.ListIncidentsResponse:
        which = IncidentListing(
            instance_id=optional_uuid(request.instance_id, "instance_id"),
            state=messages.INCIDENT_STATE_NAMES.get(request.state, IncidentState.OPEN),
            type=request.type,
            dependency=_dependency_filter(request),
        )
        shown, next_token = await self._pages.read(
            request,
            # instance_id as sent: a token stays bound to the request's own text, as it always was.
            listing(
                "incidents",
                instance_id=request.instance_id,
                state=which.state,
                type=which.type,
                dependency=which.dependency,
            ),
            (datetime, uuid.UUID),
            lambda limit, after: self._incidents.list(which, limit=limit, after_key=after),
            lambda i: (i.created_at, i.id),
            default_size=MAX_LISTED,
            max_size=MAX_LISTED,
        )
        return incident_pb2.ListIncidentsResponse(
            incidents=[messages.incident(i) for i in shown], next_page_token=next_token
        )

    async def ResolveIncidents(
        self, request: incident_pb2.ResolveIncidentsRequest, context: grpc.aio.ServicerContext
    ) -> incident_pb2.ResolveIncidentsResponse:
        resolution = _RESOLUTIONS.get(request.resolution)
        if resolution not in ("RETRY", "CANCEL_INSTANCE"):
            raise invalid(
                ErrorReason.INVALID_ARGUMENT,
                "resolution",
                "say RETRY or CANCEL_INSTANCE (the others need one decision each)",
            )
        if not request.type:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "type", "name the type of the incidents to resolve")
        if not 0 <= request.max_incidents <= MAX_BULK:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "max_incidents", f"must be between 0 and {MAX_BULK}")
        outcome = await self._incidents.resolve_matching(
            IncidentFilter(
                type=request.type,
                dependency=_dependency_filter(request),
                process_id=request.process_id,
            ),
            resolution,
            request.comment,
            request.max_incidents or MAX_BULK,
        )
        return incident_pb2.ResolveIncidentsResponse(
            resolved=[messages.incident(i) for i in outcome.resolved],
            refused=[
                incident_pb2.IncidentRefusal(
                    incident_id=str(r.incident_id), reason=r.reason, message=r.message
                )
                for r in outcome.refused
            ],
            remaining=outcome.remaining,
        )

    async def ResolveIncident(
        self, request: incident_pb2.ResolveIncidentRequest, context: grpc.aio.ServicerContext
    ) -> incident_pb2.ResolveIncidentResponse:
        resolution = chosen(
            _RESOLUTIONS,
            request.resolution,
            "resolution",
            "say RETRY, HAPPENED, DID_NOT_HAPPEN or CANCEL_INSTANCE",
        )
        result = from_struct(request.result) if request.HasField("result") else None
        resolved = await self._incidents.resolve(
            parse_uuid(request.incident_id, "incident_id"), resolution, result, request.comment
        )
        return incident_pb2.ResolveIncidentResponse(incident=messages.incident(resolved))


def _dependency_filter(
    request: incident_pb2.ListIncidentsRequest | incident_pb2.ResolveIncidentsRequest,
) -> str:
    """The dependency key a request filters on ("" for none)."""
    if not request.HasField("dependency"):
        return ""
    key = messages.dependency_key_of(request.dependency)
    if not key or not request.dependency.name:
        raise invalid(ErrorReason.INVALID_ARGUMENT, "dependency", "give the dependency's kind and name")
    return key
