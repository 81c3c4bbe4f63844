"""Deploying bundles and reading frozen definition versions back.

A version never changes once written, so every replica may cache it forever. Which version is the
latest can change under any replica (another one deploys): the catalog only *believes* it knows,
and a start that relies on the belief has its statement re-check it (see `Instances.start`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.errors import EngineError, not_found
from abada_engine.store import definitions as definition_store
from abada_engine.store.definitions import DefinitionRow

from .model import Bundle, Process, ToolBinding, ToolServerSpec, ToolSpec
from .parser import parse_bundle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ObservedTool:
    """What deploy saw of one live tool: hashes of the input schema and of the description, and the
    input schema itself (the approvals inbox builds its argument forms from it)."""

    input_schema_sha256: str
    description_sha256: str
    input_schema: dict[str, Any] | None = None


# What deploy learned from the live tool servers, by (server, tool).
ObservedSchemas = dict[tuple[str, str], ObservedTool]
# Called with the bundle and the identity of the operator deploying it.
ContractCheck = Callable[[Bundle, str], Awaitable[ObservedSchemas]]


@dataclass(frozen=True)
class Definition:
    id: uuid.UUID
    process_id: str
    version: int
    content_sha256: str
    source_name: str
    created_at: datetime
    process: Process
    tool_bindings: tuple[ToolBinding, ...]

    def bindings_for(self, node_id: str) -> list[ToolBinding]:
        node = self.process.node(node_id)
        by_ref = {b.ref: b for b in self.tool_bindings}
        return [by_ref[ref] for ref in node.tools]

    def spec_json(self) -> dict[str, Any]:
        return self.process.to_json()


@dataclass(frozen=True)
class DeployResult:
    definitions: list[Definition]
    created_process_ids: list[str]


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _digested(frozen: dict[str, Any]) -> dict[str, Any]:
    """What a version's digest covers: the schemas themselves are left out, as their sha256 pins them
    (so a bundle deployed before schemas were kept is still recognised as the same one)."""
    return {
        **frozen,
        "tool_bindings": [
            {k: v for k, v in binding.items() if k != "input_schema"} for binding in frozen["tool_bindings"]
        ],
    }


def freeze_bindings(bundle: Bundle, process: Process, observed: ObservedSchemas) -> list[ToolBinding]:
    bindings = []
    for server, tool in bundle.bound_tools(process):
        seen = observed.get((server.name, tool.name))
        if seen is None:  # no contract check ran (no live server to ask): only the bundle's own pin
            seen = ObservedTool(tool.input_schema_sha256 or "", "")
        bindings.append(_binding(server, tool, seen))
    return bindings


def _binding(server: ToolServerSpec, tool: ToolSpec, seen: ObservedTool) -> ToolBinding:
    return ToolBinding(
        server=server.name,
        tool=tool.name,
        policy=tool.policy,
        idempotency=tool.idempotency if tool.policy == "write" else "none",
        url=server.url,
        transport=server.transport,
        credential=server.credential,
        input_schema_sha256=seen.input_schema_sha256,
        description_sha256=seen.description_sha256,
        approval=tool.approval,
        input_schema=seen.input_schema,
    )


class DefinitionCatalog:
    def __init__(
        self, engine: AsyncEngine, contract_check: ContractCheck | None = None, cache_size: int = 1024
    ) -> None:
        self._engine = engine
        self._reads = autocommit(engine)
        self._contract_check = contract_check
        self._cache: OrderedDict[uuid.UUID, Definition] = OrderedDict()
        self._cache_size = cache_size
        self._believed_latest: dict[str, uuid.UUID] = {}
        self._by_version: dict[tuple[str, int], uuid.UUID] = {}

    async def deploy(self, content: str, source_name: str, deployed_by: str = "") -> DeployResult:
        """Validate, check the live tool contracts, then freeze every changed process: all or nothing."""
        # Parsing is CPU work proportional to the bundle: off the event loop, so other calls go on.
        bundle = await asyncio.to_thread(parse_bundle, content, source_name or "bundle.yaml")
        observed: ObservedSchemas = (
            await self._contract_check(bundle, deployed_by) if self._contract_check else {}
        )
        results: list[Definition] = []
        created: list[str] = []
        async with self._engine.begin() as conn:
            await definition_store.lock_for_deploy(conn)
            for process in bundle.processes:
                bindings = freeze_bindings(bundle, process, observed)
                frozen: dict[str, Any] = {
                    "process": process.to_json(),
                    "tool_bindings": [b.to_json() for b in bindings],
                }
                digest = hashlib.sha256(_canonical(_digested(frozen)).encode()).hexdigest()
                latest = await definition_store.latest(conn, process.id)
                if latest is not None and latest.content_sha256 == digest:
                    if latest.retention_seconds is None:
                        # Deployed before retention existed: the same content deployed again records it.
                        await definition_store.record_retention(conn, latest.id, process.retention_seconds)
                    results.append(self._from_row(latest))
                    continue
                row = await definition_store.insert_version(
                    conn,
                    process.id,
                    (latest.version + 1) if latest is not None else 1,
                    digest,
                    source_name,
                    frozen["process"],
                    frozen["tool_bindings"],
                    process.retention_seconds,
                )
                results.append(self._from_row(row))
                created.append(process.id)
        log.info(
            "deployed",
            extra={
                "source_name": source_name,
                "deployed_by": deployed_by,
                "definitions": [
                    {
                        "process_id": d.process_id,
                        "definition_id": str(d.id),
                        "version": d.version,
                        "new_version": d.process_id in created,
                    }
                    for d in results
                ],
                # The servers whose live tools deploy listed and froze (none without a contract check).
                "tool_servers_checked": sorted({server for server, _tool in observed}),
            },
        )
        for definition in results:
            self._believed_latest[definition.process_id] = definition.id
        return DeployResult(results, created)

    async def get(self, definition_id: uuid.UUID) -> Definition:
        cached = self._cache.get(definition_id)
        if cached is not None:
            self._cache.move_to_end(definition_id)
            return cached
        async with self._reads.connect() as conn:
            row = await definition_store.by_id(conn, definition_id)
        if row is None:
            raise not_found("definition", str(definition_id), "definition_id")
        return self._from_row(row)

    async def find(self, process_id: str, version: int = 0) -> Definition:
        """The definition of `process_id` at `version` (0: the latest), read from the database."""
        async with self._reads.connect() as conn:
            row = await definition_store.by_version(conn, process_id, version)
        if row is None:
            ident = f"{process_id} v{version}" if version else process_id
            raise not_found("process definition", ident, "version" if version else "process_id")
        definition = self._from_row(row)
        if not version:
            self._believed_latest[process_id] = definition.id
        return definition

    async def find_remembered(self, process_id: str, version: int = 0) -> Definition:
        """`find` without a database read when the answer is remembered.

        A numbered version is exact. For the latest (0) the answer is only what this replica saw
        last: a caller must check it is still the latest where it writes (a newer version deployed
        by any replica makes the check fail), and then ask `find` again.
        """
        remembered = (
            self._by_version.get((process_id, version)) if version else self._believed_latest.get(process_id)
        )
        cached = self._cache.get(remembered) if remembered is not None else None
        if cached is not None:
            return cached
        definition = await self.find(process_id, version)
        if version:
            self._by_version[(process_id, version)] = definition.id
        return definition

    async def list(
        self, process_id: str = "", limit: int = 100, after_key: tuple[str, int] | None = None
    ) -> list[Definition]:
        async with self._reads.connect() as conn:
            rows = await definition_store.listed(conn, process_id, limit, after_key)
        return [self._from_row(r) for r in rows]

    def _from_row(self, row: DefinitionRow) -> Definition:
        cached = self._cache.get(row.id)
        if cached is not None:
            return cached
        definition = Definition(
            id=row.id,
            process_id=row.process_id,
            version=row.version,
            content_sha256=row.content_sha256,
            source_name=row.source_name,
            created_at=row.created_at,
            process=Process.from_json(row.spec),
            tool_bindings=tuple(ToolBinding.from_json(b) for b in row.tool_bindings),
        )
        self._cache[row.id] = definition
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return definition


__all__ = [
    "ContractCheck",
    "DefinitionCatalog",
    "DeployResult",
    "EngineError",
    "ObservedSchemas",
    "ObservedTool",
]
