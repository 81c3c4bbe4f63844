"""How each engine object reads to a person: tables and cards built from the API's messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from abada.engine.v1 import (
    approval_pb2,
    batch_pb2,
    common_pb2,
    definition_pb2,
    dependency_pb2,
    external_task_pb2,
    incident_pb2,
    process_pb2,
    queue_pb2,
)
from google.protobuf import struct_pb2

from .render import (
    EMPTY,
    age,
    enum_label,
    fields,
    is_set,
    message_dict,
    moment,
    pretty_json,
    shorten,
    summary,
    table,
)

# The journal's keys are long HMACs; the first characters are enough to match them with a tool server's log.
_KEY_PREFIX = 12
_SHA_PREFIX = 12
# What an operator needs first when deciding whether a tool call happened; other details follow.
_CALL_DETAIL_ORDER = (
    "tool_ref",
    "arguments",
    "idempotency",
    "idempotency_key",
    "started_at",
    "attempt",
    "sequence",
)


def struct_value(message: struct_pb2.Struct) -> dict[str, Any]:
    return message_dict(message)


def instance_state(state: int) -> str:
    return enum_label(process_pb2.InstanceState.Name(state), "INSTANCE_STATE_")


def binding_ref(binding: common_pb2.ToolBinding) -> str:
    return f"{binding.server}/{binding.tool}"


def idempotency(binding: common_pb2.ToolBinding) -> str:
    if binding.idempotency == common_pb2.IDEMPOTENCY_UNSPECIFIED:
        return EMPTY  # reads have none to declare
    return enum_label(common_pb2.Idempotency.Name(binding.idempotency), "IDEMPOTENCY_").lower()


def bindings_table(bindings: Sequence[common_pb2.ToolBinding]) -> str:
    rows = [
        (
            binding_ref(b),
            enum_label(common_pb2.ToolPolicy.Name(b.policy), "TOOL_POLICY_").lower(),
            idempotency(b),
            b.transport or EMPTY,
            b.url or EMPTY,
            b.credential or EMPTY,
            shorten(b.input_schema_sha256, _SHA_PREFIX) if b.input_schema_sha256 else EMPTY,
        )
        for b in bindings
    ]
    return table(("TOOL", "POLICY", "IDEMPOTENCY", "TRANSPORT", "URL", "CREDENTIAL", "SCHEMA SHA-256"), rows)


def deployment(source_name: str, response: definition_pb2.DeployResponse) -> str:
    created = set(response.created_process_ids)
    rows = [
        (
            d.process_id,
            str(d.version),
            "new" if d.process_id in created else "unchanged",
            str(len(d.tool_bindings)),
            d.id,
        )
        for d in response.definitions
    ]
    parts = [
        f"deployed {source_name}",
        table(("PROCESS", "VERSION", "STATUS", "TOOLS", "DEFINITION"), rows),
    ]
    for d in response.definitions:
        if d.tool_bindings:
            parts.append(
                f"\n{d.process_id} v{d.version} frozen tool bindings:\n{bindings_table(d.tool_bindings)}"
            )
    return "\n".join(parts)


def definitions_table(definitions: Sequence[definition_pb2.Definition]) -> str:
    rows = [
        (
            d.process_id,
            str(d.version),
            d.id,
            d.source_name or EMPTY,
            moment(d.create_time),
            ", ".join(binding_ref(b) for b in d.tool_bindings) or EMPTY,
        )
        for d in definitions
    ]
    return table(("PROCESS", "VERSION", "ID", "SOURCE", "CREATED", "TOOLS"), rows)


def started(instance: process_pb2.Instance) -> str:
    return fields(
        [
            ("instance", instance.id),
            ("process", f"{instance.process_id} v{instance.version}"),
            ("state", instance_state(instance.state)),
            ("token at", instance.current_node_id or EMPTY),
            *([("business key", instance.business_key)] if instance.business_key else []),
        ]
    )


def instances_table(instances: Sequence[process_pb2.Instance]) -> str:
    rows = [
        (
            i.id,
            i.process_id,
            str(i.version),
            instance_state(i.state),
            i.current_node_id or EMPTY,
            str(i.open_incidents),
            i.business_key or EMPTY,
            moment(i.create_time),
        )
        for i in instances
    ]
    return table(
        ("ID", "PROCESS", "VERSION", "STATE", "NODE", "INCIDENTS", "BUSINESS KEY", "STARTED"),
        rows,
        drop=("STARTED", "BUSINESS KEY", "VERSION", "INCIDENTS"),
    )


def history_table(events: Sequence[process_pb2.HistoryEvent]) -> str:
    rows = [
        (
            moment(e.create_time, precise=True),
            e.type,
            e.node_id or EMPTY,
            e.task_id or EMPTY,
            summary(struct_value(e.data)),
        )
        for e in events
    ]
    return table(("TIME", "TYPE", "NODE", "TASK", "DATA"), rows, drop=("TASK", "TIME"))


def history_line(event: process_pb2.HistoryEvent) -> str:
    """One event on one line, for following an instance as it runs."""
    parts = [moment(event.create_time, precise=True), event.type, event.node_id or EMPTY]
    if event.task_id:
        parts.append(f"task {event.task_id}")
    data = summary(struct_value(event.data), 80)
    if data != EMPTY:
        parts.append(data)
    return "  ".join(parts)


def tasks_of(events: Sequence[process_pb2.HistoryEvent]) -> str:
    """The instance's tasks by node, each with the command that shows its journal."""
    seen: dict[str, str] = {}
    for event in events:
        if event.task_id and event.task_id not in seen:
            seen[event.task_id] = event.node_id
    rows = [(node or EMPTY, task_id) for task_id, node in seen.items()]
    return table(("NODE", "TASK"), rows)


