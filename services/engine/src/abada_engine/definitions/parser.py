"""Parse and validate a deployment bundle (YAML) into a `Bundle`: each section's checks.

The YAML is read by `yaml_source` (lines kept, aliases refused), each value checked through a
`checker.Checker` (which collects every problem with its file, line and field path, so one deploy
attempt shows the author everything that is wrong), durations by `durations`. The keys a node may
have are the model's (`model.NODE_KEYS`), not a list kept here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from abada.engine.v1.error_reason_pb2 import ErrorReason

from abada_engine.errors import Category, EngineError, FieldProblem

from .checker import Checker, kind
from .durations import iso_duration_seconds
from .expressions import cel_syntax_error, reference_syntax_errors
from .model import (
    AGENT_TOPIC,
    CALL_VERSIONS,
    DEFAULT_RETENTION_SECONDS,
    FAN_OUT_NODE_TYPES,
    ITEM_FAILURE_ACTIONS,
    JOIN_WAITS,
    NODE_KEYS,
    NODE_TYPES,
    WAITING_NODE_TYPES,
    Branch,
    Bundle,
    CallSite,
    Limits,
    ModelProfile,
    Node,
    Price,
    Process,
    ToolServerSpec,
    ToolSpec,
)
from .providers import PROVIDERS, ProviderUndecided, resolve_provider
from .schemas import schema_problems
from .yaml_source import Refused, path_text
from .yaml_source import load as load_located

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,127}$")
_VARIABLE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TOPIC = re.compile(r"^[A-Za-z0-9_.:-]{1,200}$")

_BUNDLE_KEYS = {"models", "tool_servers", "processes"}
_MODEL_KEYS = {
    "name",
    "provider",
    "requests_per_minute",
    "tokens_per_minute",
    "max_concurrent_calls",
    "price",
}
_PRICE_KEYS = {"input_per_million_usd", "output_per_million_usd"}
_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/@-]{0,199}$")
_SERVER_KEYS = {"name", "transport", "url", "credential", "tools"}
_TOOL_KEYS = {"policy", "idempotency", "input_schema_sha256", "approval"}
_PROCESS_KEYS = {"id", "start", "nodes", "limits", "inputs", "unique_business_key", "retention"}
_PROCESS_LIMIT_KEYS = {"max_cost_usd"}
_LIMIT_KEYS = {"max_model_calls", "max_tool_calls", "max_tokens", "max_cost_usd"}


def parse_bundle(content: str, source_name: str = "bundle.yaml") -> Bundle:
    """Parse and validate a bundle; raise one `EngineError` listing every problem."""
    try:
        located = load_located(content)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        line = mark.line + 1 if mark else 1
        why = getattr(error, "problem", error)
        problem = FieldProblem(
            "(bundle)",
            str(why) if isinstance(error, Refused) else f"not valid YAML: {why}",
            source_name,
            line,
        )
        raise _invalid([problem]) from None
    checker = Checker(source_name, located)
    bundle = _check_bundle(checker)
    if checker.problems or bundle is None:
        raise _invalid(sorted(checker.problems, key=lambda p: p.line))
    return bundle


def definition_invalid(problems: list[FieldProblem]) -> EngineError:
    """DEFINITION_INVALID for problems found past parsing (deploy's checks against the database)."""
    return _invalid(problems)


def _invalid(problems: list[FieldProblem]) -> EngineError:
    first = problems[0]
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return EngineError(
        Category.INVALID_ARGUMENT,
        ErrorReason.DEFINITION_INVALID,
        f"{first}{more}",
        field=first.field,
        problems=problems,
        metadata={"file": first.file, "line": str(first.line)},
    )


def _check_bundle(checker: Checker) -> Bundle | None:
    root = checker.mapping(checker.located.value, (), _BUNDLE_KEYS)
    models = _check_models(checker, root.get("models", []))
    servers = _check_tool_servers(checker, root.get("tool_servers", []))
    raw_processes = root.get("processes")
    if not isinstance(raw_processes, list) or not raw_processes:
        checker.report(("processes",), "must be a non-empty list of processes")
        return None
    processes: list[Process] = []
    seen_ids: dict[str, int] = {}
    for index, raw in enumerate(raw_processes):
        process = _check_process(checker, raw, ("processes", index), servers, models)
        if process is None:
            continue
        if process.id in seen_ids:
            checker.report(("processes", index, "id"), f"duplicate process id {process.id!r}")
        seen_ids[process.id] = index
        processes.append(process)
    call_sites = tuple(_call_sites(checker, processes, seen_ids))
    return Bundle(tool_servers=servers, processes=processes, models=models, call_sites=call_sites)


def _call_sites(checker: Checker, processes: list[Process], indexes: dict[str, int]) -> Iterator[CallSite]:
    """Each `call` node with the line of its `process:`, for deploy's checks (catalog.py)."""
    for process in processes:
        raw_nodes = checker.located.value["processes"][indexes[process.id]]["nodes"]
        for node_index, raw_node in enumerate(raw_nodes):
            node_id = raw_node.get("id") if isinstance(raw_node, dict) else None
            node = process.nodes.get(node_id) if isinstance(node_id, str) else None
            if node is None or node.type != "call" or node.process is None:
                continue
            path = ("processes", indexes[process.id], "nodes", node_index, "process")
            yield CallSite(
                process.id, node.id, node.process, path_text(path), checker.source_name, checker.line_of(path)
            )


def _check_models(checker: Checker, raw: Any) -> dict[str, ModelProfile]:
    models: dict[str, ModelProfile] = {}
    for path, data in checker.entries(raw, "models", "a list of model profiles", _MODEL_KEYS):
        name = checker.string(data, "name", path, pattern=_MODEL_NAME, what="model name")
        provider = checker.string(data, "provider", path)
        if provider and provider not in PROVIDERS:
            checker.report((*path, "provider"), f"{provider!r} is not one of: {', '.join(PROVIDERS)}")
        price_path = (*path, "price")
        price = checker.mapping(data.get("price", {}), price_path, _PRICE_KEYS)
        profile = ModelProfile(
            name=name or "",
            provider=provider or "",
            requests_per_minute=checker.optional_integer(data, "requests_per_minute", path),
            tokens_per_minute=checker.optional_integer(data, "tokens_per_minute", path),
            max_concurrent_calls=checker.optional_integer(data, "max_concurrent_calls", path),
            price=Price(
                input_per_million_usd=checker.amount(price, "input_per_million_usd", price_path) or 0.0,
                output_per_million_usd=checker.amount(price, "output_per_million_usd", price_path) or 0.0,
            ),
        )
        if name is None:
            continue
        if name in models:
            checker.report((*path, "name"), f"duplicate model profile {name!r}")
            continue
        models[name] = profile
    return models


def _check_tool_servers(checker: Checker, raw: Any) -> dict[str, ToolServerSpec]:
    servers: dict[str, ToolServerSpec] = {}
    for path, data in checker.entries(raw, "tool_servers", "a list", _SERVER_KEYS):
        name = checker.string(data, "name", path, pattern=_IDENTIFIER, what="server name")
        transport = checker.string(data, "transport", path)
        if transport and transport != "streamable-http":
            checker.report((*path, "transport"), f"{transport!r} is not supported (use streamable-http)")
        url = checker.string(data, "url", path)
        if url and not re.match(r"^https?://[^\s/]+", url):
            checker.report((*path, "url"), f"{url!r} is not an http(s) URL")
        credential = (
            checker.string(
                data, "credential", path, required=False, pattern=_IDENTIFIER, what="credential name"
            )
            or ""
        )
        tools = _check_tools(checker, data.get("tools"), (*path, "tools"))
        if name is None:
            continue
        if name in servers:
            checker.report((*path, "name"), f"duplicate tool server {name!r}")
            continue
        servers[name] = ToolServerSpec(name, transport or "streamable-http", url or "", credential, tools)
    return servers


def _check_tools(checker: Checker, raw: Any, path: tuple[str | int, ...]) -> dict[str, ToolSpec]:
    tools: dict[str, ToolSpec] = {}
    if not isinstance(raw, dict) or not raw:
        checker.report(path, "must map at least one tool name to its policy")
        return tools
    for tool_name, spec in raw.items():
        tool_path = (*path, tool_name)
        if not _IDENTIFIER.match(tool_name):
            checker.report(tool_path, f"{tool_name!r} is not a valid tool name")
        data = checker.mapping(spec, tool_path, _TOOL_KEYS)
        policy = checker.string(data, "policy", tool_path)
        if policy and policy not in ("read", "write"):
            checker.report((*tool_path, "policy"), f"{policy!r} is not read or write")
        idempotency = checker.string(data, "idempotency", tool_path, required=False) or "none"
        if idempotency not in ("key", "none"):
            checker.report((*tool_path, "idempotency"), f"{idempotency!r} is not key or none")
        if policy == "read" and "idempotency" in data:
            checker.report((*tool_path, "idempotency"), "only applies to write tools")
        pinned = checker.string(
            data,
            "input_schema_sha256",
            tool_path,
            required=False,
            pattern=_SHA256,
            what="lower-case hex SHA-256",
        )
        approval = checker.string(data, "approval", tool_path, required=False) or "none"
        if approval not in ("required", "none"):
            checker.report((*tool_path, "approval"), f"{approval!r} is not required or none")
        tools[tool_name] = ToolSpec(
            tool_name,
            policy if policy in ("read", "write") else "read",  # type: ignore[arg-type]
            idempotency if idempotency in ("key", "none") else "none",  # type: ignore[arg-type]
            pinned,
            "required" if approval == "required" else "none",
        )
    return tools


def _check_input_schema(checker: Checker, schema: Any, path: tuple[str | int, ...]) -> dict[str, Any] | None:
    """`inputs:` is a JSON Schema of the start variables, an object's (StartInstance checks it)."""
    if schema is None:
        return None
    if not isinstance(schema, dict):
        checker.report(path, f"must be a JSON Schema object, not {kind(schema)}")
        return None
    problems = schema_problems(schema)
    if schema.get("type", "object") != "object":
        problems.append("describes the start variables, so its type is object")
    for problem in problems:
        checker.report(path, problem)
    return None if problems else schema


def _check_process(
    checker: Checker,
    raw: Any,
    path: tuple[str | int, ...],
    servers: dict[str, ToolServerSpec],
    models: dict[str, ModelProfile],
) -> Process | None:
    data = checker.mapping(raw, path, _PROCESS_KEYS)
    process_id = checker.string(data, "id", path, pattern=_IDENTIFIER, what="process id")
    start = checker.string(data, "start", path)
    limits_path = (*path, "limits")
    process_limits = checker.mapping(data.get("limits", {}), limits_path, _PROCESS_LIMIT_KEYS)
    max_cost_usd = checker.amount(process_limits, "max_cost_usd", limits_path, positive=True)
    input_schema = _check_input_schema(checker, data.get("inputs"), (*path, "inputs"))
    unique_business_key = checker.flag(data, "unique_business_key", path)
    retention_seconds = _check_retention(checker, data, path)
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        checker.report((*path, "nodes"), "must be a non-empty list of nodes")
        return None
    nodes: dict[str, Node] = {}
    node_paths: dict[str, tuple[str | int, ...]] = {}
    problems_before = len(checker.problems)
    for index, raw_node in enumerate(raw_nodes):
        node_path = (*path, "nodes", index)
        node = _check_node(checker, raw_node, node_path, servers, models)
        if node is None:
            continue
        if node.id in nodes:
            checker.report((*node_path, "id"), f"duplicate node id {node.id!r}")
            continue
        nodes[node.id] = node
        node_paths[node.id] = node_path
    # A node that failed to parse still exists for references, so its mistakes are not reported twice.
    declared = set(nodes) | {
        n["id"] for n in raw_nodes if isinstance(n, dict) and isinstance(n.get("id"), str)
    }
    for node_id, node in nodes.items():
        for key, target in _targets(node, node_paths[node_id]):
            if target not in declared:
                checker.report(key, f"unknown node {target!r}")
    if start and start not in declared:
        checker.report((*path, "start"), f"unknown node {start!r}")
    if process_id is None or start is None or start not in nodes:
        return None
    reachable = _reachable(nodes, start)
    for node_id, node_path in node_paths.items():
        if node_id not in reachable:
            checker.report((*node_path, "id"), f"node {node_id!r} is unreachable from start {start!r}")
    # Only worth saying when the nodes themselves parsed; otherwise it is an echo of those problems.
    if len(checker.problems) == problems_before and not any(n.type == "end" for n in nodes.values()):
        checker.report((*path, "nodes"), "has no end node")
    for node_id, node in nodes.items():
        if node.limits.max_cost_usd is not None and (node.model or "") not in models:
            checker.report(
                (*node_paths[node_id], "limits", "max_cost_usd"),
                f"needs prices: model {node.model!r} is not a profile in models:",
            )
    if len(checker.problems) == problems_before:
        _check_fan_out(checker, nodes, node_paths)
    used = {node.model: models[node.model] for node in nodes.values() if node.model in models}
    return Process(
        process_id, start, nodes, used, max_cost_usd, input_schema, unique_business_key, retention_seconds
    )


def _check_retention(checker: Checker, data: dict[str, Any], path: tuple[str | int, ...]) -> float:
    """`retention:` an ISO-8601 duration >= 0 (`P0D` keeps nothing after the end); absent, the default."""
    text = checker.string(data, "retention", path, required=False)
    if text is None:
        return DEFAULT_RETENTION_SECONDS
    seconds = iso_duration_seconds(text)
    if seconds is None:
        checker.report(
            (*path, "retention"), f"{text!r} is not an ISO-8601 duration (for example P30D, P7D, PT12H, P0D)"
        )
        return DEFAULT_RETENTION_SECONDS
    return seconds


def _targets(node: Node, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], str]]:
    for key in (
        "next",
        "on_invalid_output",
        "on_low_confidence",
        "on_approval_timeout",
        "on_timeout",
        "on_deadline",
        "default",
    ):
        target = getattr(node, key)
        if target:
            yield (*path, key), target
    for index, branch in enumerate(node.branches):
        yield (*path, "branches", index, "next"), branch.next
    for index, first in enumerate(node.forks):
        yield (*path, "branches", index), first


