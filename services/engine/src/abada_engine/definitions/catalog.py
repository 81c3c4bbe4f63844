"""Deploying bundles and reading frozen definition versions back.

A version never changes once written, so every replica may cache it forever. Which version is the
latest can change under any replica (another one deploys): the catalog only *believes* it knows,
and a start that relies on the belief has its statement re-check it (see `Instances.start`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from abada_engine.db.database import autocommit
from abada_engine.errors import EngineError, FieldProblem, not_found
from abada_engine.store import definitions as definition_store
from abada_engine.store.definitions import DefinitionRow

from .model import Bundle, Process, ToolBinding, ToolServerSpec, ToolSpec
from .parser import definition_invalid, parse_bundle

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
        by_process: dict[str, Definition] = {}
        created: list[str] = []
        async with self._engine.begin() as conn:
            await definition_store.lock_for_deploy(conn)
            calls = _Calls(conn, bundle)
            await calls.check()
            # The called before their callers: a caller pins the version its callee gets here.
            for process in calls.callees_first():
                process = await calls.pinned(process, {p: d.version for p, d in by_process.items()})
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
                    by_process[process.id] = self._from_row(latest)
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
                by_process[process.id] = self._from_row(row)
                created.append(process.id)
        results = [by_process[process.id] for process in bundle.processes]
        created = [process.id for process in bundle.processes if process.id in created]
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


class _Calls:
    """Deploy's checks of a bundle's call activities, against the bundle and the deployed processes:
    every called process exists, and no chain of calls comes back to where it started (a process's
    calls are followed through its latest version, or through the bundle's when it redeploys it)."""

    def __init__(self, conn: AsyncConnection, bundle: Bundle) -> None:
        self._conn = conn
        self._bundle = bundle
        self._in_bundle = {process.id: process for process in bundle.processes}
        self._deployed: dict[str, DefinitionRow | None] = {}

    async def _latest(self, process_id: str) -> DefinitionRow | None:
        if process_id not in self._deployed:
            self._deployed[process_id] = await definition_store.latest(self._conn, process_id)
        return self._deployed[process_id]

    async def _callees(self, process_id: str) -> list[str]:
        process = self._in_bundle.get(process_id)
        if process is None:
            row = await self._latest(process_id)
            process = Process.from_json(row.spec) if row is not None else None
        return _called_by(process) if process is not None else []

    async def _path(self, start: str, goal: str) -> list[str] | None:
        """A chain of calls from `start` to `goal` (both included), or None."""
        came_from: dict[str, str | None] = {start: None}
        stack = [start]
        while stack:
            current = stack.pop()
            if current == goal:
                chain = [current]
                while (before := came_from[chain[-1]]) is not None:
                    chain.append(before)
                return chain[::-1]
            for callee in await self._callees(current):
                if callee not in came_from:
                    came_from[callee] = current
                    stack.append(callee)
        return None

    async def check(self) -> None:
        problems: list[FieldProblem] = []
        for site in self._bundle.call_sites:
            if site.called not in self._in_bundle and await self._latest(site.called) is None:
                why = f"calls {site.called!r}, a process neither deployed nor in this bundle"
                problems.append(FieldProblem(site.field, why, site.file, site.line))
                continue
            chain = await self._path(site.called, site.process_id)
            if chain is not None:
                why = f"a cycle of calls: {' -> '.join([site.process_id, *chain])}"
                problems.append(FieldProblem(site.field, why, site.file, site.line))
        if problems:
            raise definition_invalid(sorted(problems, key=lambda p: p.line))

    def callees_first(self) -> list[Process]:
        """The bundle's processes, each after the ones of the bundle it calls (calls have no cycle)."""
        ordered: dict[str, Process] = {}

        def visit(process: Process) -> None:
            if process.id in ordered:
                return
            for callee in _called_by(process):
                if callee in self._in_bundle and callee != process.id:
                    visit(self._in_bundle[callee])
            ordered[process.id] = process

        for process in self._bundle.processes:
            visit(process)
        return list(ordered.values())

    async def pinned(self, process: Process, deploying: dict[str, int]) -> Process:
        """`process` with each `version: pinned` call frozen to the version of its callee that is
        current now: the one this deploy gives it, else the latest deployed."""
        nodes = dict(process.nodes)
        for node in process.nodes.values():
            if node.type != "call" or node.version != "pinned" or node.process is None:
                continue
            version = deploying.get(node.process)
            if version is None:
                row = await self._latest(node.process)
                assert row is not None  # `check` saw it
                version = row.version
            nodes[node.id] = dataclasses.replace(node, pinned_version=version)
        return dataclasses.replace(process, nodes=nodes)


def _called_by(process: Process) -> list[str]:
    return [node.process for node in process.nodes.values() if node.type == "call" and node.process]


__all__ = [
    "ContractCheck",
    "DefinitionCatalog",
    "DeployResult",
    "EngineError",
    "ObservedSchemas",
    "ObservedTool",
]