def fan_outs_table(fan_outs: Sequence[process_pb2.FanOut]) -> str:
    """Each `for_each` node's items: how many, and how far they got."""
    rows = [
        (
            f.node_id,
            f.state,
            str(f.items_total),
            str(f.items_done),
            str(f.items_running),
            str(f.items_failed),
            str(f.items_skipped),
        )
        for f in fan_outs
    ]
    return table(("NODE", "STATE", "ITEMS", "DONE", "RUNNING", "FAILED", "SKIPPED"), rows)


def instance_card(instance: process_pb2.Instance, events: Sequence[process_pb2.HistoryEvent]) -> str:
    card = fields(
        [
            ("instance", instance.id),
            ("process", f"{instance.process_id} v{instance.version} (definition {instance.definition_id})"),
            ("state", instance_state(instance.state)),
            ("current node", instance.current_node_id or EMPTY),
            # Several between a parallel and its join: every branch's token, where it rests.
            ("active tokens at", ", ".join(instance.active_node_ids) or EMPTY),
            ("business key", instance.business_key or EMPTY),
            *([("called by", instance.parent_instance_id)] if instance.parent_instance_id else []),
            ("started", moment(instance.create_time)),
            ("ended", moment(instance.end_time)),
            ("open incidents", str(instance.open_incidents)),
            ("model cost", dollars(completed_cost(events)) if completed_cost(events) else EMPTY),
        ]
    )
    history = history_table(events) if events else "(no history)"
    parts = [card, f"variables:\n{pretty_json(struct_value(instance.variables))}"]
    if any(e.task_id for e in events):
        parts.append(f"tasks (abada journal TASK):\n{tasks_of(events)}")
    if instance.waits:
        parts.append(f"timers, messages and deadlines:\n{waits_table(instance.waits)}")
    if instance.fan_outs:
        parts.append(f"for_each items:\n{fan_outs_table(instance.fan_outs)}")
    if instance.children:
        parts.append(f"called instances (abada show ID):\n{children_table(instance.children)}")
    parts.append(f"history:\n{history}")
    return "\n\n".join(parts)


def children_table(children: Sequence[process_pb2.ChildInstance]) -> str:
    """The instances an instance's call activities started: where each stands, and its incidents."""
    rows = [
        (
            c.instance_id,
            c.node_id or EMPTY,
            f"{c.process_id} v{c.version}",
            instance_state(c.state),
            str(c.open_incidents),
        )
        for c in children
    ]
    return table(("ID", "CALLED FROM", "PROCESS", "STATE", "INCIDENTS"), rows)