def _check_forks(checker: Checker, data: dict[str, Any], path: tuple[str | int, ...]) -> tuple[str, ...]:
    raw = data.get("branches")
    if not isinstance(raw, list) or len(raw) < 2 or not all(isinstance(item, str) and item for item in raw):
        checker.report((*path, "branches"), "must be a list of at least two node ids")
        return ()
    if len(set(raw)) != len(raw):
        checker.report((*path, "branches"), "names a node twice: each branch is a token of its own")
        return ()
    return tuple(raw)


def _check_fan_out(
    checker: Checker, nodes: dict[str, Node], node_paths: dict[str, tuple[str | int, ...]]
) -> None:
    """Every branch of a `parallel` reaches the same `join` on every path, and every join is reached by
    exactly one parallel: a join knows whose tokens it waits for. A branch that ends the instance, or
    forks again, is refused (a branch's tokens are counted against its one join)."""
    joined_by: dict[str, str] = {}
    for fork_id, fork in nodes.items():
        if fork.type != "parallel":
            continue
        path = node_paths[fork_id]
        joins: set[str] = set()
        for index, first in enumerate(fork.forks):
            reached, problem = _branch_joins(nodes, first)
            if problem:
                checker.report((*path, "branches", index), f"branch {first!r} of {fork_id!r} {problem}")
            joins |= reached
        if len(joins) != 1:
            named = ", ".join(sorted(repr(j) for j in joins)) or "none"
            checker.report((*path, "branches"), f"must all reach one join on every path (they reach {named})")
            continue
        [join_id] = joins
        if join_id in joined_by:
            checker.report(
                (*node_paths[join_id], "id"), f"is reached by both {joined_by[join_id]!r} and {fork_id!r}"
            )
        joined_by[join_id] = fork_id
    for node_id, node in nodes.items():
        timed = [node.on_deadline, node.on_approval_timeout, node.on_timeout]
        if node.type in ("timer", "receive"):
            timed.append(node.next)
        for target in filter(None, timed):
            fan = _decided_from(nodes, target) & {
                n for n, f in nodes.items() if f.type in ("parallel", "join")
            }
            if fan:
                checker.report(
                    (*node_paths[node_id], "id"),
                    f"a due time of {node_id!r} leads straight to {sorted(fan)[0]!r}: not supported yet "
                    "(put a task before the fork)",
                )
    for node_id, node in nodes.items():
        if node.type == "join" and node_id not in joined_by:
            checker.report((*node_paths[node_id], "id"), f"join {node_id!r} is reached by no parallel branch")


