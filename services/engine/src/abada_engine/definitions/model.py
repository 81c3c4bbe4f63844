"""The compiled shape of a deployment bundle: tool servers and processes.

Everything here is immutable and round-trips through plain JSON, because a
definition version is frozen into the database and read back by every replica.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

NodeType = Literal[
    "agent", "service", "exclusive", "user_task", "timer", "receive", "parallel", "join", "end"
]
NODE_TYPES: tuple[str, ...] = (
    "agent",
    "service",
    "exclusive",
    "user_task",
    "timer",
    "receive",
    "parallel",
    "join",
    "end",
)
# How a join lets the token on: when every branch of its fork arrived, or when the first one did (the
# other branches' tasks are withdrawn).
JOIN_WAITS: tuple[str, ...] = ("all", "any")
# The nodes a token waits in for a worker, a person or the world: each may carry a deadline.
WAITING_NODE_TYPES: tuple[str, ...] = ("agent", "service", "user_task", "receive")
# The nodes `for_each` may run once per item of a list, each item a task of its own.
FAN_OUT_NODE_TYPES: tuple[str, ...] = ("agent", "service", "user_task")
DEFAULT_MAX_CONCURRENCY = 10
DEFAULT_MAX_ITEMS = 1_000
# What a failed item does: hold the item in an incident, or leave it out (null in `collect`).
ITEM_FAILURE_ACTIONS: tuple[str, ...] = ("incident", "skip")
AGENT_TOPIC = "abada:agent"
AGENT_PROFILE = "abada.agent/v1"
# How long a finished instance is kept when its process names no `retention:` (P30D).
DEFAULT_RETENTION_SECONDS = 30 * 86_400.0


@dataclass(frozen=True)
class ToolSpec:
    name: str
    policy: Literal["read", "write"]
    idempotency: Literal["key", "none"]
    input_schema_sha256: str | None = None
    approval: Literal["required", "none"] = "none"


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
    # "required": a person approves every call before it runs. Versions frozen before approvals
    # existed have no such key and read back as "none".
    approval: str = "none"
    # The description the model reads, pinned like the schema; "" in versions frozen before it was.
    description_sha256: str = ""
    # The tool's input schema as deploy listed it (its sha256 above pins it); None in versions frozen
    # before schemas were kept, or deployed without a live contract check.
    input_schema: dict[str, Any] | None = None

    @property
    def ref(self) -> str:
        return f"{self.server}/{self.tool}"

    @property
    def approval_required(self) -> bool:
        return self.approval == "required"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["approval"] == "none":
            del data["approval"]  # so a bundle without approvals freezes exactly as it did before
        if data["input_schema"] is None:
            del data["input_schema"]
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> ToolBinding:
        return ToolBinding(**data)


@dataclass(frozen=True)
class Price:
    """What a provider charges, in US dollars per million tokens."""

    input_per_million_usd: float = 0.0
    output_per_million_usd: float = 0.0

    def cost_usd(self, input_tokens: int, output_tokens: int) -> float:
        return (input_tokens * self.input_per_million_usd + output_tokens * self.output_per_million_usd) / 1e6


@dataclass(frozen=True)
class ModelProfile:
    """A model as the bundle declares it: the quotas every worker shares and what it costs.

    `name` is the model id sent to the provider; an agent node's `model` names a profile or, when no
    profile has that name, runs without quotas or prices. A quota of None is not enforced.
    """

    name: str
    provider: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_calls: int | None = None
    price: Price = field(default_factory=Price)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @staticmethod
    def from_json(data: dict[str, Any]) -> ModelProfile:
        return ModelProfile(**{**data, "price": Price(**data.get("price", {}))})


@dataclass(frozen=True)
class Limits:
    max_model_calls: int = 8
    max_tool_calls: int = 16
    max_tokens: int = 100_000
    # Dollars this node may spend on model calls in one task (prices from its model profile).
    max_cost_usd: float | None = None

    def to_json(self) -> dict[str, Any]:
        # Unset budgets are left out, so definitions frozen before budgets existed keep their digest.
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Branch:
    when: str
    next: str


def _on(*node_types: str, key: str = "") -> dict[str, Any]:
    """Field metadata: the node types whose YAML may set this field, and its YAML key where the field's
    name differs (a duration parsed into seconds)."""
    return {"node_types": node_types, "yaml_key": key}


@dataclass(frozen=True)
class Node:
    id: str = field(metadata=_on(*NODE_TYPES))
    type: str = field(metadata=_on(*NODE_TYPES))
    next: str | None = field(
        default=None, metadata=_on("agent", "service", "user_task", "timer", "receive", "join")
    )
    # service and agent nodes
    topic: str | None = field(default=None, metadata=_on("service"))
    inputs: dict[str, Any] | None = field(default=None, metadata=_on("agent", "service", "user_task"))
    retries: int = field(default=3, metadata=_on("agent", "service"))
    retry_backoff_ms: int = field(default=1000, metadata=_on("agent", "service"))
    # How long a task waits out the outages of what it depends on (seconds; parsed from an ISO-8601
    # duration) before a DEPENDENCY_UNAVAILABLE incident; None: the engine's default, 30 minutes.
    outage_budget_seconds: float | None = field(
        default=None, metadata=_on("agent", "service", key="outage_budget")
    )
    # agent nodes
    model: str | None = field(default=None, metadata=_on("agent"))
    # Resolved at deploy (definitions.providers): gemini, openai or anthropic.
    provider: str | None = field(default=None, metadata=_on("agent"))
    prompt: str | None = field(default=None, metadata=_on("agent"))
    tools: tuple[str, ...] = field(default=(), metadata=_on("agent"))
    # agent and receive nodes; on a service or user_task node only with `for_each` (what `collect` takes
    # of each item's completion).
    result_variable: str | None = field(
        default=None, metadata=_on("agent", "receive", "service", "user_task")
    )
    output_schema: dict[str, Any] | None = field(default=None, metadata=_on("agent"))
    confidence_threshold: float | None = field(default=None, metadata=_on("agent"))
    limits: Limits = field(default_factory=Limits, metadata=_on("agent"))
    on_invalid_output: str | None = field(default=None, metadata=_on("agent"))
    on_low_confidence: str | None = field(default=None, metadata=_on("agent"))
    # How long a proposed call may wait for a person (seconds; parsed from an ISO-8601 duration),
    # and where the token goes when nobody decided in time (else an APPROVAL_TIMEOUT incident).
    approval_timeout_seconds: float | None = field(
        default=None, metadata=_on("agent", key="approval_timeout")
    )
    on_approval_timeout: str | None = field(default=None, metadata=_on("agent"))
    # timer nodes: wait `duration` (seconds, parsed from ISO-8601), or until the RFC 3339 time the
    # `until` template renders to from the instance's variables.
    duration_seconds: float | None = field(default=None, metadata=_on("timer", key="duration"))
    until: str | None = field(default=None, metadata=_on("timer"))
    # receive nodes: the message's name and the template whose value a message's correlation key
    # must equal; past `timeout` (seconds) with no message, the token goes to `on_timeout`.
    message: str | None = field(default=None, metadata=_on("receive"))
    correlation_key: str | None = field(default=None, metadata=_on("receive"))
    timeout_seconds: float | None = field(default=None, metadata=_on("receive", key="timeout"))
    on_timeout: str | None = field(default=None, metadata=_on("receive"))
    # Any waiting node: past `deadline` (seconds after the token arrived) its task is withdrawn and
    # the token goes to `on_deadline`.
    deadline_seconds: float | None = field(default=None, metadata=_on(*WAITING_NODE_TYPES, key="deadline"))
    on_deadline: str | None = field(default=None, metadata=_on(*WAITING_NODE_TYPES))
    # Multi-instance (`for_each`, on the FAN_OUT_NODE_TYPES): the template giving the list, the variable
    # each item's inputs see it as, how many items run at once (None: 10), what list the items'
    # `result_variable`s are collected into, what a failed item does (None: "incident") and how long a
    # list may be (None: 1,000). Unset ones stay out of the JSON, so older definitions keep their digest.
    for_each: str | None = field(default=None, metadata=_on(*FAN_OUT_NODE_TYPES))
    item_variable: str | None = field(default=None, metadata=_on(*FAN_OUT_NODE_TYPES, key="as"))
    max_concurrency: int | None = field(default=None, metadata=_on(*FAN_OUT_NODE_TYPES))
    collect: str | None = field(default=None, metadata=_on(*FAN_OUT_NODE_TYPES))
    on_item_failure: str | None = field(default=None, metadata=_on(*FAN_OUT_NODE_TYPES))
    max_items: int | None = field(default=None, metadata=_on(*FAN_OUT_NODE_TYPES))
    # exclusive nodes
    branches: tuple[Branch, ...] = field(default=(), metadata=_on("exclusive"))
    default: str | None = field(default=None, metadata=_on("exclusive"))
    # parallel nodes: the first node of each branch, every one of which gets a token of its own. The
    # YAML says `branches: [a, b]`, a list of node ids (an exclusive's branches are {when, next}).
    forks: tuple[str, ...] = field(default=(), metadata=_on("parallel", key="branches"))
    # join nodes: "all" or "any" (JOIN_WAITS).
    wait_for: str | None = field(default=None, metadata=_on("join"))

    @property
    def fans_out(self) -> bool:
        return self.for_each is not None

    @property
    def concurrency(self) -> int:
        return self.max_concurrency if self.max_concurrency is not None else DEFAULT_MAX_CONCURRENCY

    @property
    def item_limit(self) -> int:
        return self.max_items if self.max_items is not None else DEFAULT_MAX_ITEMS

    @property
    def skips_failed_items(self) -> bool:
        return self.on_item_failure == "skip"

    def successors(self) -> list[str]:
        """Every node the token can move to from here, for reachability checks."""
        targets = [self.next, self.on_invalid_output, self.on_low_confidence, self.on_approval_timeout]
        targets += [self.on_timeout, self.on_deadline]
        targets.append(self.default)
        targets += [branch.next for branch in self.branches]
        targets += self.forks
        return [t for t in targets if t]

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["limits"] = self.limits.to_json()
        data["tools"] = list(self.tools)
        data["branches"] = [asdict(b) for b in self.branches]
        data["forks"] = list(self.forks)
        return {k: v for k, v in data.items() if v not in (None, [], ())}

    @staticmethod
    def from_json(data: dict[str, Any]) -> Node:
        values = dict(data)
        values["tools"] = tuple(values.get("tools", ()))
        values["branches"] = tuple(Branch(**b) for b in values.get("branches", ()))
        values["forks"] = tuple(values.get("forks", ()))
        values["limits"] = Limits(**values.get("limits", {}))
        return Node(**values)


def yaml_keys(node_type: str) -> frozenset[str]:
    """The keys a node of `node_type` may have in a bundle, read off the Node fields that type uses."""
    return frozenset(
        part.metadata["yaml_key"] or part.name
        for part in fields(Node)
        if node_type in part.metadata["node_types"]
    )


# Per node type, the keys its YAML may use.
NODE_KEYS: dict[str, frozenset[str]] = {node_type: yaml_keys(node_type) for node_type in NODE_TYPES}


@dataclass(frozen=True)
class Process:
    id: str
    start: str
    nodes: dict[str, Node]
    # The model profiles its agent nodes name, frozen with the version like the tool bindings.
    models: dict[str, ModelProfile] = field(default_factory=dict)
    # Dollars one instance may spend on model calls, across all its agent nodes.
    max_cost_usd: float | None = None
    # `inputs:`: a JSON Schema the variables of StartInstance must meet; None accepts any.
    input_schema: dict[str, Any] | None = None
    # `unique_business_key: true`: one active instance per business key; a second start is refused.
    unique_business_key: bool = False
    # `retention:` how long a finished instance (with its history, tasks and journal) is kept after
    # it ended, in seconds; 0 keeps nothing. The retention job deletes it after that.
    retention_seconds: float = DEFAULT_RETENTION_SECONDS

    def node(self, node_id: str) -> Node:
        return self.nodes[node_id]

    def model_profile(self, node_id: str) -> ModelProfile | None:
        model = self.nodes[node_id].model
        return self.models.get(model) if model else None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "id": self.id,
            "start": self.start,
            "nodes": [n.to_json() for n in self.nodes.values()],
        }
        # Only when set, so definitions frozen before profiles and budgets existed keep their digest.
        if self.models:
            data["models"] = [profile.to_json() for profile in self.models.values()]
        if self.max_cost_usd is not None:
            data["limits"] = {"max_cost_usd": self.max_cost_usd}
        if self.input_schema is not None:
            data["inputs"] = self.input_schema
        if self.unique_business_key:
            data["unique_business_key"] = True
        if self.retention_seconds != DEFAULT_RETENTION_SECONDS:
            data["retention_seconds"] = self.retention_seconds
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> Process:
        nodes = [Node.from_json(n) for n in data["nodes"]]
        models = [ModelProfile.from_json(m) for m in data.get("models", ())]
        return Process(
            id=data["id"],
            start=data["start"],
            nodes={n.id: n for n in nodes},
            models={m.name: m for m in models},
            max_cost_usd=data.get("limits", {}).get("max_cost_usd"),
            input_schema=data.get("inputs"),
            unique_business_key=bool(data.get("unique_business_key", False)),
            retention_seconds=float(data.get("retention_seconds", DEFAULT_RETENTION_SECONDS)),
        )


@dataclass(frozen=True)
class Bundle:
    tool_servers: dict[str, ToolServerSpec]
    processes: list[Process]
    models: dict[str, ModelProfile] = field(default_factory=dict)

    def bound_tools(self, process: Process) -> list[tuple[ToolServerSpec, ToolSpec]]:
        """The (server, tool) pairs a process's agent nodes reference, in first-use order."""
        seen: dict[str, tuple[ToolServerSpec, ToolSpec]] = {}
        for node in process.nodes.values():
            for ref in node.tools:
                server_name, tool_name = ref.split("/", 1)
                server = self.tool_servers[server_name]
                seen.setdefault(ref, (server, server.tools[tool_name]))
        return list(seen.values())