def waits_table(waits: Sequence[process_pb2.Wait]) -> str:
    """What an instance waits on besides workers and people, and when each fired (or was answered)."""
    rows = []
    for wait in waits:
        kind = enum_label(process_pb2.Wait.Kind.Name(wait.kind), "KIND_")
        what = f"{wait.message} (key {wait.correlation_key})" if wait.message else EMPTY
        fired = moment(wait.fire_time, precise=True)
        rows.append([kind, wait.node_id, moment(wait.due_time, precise=True), fired, what])
    return table(["KIND", "NODE", "DUE", "FIRED/ANSWERED", "MESSAGE"], rows)


def publication(response: process_pb2.PublishMessageResponse) -> str:
    """How a publication went, in one line."""
    said = "already published (same --message-id): " if response.duplicate else ""
    if response.correlated:
        return f"{said}correlated to instance {response.instance_id} (message {response.message_key})"
    return f"{said}buffered: no instance waits for it yet (message {response.message_key})"


def purged(response: process_pb2.PurgeInstancesResponse, before: str) -> str:
    """What a purge deleted (or, dry, would delete), in one line."""
    if response.dry_run:
        return f"{response.instances} finished instance(s) ended before {before} (dry run: nothing deleted)"
    return f"purged {response.instances} finished instance(s) ended before {before} ({response.rows} rows)"


def erased(response: process_pb2.EraseInstancesResponse) -> str:
    """What an erasure deleted, in one line."""
    canceled = f", {response.canceled} cancelled first" if response.canceled else ""
    return (
        f"erased {response.instances} instance(s){canceled}: {response.rows} rows "
        f"(audit record {response.erasure_id})"
    )


def migrated(response: process_pb2.MigrateInstancesResponse, source: str, to: int) -> str:
    """The plan (each node holding a token and what it becomes), then how many instances moved."""
    lines = [f"  {m.from_node_id} -> {m.to_node_id}" for m in response.plan]
    if response.dry_run:
        head = f"{response.instances} instance(s) of {source} would move to version {to} (dry run: nothing moved)"
    else:
        head = f"migrated {response.instances} instance(s) of {source} to version {to}"
    return "\n".join([head, *lines])


def incidents_table(incidents: Sequence[incident_pb2.Incident], with_state: bool) -> str:
    headers = ["ID", "TYPE", "INSTANCE", "TASK", "NODE", "AGE"]
    if with_state:
        headers += ["STATE", "RESOLUTION"]
    headers.append("MESSAGE")
    rows = []
    for incident in incidents:
        row = [
            incident.id,
            incident.type,
            incident.instance_id,
            incident.task_id or EMPTY,
            incident.node_id or EMPTY,
            age(incident.create_time),
        ]
        if with_state:
            row += [
                enum_label(incident_pb2.IncidentState.Name(incident.state), "INCIDENT_STATE_"),
                incident.resolution or EMPTY,
            ]
        row.append(" ".join(incident.message.split()) or EMPTY)
        rows.append(row)
    parts = [table(headers, rows, drop=("AGE", "NODE", "RESOLUTION", "STATE"))]
    parts += [outcome_unknown_card(i) for i in incidents if i.type == "TOOL_OUTCOME_UNKNOWN"]
    return "\n\n".join(parts)


def outcome_unknown_card(incident: incident_pb2.Incident) -> str:
    details = struct_value(incident.details)
    # The engine records the journaled request ({callId, arguments}); an operator reads the arguments first.
    request = details.pop("request", None)
    if isinstance(request, dict):
        if "arguments" in request:
            details.setdefault("arguments", request.pop("arguments"))
        if "callId" in request:
            details.setdefault("call_id", request.pop("callId"))
        if request:
            details["request"] = request
    elif request is not None:
        details["request"] = request
    known_first = [key for key in _CALL_DETAIL_ORDER if key in details]
    ordered = known_first + sorted(set(details) - set(known_first))
    pairs = [(key, _detail_text(details[key])) for key in ordered]
    lines = [f"incident {incident.id}: did this call happen?"]
    if pairs:
        lines.append(fields(pairs, indent="  "))
    if incident.state == incident_pb2.INCIDENT_STATE_OPEN:
        lines.append(
            f"  decide with: abada resolve {incident.id} --happened --result '{{...}}' | --did-not-happen | --cancel"
        )
    return "\n".join(lines)