def _walk(
    nodes: dict[str, Node], first: str, goes_past: Callable[[Node], bool] = lambda node: True
) -> Iterator[tuple[str, Node]]:
    """Each node a token entering `first` may reach, once, depth first; it goes on past a node only
    where `goes_past` says so. A node the caller stops at is still met, not gone past."""
    seen: set[str] = set()
    stack = [first]
    while stack:
        node_id = stack.pop()
        node = nodes.get(node_id)
        if node is None or node_id in seen:
            continue
        seen.add(node_id)
        yield node_id, node
        if goes_past(node):
            stack.extend(node.successors())


def _decided_from(nodes: dict[str, Node], first: str) -> set[str]:
    """The nodes a token entering `first` reaches without waiting (through exclusive gateways)."""
    return {node_id for node_id, _ in _walk(nodes, first, lambda node: node.type == "exclusive")}


def _branch_joins(nodes: dict[str, Node], first: str) -> tuple[set[str], str | None]:
    """The joins a branch starting at `first` reaches, or what is wrong with it."""
    joins: set[str] = set()
    for node_id, node in _walk(nodes, first, lambda node: node.type != "join"):
        if node.type == "join":
            joins.add(node_id)
        elif node.type == "end":
            return joins, f"reaches end {node_id!r} before a join"
        elif node.type == "parallel":
            return joins, f"forks again at {node_id!r}: parallels inside a branch are not supported"
        elif node.fans_out:
            return joins, f"runs for_each at {node_id!r}: for_each inside a branch is not supported yet"
    return joins, None


