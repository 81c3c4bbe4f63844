"""The compiled shape of a deployment bundle: tool servers and processes.

Everything here is immutable and round-trips through plain JSON, because a
definition version is frozen into the database and read back by every replica.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

NodeType = Literal["agent", "service", "exclusive", "user_task", "end"]
NODE_TYPES: tuple[str, ...] = ("agent", "service", "exclusive", "user_task", "end")
AGENT_TOPIC = "abada:agent"
AGENT_PROFILE = "abada.agent/v1"


@dataclass(frozen=True)
class ToolSpec:
    name: str
    policy: Literal["read", "write"]
    idempotency: Literal["key", "none"]
    input_schema_sha256: str | None = None


@dataclass(frozen=True)
class ToolServerSpec:
    name: str
    transport: str
    url: str
    credential: str
    tools: dict[str, ToolSpec]


@dataclass(frozen=True)
class ToolBinding:
    """A tool as frozen into a definition version; what the worker is allowed to call."""

    server: str
    tool: str
    policy: str
    idempotency: str
    url: str
    transport: str
    credential: str
    input_schema_sha256: str

    @property
    def ref(self) -> str:
        return f"{self.server}/{self.tool}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> ToolBinding:
        return ToolBinding(**data)


@dataclass(frozen=True)
class Limits:
    max_model_calls: int = 8
    max_tool_calls: int = 16
    max_tokens: int = 100_000


@dataclass(frozen=True)
class Branch:
    when: str
    next: str


@dataclass(frozen=True)
class Node:
    id: str
    type: str
    next: str | None = None
    # service and agent nodes
    topic: str | None = None
    inputs: dict[str, Any] | None = None
    retries: int = 3
    retry_backoff_ms: int = 1000
    # agent nodes
    model: str | None = None
    prompt: str | None = None
    tools: tuple[str, ...] = ()
    result_variable: str | None = None
    output_schema: dict[str, Any] | None = None
    confidence_threshold: float | None = None
    limits: Limits = field(default_factory=Limits)
    on_invalid_output: str | None = None
    on_low_confidence: str | None = None
    # exclusive nodes
    branches: tuple[Branch, ...] = ()
    default: str | None = None

    def successors(self) -> list[str]:
        """Every node the token can move to from here, for reachability checks."""
        targets = [self.next, self.on_invalid_output, self.on_low_confidence, self.default]
        targets += [branch.next for branch in self.branches]
        return [t for t in targets if t]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["tools"] = list(self.tools)
        data["branches"] = [asdict(b) for b in self.branches]
        return {k: v for k, v in data.items() if v not in (None, [], ())}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Node:
        values = dict(data)
        values["tools"] = tuple(values.get("tools", ()))
        values["branches"] = tuple(Branch(**b) for b in values.get("branches", ()))
        values["limits"] = Limits(**values.get("limits", {}))
        return Node(**values)


@dataclass(frozen=True)
class Process:
    id: str
    start: str
    nodes: dict[str, Node]

    def node(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "start": self.start, "nodes": [n.to_json() for n in self.nodes.values()]}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Process:
        nodes = [Node.from_json(n) for n in data["nodes"]]
        return Process(id=data["id"], start=data["start"], nodes={n.id: n for n in nodes})


@dataclass(frozen=True)
class Bundle:
    tool_servers: dict[str, ToolServerSpec]
    processes: list[Process]

    def bound_tools(self, process: Process) -> list[tuple[ToolServerSpec, ToolSpec]]:
        """The (server, tool) pairs a process's agent nodes reference, in first-use order."""
        seen: dict[str, tuple[ToolServerSpec, ToolSpec]] = {}
        for node in process.nodes.values():
            for ref in node.tools:
                server_name, tool_name = ref.split("/", 1)
                server = self.tool_servers[server_name]
                seen.setdefault(ref, (server, server.tools[tool_name]))
        return list(seen.values())