def _detail_text(value: Any) -> str:
    return value if isinstance(value, str) else pretty_json(value)


def resolved(incident: incident_pb2.Incident) -> str:
    return fields(
        [
            ("incident", incident.id),
            ("type", incident.type),
            ("state", enum_label(incident_pb2.IncidentState.Name(incident.state), "INCIDENT_STATE_")),
            ("resolution", incident.resolution or EMPTY),
            ("instance", incident.instance_id),
        ]
    )


def user_tasks_table(tasks: Sequence[process_pb2.UserTask]) -> str:
    rows = [
        (
            t.id,
            t.instance_id,
            t.process_id,
            t.node_id,
            age(t.create_time),
            summary(struct_value(t.variables), 50),
        )
        for t in tasks
    ]
    return table(("ID", "INSTANCE", "PROCESS", "NODE", "WAITING", "VARIABLES"), rows)


def user_task_completed(task_id: str, instance: process_pb2.Instance) -> str:
    return f"completed user task {task_id}\n" + started(instance)


def journal_table(steps: Sequence[external_task_pb2.JournalStep]) -> str:
    rows = [
        (
            str(s.sequence),
            str(s.attempt),
            enum_label(external_task_pb2.StepKind.Name(s.kind), "STEP_KIND_"),
            enum_label(external_task_pb2.StepState.Name(s.state), "STEP_STATE_"),
            s.tool_ref or EMPTY,
            f"{s.tokens.input_tokens}/{s.tokens.output_tokens}"
            if s.tokens.input_tokens or s.tokens.output_tokens
            else EMPTY,
            dollars(s.cost_usd) if s.cost_usd else EMPTY,
            shorten(s.idempotency_key, _KEY_PREFIX) if s.idempotency_key else EMPTY,
            "yes" if s.abandoned else EMPTY,
            summary(struct_value(s.request), 40) if s.HasField("request") else EMPTY,
            summary(struct_value(s.response), 40) if s.HasField("response") else EMPTY,
        )
        for s in steps
    ]
    headers = (
        "SEQ",
        "ATTEMPT",
        "KIND",
        "STATE",
        "TOOL",
        "TOKENS IN/OUT",
        "COST",
        "IDEMPOTENCY KEY",
        "ABANDONED",
        "REQUEST",
        "RESPONSE",
    )
    # Narrow, the requests go first (--output json has them whole); ABANDONED only when no step is.
    droppable = ["REQUEST", "IDEMPOTENCY KEY"] + ([] if any(s.abandoned for s in steps) else ["ABANDONED"])
    total = sum(s.cost_usd for s in steps)
    spent = f"\nmodel cost: {dollars(total)} over {sum(1 for s in steps if s.cost_usd)} priced model call(s)"
    return table(headers, rows, drop=droppable) + (spent if total else "")


def outcome(instance: process_pb2.Instance, incidents: Sequence[incident_pb2.Incident]) -> str:
    """How a waited-for instance ended (or where it stands), for `start --wait`."""
    parts = [started(instance), f"variables:\n{pretty_json(struct_value(instance.variables))}"]
    if incidents:
        parts.append(incidents_table(incidents, with_state=False))
    return "\n\n".join(parts)


def queued_tasks_table(tasks: Sequence[queue_pb2.QueuedTask]) -> str:
    rows = [
        (
            t.id,
            t.topic_name,
            t.state,
            str(t.attempt),
            str(t.retries_left),
            t.lease_owner or (f"(waits for {t.parked_on})" if t.parked_on else EMPTY),
            age(t.create_time),
            t.node_id,
            t.instance_id,
        )
        for t in tasks
    ]
    return table(
        ("ID", "TOPIC", "STATE", "ATTEMPT", "RETRIES LEFT", "HOLDER", "AGE", "NODE", "INSTANCE"),
        rows,
        drop=("INSTANCE", "NODE", "RETRIES LEFT"),
    )