def _reachable(nodes: dict[str, Node], start: str) -> set[str]:
    return {node_id for node_id, _ in _walk(nodes, start)}


def _check_node(
    checker: Checker,
    raw: Any,
    path: tuple[str | int, ...],
    servers: dict[str, ToolServerSpec],
    models: dict[str, ModelProfile],
) -> Node | None:
    if not isinstance(raw, dict):
        checker.report(path, f"must be a mapping, not {kind(raw)}")
        return None
    node_type = raw.get("type")
    if node_type not in NODE_TYPES:
        checker.report((*path, "type"), f"{node_type!r} is not one of: {', '.join(NODE_TYPES)}")
        return None
    data = checker.mapping(raw, path, set(NODE_KEYS[node_type]))
    node_id = checker.string(data, "id", path, pattern=_IDENTIFIER, what="node id")
    if node_id is None:
        return None
    needs_next = node_type in ("agent", "service", "user_task", "timer", "receive", "join", "call")
    next_node = checker.string(data, "next", path, required=needs_next)
    inputs = data.get("inputs")
    if inputs is not None:
        if not isinstance(inputs, dict):
            checker.report((*path, "inputs"), f"must be a mapping, not {kind(inputs)}")
            inputs = None
        else:
            _check_references(checker, inputs, (*path, "inputs"))
    values: dict[str, Any] = {"id": node_id, "type": node_type, "next": next_node, "inputs": inputs}
    if node_type in ("agent", "service"):
        values["retries"] = checker.integer(data, "retries", path, 3)
        values["retry_backoff_ms"] = checker.integer(data, "retry_backoff_ms", path, 1000)
        values["outage_budget_seconds"] = checker.duration(data, "outage_budget", path)
    if node_type == "service":
        topic = checker.string(data, "topic", path, pattern=_TOPIC, what="topic name")
        if topic and topic.startswith("abada:"):
            checker.report((*path, "topic"), "topics starting with 'abada:' are reserved for the engine")
        values["topic"] = topic
    elif node_type == "agent":
        values.update(_check_agent(checker, data, path, servers, models))
    elif node_type == "exclusive":
        values["branches"], values["default"] = _check_branches(checker, data, path)
    elif node_type == "parallel":
        values["forks"] = _check_forks(checker, data, path)
    elif node_type == "join":
        wait_for = checker.string(data, "wait_for", path, required=False) or "all"
        if wait_for not in JOIN_WAITS:
            checker.report((*path, "wait_for"), f"{wait_for!r} is not one of: {', '.join(JOIN_WAITS)}")
        values["wait_for"] = wait_for
    elif node_type == "timer":
        values.update(_check_timer(checker, data, path))
    elif node_type == "receive":
        values.update(_check_receive(checker, data, path))
    elif node_type == "call":
        values.update(_check_call(checker, data, path))
    if node_type in WAITING_NODE_TYPES:
        values["deadline_seconds"], values["on_deadline"] = _paired_route(
            checker, data, path, "deadline", "on_deadline"
        )
    if node_type in FAN_OUT_NODE_TYPES:
        values.update(_check_for_each(checker, data, path, node_type, values))
    return Node(**values)


