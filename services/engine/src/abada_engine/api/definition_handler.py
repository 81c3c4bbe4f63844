"""DefinitionService: thin translation onto the definition catalog."""

from __future__ import annotations

import grpc
from abada.engine.v1 import definition_pb2, definition_pb2_grpc
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.definitions.catalog import DefinitionCatalog
from abada_engine.errors import invalid
from abada_engine.paging import PageTokens, listing

from . import messages
from .convert import parse_uuid
from .guard import ServiceHandler, caller_identity

MAX_BUNDLE_BYTES = 4 * 1024 * 1024


class DefinitionHandler(ServiceHandler, definition_pb2_grpc.DefinitionServiceServicer):
    _catalog: DefinitionCatalog
    _pages: PageTokens

    async def Deploy(
        self, request: definition_pb2.DeployRequest, context: grpc.aio.ServicerContext
    ) -> definition_pb2.DeployResponse:
        if not request.content.strip():
            raise invalid(ErrorReason.DEFINITION_INVALID, "content", "the bundle is empty")
        if len(request.content.encode()) > MAX_BUNDLE_BYTES:
            raise invalid(
                ErrorReason.DEFINITION_INVALID,
                "content",
                f"the bundle is larger than {MAX_BUNDLE_BYTES} bytes",
            )
        result = await self._catalog.deploy(request.content, request.source_name, caller_identity())
        return definition_pb2.DeployResponse(
            definitions=[messages.definition(d) for d in result.definitions],
            created_process_ids=result.created_process_ids,
        )

    async def GetDefinition(
        self, request: definition_pb2.GetDefinitionRequest, context: grpc.aio.ServicerContext
    ) -> definition_pb2.GetDefinitionResponse:
        if request.definition_id:
            found = await self._catalog.get(parse_uuid(request.definition_id, "definition_id"))
        elif request.process_id:
            found = await self._catalog.find(request.process_id, request.version)
        else:
            raise invalid(ErrorReason.INVALID_ARGUMENT, "process_id", "give a definition_id or a process_id")
        return definition_pb2.GetDefinitionResponse(definition=messages.definition(found))

    async def ListDefinitions(
        self, request: definition_pb2.ListDefinitionsRequest, context: grpc.aio.ServicerContext
    ) -> definition_pb2.ListDefinitionsResponse:
        shown, next_token = await self._pages.read(
            request,
            listing("definitions", process_id=request.process_id),
            (str, int),
            lambda limit, after: self._catalog.list(request.process_id, limit=limit, after_key=after),
            lambda d: (d.process_id, d.version),
        )
        return definition_pb2.ListDefinitionsResponse(
            definitions=[messages.definition(d) for d in shown], next_page_token=next_token
        )