def topics_table(topics: Sequence[queue_pb2.TopicStats]) -> str:
    rows = [
        (
            t.name,
            str(t.ready),
            str(t.leased),
            str(t.delayed),
            str(t.demand) + (f" ({t.quota_waiting} waiting for quota)" if t.quota_waiting else ""),
            f"{t.oldest_ready_age_seconds:.1f}s" if t.ready else EMPTY,
            str(t.parked),
        )
        for t in topics
    ]
    return table(("TOPIC", "READY", "LEASED", "DELAYED", "DEMAND", "OLDEST READY", "PARKED"), rows)


def models_table(models: Sequence[queue_pb2.ModelQuotaStats]) -> str:
    rows = [
        (m.name, str(m.admitted), str(m.tokens), str(m.waiting), str(m.refused_by_this_replica))
        for m in models
    ]
    return table(("MODEL", "ADMITTED (LAST MINUTE)", "TOKENS", "WAITING", "REFUSED (THIS ENGINE)"), rows)


def dollars(amount: float) -> str:
    """Model costs are often fractions of a cent: enough digits to see them."""
    return f"${amount:.6f}"


def completed_cost(events: Sequence[process_pb2.HistoryEvent]) -> float:
    """What the instance's completed agent attempts cost, from the engine's attempt metadata."""
    total = 0.0
    for event in events:
        if event.type == "TASK_COMPLETED":
            metadata = struct_value(event.data).get("metadata") or {}
            total += float(metadata.get("cost_usd") or 0)
    return total


def approval_card(approval: approval_pb2.Approval) -> str:
    """One tool call waiting for (or given) a person's decision, with what the model said and asked."""
    pairs = [
        ("approval", approval.id),
        ("state", enum_label(approval_pb2.ApprovalState.Name(approval.state), "APPROVAL_STATE_")),
        ("tool", approval.tool_ref),
        ("instance", approval.instance_id),
        ("process", approval.process_id),
        ("business key", approval.business_key or EMPTY),
        ("node", approval.node_id),
        ("asked", f"{moment(approval.create_time)} ({age(approval.create_time)} ago)"),
    ]
    if is_set(approval.expire_time):
        pairs.append(("expires", moment(approval.expire_time)))
    if approval.model_text:
        pairs.append(("model said", " ".join(approval.model_text.split())))
    pairs.append(("arguments", pretty_json(struct_value(approval.arguments))))
    if approval.decided_by:
        pairs.append(("decided by", f"{approval.decided_by} at {moment(approval.decide_time)}"))
    if approval.HasField("approved_arguments"):
        pairs.append(("approved arguments", pretty_json(struct_value(approval.approved_arguments))))
    if approval.comment:
        pairs.append(("comment", approval.comment))
    lines = [fields(pairs)]
    if approval.state == approval_pb2.APPROVAL_STATE_PENDING:
        lines.append(
            f"decide with: abada approve {approval.id} [--args JSON] [--comment TEXT] | "
            f"abada reject {approval.id} --reason TEXT"
        )
    return "\n".join(lines)


def approvals_list(approvals: Sequence[approval_pb2.Approval]) -> str:
    return "\n\n".join(approval_card(a) for a in approvals)


def dependency_name(dependency: dependency_pb2.Dependency) -> str:
    """`model:gemini-3.6-flash`, as `--dependency` takes it."""
    kind = enum_label(dependency_pb2.DependencyKind.Name(dependency.kind), "DEPENDENCY_KIND_").lower()
    return f"{kind}:{dependency.name}"


def dependencies_table(dependencies: Sequence[dependency_pb2.DependencyStatus]) -> str:
    rows = [
        (
            dependency_name(d.dependency),
            enum_label(dependency_pb2.DependencyState.Name(d.state), "DEPENDENCY_STATE_").lower(),
            age(d.down_since) if is_set(d.down_since) else EMPTY,
            str(d.held_tasks),
            moment(d.next_probe_time) if is_set(d.next_probe_time) else (d.probe_task_id or EMPTY),
            str(d.failed_probes),
            shorten(d.last_error, 80) if d.state != dependency_pb2.DEPENDENCY_STATE_UP else EMPTY,
        )
        for d in dependencies
    ]
    return table(
        ("DEPENDENCY", "STATE", "DOWN FOR", "HELD TASKS", "NEXT PROBE", "FAILED PROBES", "LAST ERROR"),
        rows,
        drop=("LAST ERROR", "FAILED PROBES"),
    )