# The routes that move a node's token elsewhere: an item of a `for_each` has no token of its own to move.
_ROUTES_NOT_WITH_FOR_EACH = ("on_invalid_output", "on_low_confidence", "on_approval_timeout", "deadline")


def _check_for_each(
    checker: Checker,
    data: dict[str, Any],
    path: tuple[str | int, ...],
    node_type: str,
    values: dict[str, Any],
) -> dict[str, Any]:
    """`for_each` and its fields: a list template, the item's name, how many at once, what is collected,
    what a failed item does and how long the list may be."""
    fan: dict[str, Any] = {}
    if node_type != "agent":
        fan["result_variable"] = checker.string(
            data, "result_variable", path, required=False, pattern=_VARIABLE, what="variable name"
        )
    if data.get("for_each") is None:
        for key in ("as", "max_concurrency", "collect", "on_item_failure", "max_items"):
            if key in data:
                checker.report((*path, key), "only applies with for_each")
        if node_type != "agent" and "result_variable" in data:
            checker.report((*path, "result_variable"), "only applies with for_each (what collect takes)")
        return fan
    for_each = checker.string(data, "for_each", path)
    if for_each is not None:
        _check_references(checker, for_each, (*path, "for_each"))
    fan["for_each"] = for_each
    fan["item_variable"] = checker.string(data, "as", path, pattern=_VARIABLE, what="variable name")
    fan["max_concurrency"] = checker.optional_integer(data, "max_concurrency", path, minimum=1)
    fan["max_items"] = checker.optional_integer(data, "max_items", path, minimum=1)
    fan["collect"] = checker.string(
        data, "collect", path, required=False, pattern=_VARIABLE, what="variable name"
    )
    result_variable = fan.get("result_variable", values.get("result_variable"))
    if fan["collect"] is not None and result_variable is None:
        checker.report((*path, "collect"), "needs a result_variable: what each item's completion gives")
    action = checker.string(data, "on_item_failure", path, required=False)
    if action is not None and action not in ITEM_FAILURE_ACTIONS:
        checker.report(
            (*path, "on_item_failure"), f"{action!r} is not one of: {', '.join(ITEM_FAILURE_ACTIONS)}"
        )
    fan["on_item_failure"] = action
    for key in _ROUTES_NOT_WITH_FOR_EACH:
        if key in data:
            checker.report((*path, key), "is not supported with for_each yet")
    return fan