def bulk_resolved(response: incident_pb2.ResolveIncidentsResponse) -> str:
    lines = [f"resolved {len(response.resolved)} incident(s)"]
    lines += [f"  not resolved {r.incident_id}: {r.reason}: {r.message}" for r in response.refused]
    return "\n".join(lines)


def batch_kind(kind: int) -> str:
    return enum_label(batch_pb2.BatchKind.Name(kind), "BATCH_KIND_").lower().replace("_", "-")


def batch_state(state: int) -> str:
    return enum_label(batch_pb2.BatchState.Name(state), "BATCH_STATE_")


def _filter_text(which: batch_pb2.BatchFilter) -> str:
    parts = [f"process={which.process_id}"]
    if which.version:
        parts.append(f"version={which.version}")
    for name in ("state", "node_id", "business_key", "incident_type", "incident_message"):
        value = getattr(which, name)
        if value:
            parts.append(f"{name}={value}")
    return " ".join(parts)


def _progress(batch: batch_pb2.Batch) -> str:
    return f"{batch.total - batch.pending}/{batch.total}"


def batches_table(batches: Sequence[batch_pb2.Batch]) -> str:
    rows = [
        (
            b.id,
            batch_kind(b.kind),
            batch_state(b.state),
            _progress(b),
            str(b.done),
            str(b.skipped),
            str(b.failed),
            b.created_by or EMPTY,
            moment(b.create_time),
            _filter_text(b.filter),
        )
        for b in batches
    ]
    return table(
        ("ID", "KIND", "STATE", "PROGRESS", "DONE", "SKIPPED", "FAILED", "BY", "CREATED", "FILTER"),
        rows,
        drop=("FILTER", "BY", "CREATED"),
    )


def batch_card(response: batch_pb2.GetBatchResponse) -> str:
    """A batch's progress, then each instance's outcome (those not yet worked on are counted only)."""
    batch = response.batch
    pairs = [
        ("Batch", batch.id),
        ("Kind", batch_kind(batch.kind)),
        ("State", batch_state(batch.state)),
        ("Filter", _filter_text(batch.filter)),
        (
            "Progress",
            f"{_progress(batch)} ({batch.done} done, {batch.skipped} skipped, {batch.failed} failed, "
            f"{batch.pending} pending)",
        ),
        ("Created", f"{moment(batch.create_time)} by {batch.created_by or EMPTY}"),
    ]
    if batch.reason:
        pairs.append(("Reason", batch.reason))
    if batch.HasField("migration"):
        renamed = ", ".join(f"{m.from_node_id} -> {m.to_node_id}" for m in batch.migration.mappings)
        pairs.append(("Migrate to", f"v{batch.migration.to_version}" + (f" ({renamed})" if renamed else "")))
    if batch.HasField("modification"):
        pairs.append(("Changes", _modification_text(batch.modification)))
    if is_set(batch.end_time):
        pairs.append(("Ended", moment(batch.end_time)))
    worked = [i for i in response.items if i.outcome != batch_pb2.BATCH_OUTCOME_PENDING]
    if not worked:
        return fields(pairs)
    rows = [
        (
            i.instance_id,
            enum_label(batch_pb2.BatchOutcome.Name(i.outcome), "BATCH_OUTCOME_"),
            i.message or EMPTY,
            moment(i.finish_time),
        )
        for i in worked
    ]
    return fields(pairs) + "\n\n" + table(("INSTANCE", "OUTCOME", "MESSAGE", "AT"), rows, drop=("AT",))


def _modification_text(change: batch_pb2.BatchModification) -> str:
    parts = [f"set {name}" for name in change.set_variables.fields]
    parts += [f"unset {name}" for name in change.unset_variables]
    parts += [f"move {m.from_node_id} -> {m.to_node_id}" for m in change.moves]
    return ", ".join(parts) or EMPTY


def batch_line(batch: batch_pb2.Batch, what: str) -> str:
    return f"batch {batch.id} {what}: {batch_state(batch.state)}, {_progress(batch)} worked on"