def _paired_route(
    checker: Checker, data: dict[str, Any], path: tuple[str | int, ...], when: str, route: str
) -> tuple[float | None, str | None]:
    """A duration and the node the token goes to once it passes: both or neither."""
    seconds = checker.duration(data, when, path)
    target = checker.string(data, route, path, required=False)
    if data.get(when) is not None and data.get(route) is None:
        checker.report((*path, route), f"is required with {when}: where the token goes once it passes")
    if data.get(route) is not None and data.get(when) is None:
        checker.report((*path, route), f"needs a {when} to ever be taken")
    return seconds, target


def _check_timer(checker: Checker, data: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {"duration_seconds": checker.duration(data, "duration", path)}
    values["until"] = checker.string(data, "until", path, required=False)
    if values["until"] is not None:
        _check_references(checker, values["until"], (*path, "until"))
    if (data.get("duration") is None) == (data.get("until") is None):
        checker.report(path, "a timer needs exactly one of duration (ISO-8601) or until (an RFC 3339 time)")
    return values


def _check_receive(checker: Checker, data: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
    values: dict[str, Any] = {
        "message": checker.string(data, "message", path, pattern=_TOPIC, what="message name"),
        "correlation_key": checker.string(data, "correlation_key", path),
        "result_variable": checker.string(
            data, "result_variable", path, required=False, pattern=_IDENTIFIER, what="variable name"
        ),
    }
    if values["correlation_key"] is not None:
        _check_references(checker, values["correlation_key"], (*path, "correlation_key"))
    values["timeout_seconds"], values["on_timeout"] = _paired_route(
        checker, data, path, "timeout", "on_timeout"
    )
    return values


def _check_call(checker: Checker, data: dict[str, Any], path: tuple[str | int, ...]) -> dict[str, Any]:
    """A call activity: which process, which of its versions, the child's business key and where its
    result lands (whether the process exists, and whether calls go round, deploy checks: catalog.py)."""
    version = checker.string(data, "version", path, required=False) or "latest"
    if version not in CALL_VERSIONS:
        checker.report((*path, "version"), f"{version!r} is not one of: {', '.join(CALL_VERSIONS)}")
    values: dict[str, Any] = {
        "process": checker.string(data, "process", path, pattern=_IDENTIFIER, what="process id"),
        "version": version,
        "business_key": checker.string(data, "business_key", path, required=False),
        "result_variable": checker.string(
            data, "result_variable", path, required=False, pattern=_VARIABLE, what="variable name"
        ),
    }
    if values["business_key"] is not None:
        _check_references(checker, values["business_key"], (*path, "business_key"))
    return values


def _check_agent(
    checker: Checker,
    data: dict[str, Any],
    path: tuple[str | int, ...],
    servers: dict[str, ToolServerSpec],
    models: dict[str, ModelProfile],
) -> dict[str, Any]:
    values: dict[str, Any] = {"topic": AGENT_TOPIC}
    model = checker.string(data, "model", path)
    values["model"] = model
    profile = models.get(model) if model else None
    values["provider"] = _check_provider(checker, data, path, model, profile.provider if profile else None)
    prompt = checker.string(data, "prompt", path)
    if prompt:
        for problem in reference_syntax_errors(prompt):
            checker.report((*path, "prompt"), problem)
    values["prompt"] = prompt
    values["result_variable"] = checker.string(
        data, "result_variable", path, pattern=_VARIABLE, what="variable name"
    )
    refs = data.get("tools", [])
    tools: list[str] = []
    if not isinstance(refs, list):
        checker.report((*path, "tools"), f"must be a list of server/tool references, not {kind(refs)}")
        refs = []
    for index, ref in enumerate(refs):
        ref_path = (*path, "tools", index)
        if not isinstance(ref, str) or ref.count("/") != 1:
            checker.report(ref_path, f"{ref!r} is not a server/tool reference")
            continue
        server_name, tool_name = ref.split("/")
        if server_name not in servers:
            checker.report(ref_path, f"unknown tool server {server_name!r}")
        elif tool_name not in servers[server_name].tools:
            checker.report(ref_path, f"tool {tool_name!r} is not declared on server {server_name!r}")
        elif ref in tools:
            checker.report(ref_path, f"{ref!r} is listed twice")
        else:
            tools.append(ref)
    values["tools"] = tuple(tools)
    schema = data.get("output_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            checker.report((*path, "output_schema"), f"must be a JSON Schema object, not {kind(schema)}")
        else:
            problems = schema_problems(schema)
            for problem in problems:
                checker.report((*path, "output_schema"), problem)
            if not problems:
                values["output_schema"] = schema
    threshold = data.get("confidence_threshold")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 100:
            checker.report(
                (*path, "confidence_threshold"), f"must be a number from 0 to 100, not {threshold!r}"
            )
        else:
            values["confidence_threshold"] = float(threshold)
    limits = data.get("limits", {})
    limits_path = (*path, "limits")
    limits = checker.mapping(limits, limits_path, _LIMIT_KEYS)
    defaults = Limits()
    values["limits"] = Limits(
        max_model_calls=checker.integer(limits, "max_model_calls", limits_path, defaults.max_model_calls, 1),
        max_tool_calls=checker.integer(limits, "max_tool_calls", limits_path, defaults.max_tool_calls, 0),
        max_tokens=checker.integer(limits, "max_tokens", limits_path, defaults.max_tokens, 1),
        max_cost_usd=checker.amount(limits, "max_cost_usd", limits_path, positive=True),
    )
    values["on_invalid_output"] = checker.string(data, "on_invalid_output", path, required=False)
    values["on_low_confidence"] = checker.string(data, "on_low_confidence", path, required=False)
    values["approval_timeout_seconds"] = checker.duration(data, "approval_timeout", path)
    values["on_approval_timeout"] = checker.string(data, "on_approval_timeout", path, required=False)
    if values["on_approval_timeout"] and data.get("approval_timeout") is None:
        checker.report((*path, "on_approval_timeout"), "needs an approval_timeout to ever be taken")
    return values


def _check_provider(
    checker: Checker,
    data: dict[str, Any],
    path: tuple[str | int, ...],
    model: str | None,
    profile_provider: str | None,
) -> str | None:
    """The provider frozen into the version: the model profile's, else the node's `provider:`, else
    the model name's family."""
    explicit = checker.string(data, "provider", path, required=False)
    if explicit is not None and explicit not in PROVIDERS:
        checker.report(
            (*path, "provider"), f"{explicit!r} is not a provider (one of: {', '.join(PROVIDERS)})"
        )
        return None
    if model is None:
        return explicit
    if explicit and profile_provider and explicit != profile_provider:
        checker.report(
            (*path, "provider"),
            f"{explicit!r} contradicts the model profile {model!r}, whose provider is {profile_provider!r}",
        )
        return None
    try:
        return resolve_provider(model, explicit, profile_provider)
    except ProviderUndecided as undecided:
        checker.report((*path, "model"), str(undecided))
        return None


def _check_branches(
    checker: Checker, data: dict[str, Any], path: tuple[str | int, ...]
) -> tuple[tuple[Branch, ...], str | None]:
    raw = data.get("branches")
    branches: list[Branch] = []
    if not isinstance(raw, list) or not raw:
        checker.report((*path, "branches"), "must be a non-empty list of {when, next}")
        raw = []
    for index, item in enumerate(raw):
        branch_path = (*path, "branches", index)
        branch = checker.mapping(item, branch_path, {"when", "next"})
        when = checker.string(branch, "when", branch_path)
        target = checker.string(branch, "next", branch_path)
        if when:
            problem = cel_syntax_error(when)
            if problem:
                checker.report((*branch_path, "when"), problem)
        if when and target:
            branches.append(Branch(when, target))
    default = checker.string(data, "default", path, required=False)
    return tuple(branches), default


def _check_references(checker: Checker, value: Any, path: tuple[str | int, ...]) -> None:
    if isinstance(value, str):
        for problem in reference_syntax_errors(value):
            checker.report(path, problem)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_references(checker, item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_references(checker, item, (*path, index))
