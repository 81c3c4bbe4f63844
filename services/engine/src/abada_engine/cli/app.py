"""The `abada` commands: each one request (or a few) to the engine, printed for people or as JSON."""

from __future__ import annotations

import datetime
import enum
import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, TypeVar

import grpc
import typer
from abada.engine.v1 import (
    batch_pb2,
    dependency_pb2,
    external_task_pb2,
    incident_pb2,
    process_pb2,
)
from abada_sdk import ApprovalState, InstanceState, Resolution, requests
from abada_sdk.client import Stubs
from abada_sdk.connection import DEFAULT_ADDRESS, DEFAULT_TIMEOUT_SECONDS
from google.protobuf.message import Message
from typer.core import TyperGroup

from abada_engine.definitions.durations import iso_duration_seconds

from . import views
from .dev import dev
from .errors import FAILURE, CliError, invalid_input
from .global_options import HELP_OPTIONS, hoist
from .help_text import BATCH_EXAMPLES, COMMON_EXIT_CODES, epilog
from .inputs import json_object, rfc3339, variables
from .output import OutputFormat, data_of, emit
from .paging import follow
from .render import compact_json, message_dict
from .session import ConnectionSettings, LazyEngine, read_token_file

# The engine caps a page at 500; asking for full pages keeps long listings to a few round trips.
_MAX_PAGE_SIZE = 500
# The largest page of the lists that returned everything before they paged (incidents, approvals, ...).
_MAX_LISTED = 1000


# How often `start --wait` and `show --follow` ask the engine again.
_POLL_SECONDS = 0.5


_HELP_ONLY = "abada.help_only"

Listed = TypeVar("Listed", bound=Message)


class _ReportingGroup(TyperGroup):
    """Global options anywhere on the line; every CliError becomes `error: ...` on stderr, never a traceback."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        hoisted = hoist(self, ctx, args)
        # A command's --help needs no connection: `connect` then reads no token file.
        before_end = itertools.takewhile(lambda arg: arg != "--", hoisted)
        ctx.meta[_HELP_ONLY] = any(arg in HELP_OPTIONS for arg in before_end)
        return super().parse_args(ctx, hoisted)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and not command.epilog:
            command.epilog = epilog(cmd_name)
        return command

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as error:
            for line in error.lines():
                typer.echo(line, err=True)
            raise typer.Exit(error.exit_code) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None


app = typer.Typer(
    name="abada",
    cls=_ReportingGroup,
    help="Operate an Abada engine: deploy definitions, start and inspect instances, decide incidents.",
    no_args_is_help=True,
    context_settings={"help_option_names": list(HELP_OPTIONS)},
    epilog=f"`abada COMMAND --help` (or -h) shows a command's own options and an example.\n\n{COMMON_EXIT_CODES}",
    pretty_exceptions_enable=False,
    add_completion=True,
)
VarOption = Annotated[
    list[str] | None,
    typer.Option(
        "--var", metavar="KEY=VALUE", help="A variable; VALUE is JSON when it parses, else a string."
    ),
]
VarsJsonOption = Annotated[
    str | None, typer.Option("--vars-json", metavar="JSON", help="Variables as one JSON object (--var wins).")
]


class InstanceStateChoice(enum.StrEnum):
    active = "active"
    completed = "completed"
    canceled = "canceled"


class BatchOutcomeChoice(enum.StrEnum):
    pending = "pending"
    done = "done"
    skipped = "skipped"
    failed = "failed"


class WaitingForChoice(enum.StrEnum):
    timer = "timer"
    message = "message"


_WAITING_FOR = {
    WaitingForChoice.timer: process_pb2.WAITING_FOR_TIMER,
    WaitingForChoice.message: process_pb2.WAITING_FOR_MESSAGE,
}


def _choose_token(ctx: typer.Context, token: str | None, token_file: Path | None) -> tuple[str | None, str]:
    """The token to send and where it came from, said as the user would fix it."""
    # Compared by name: newer typer vendors click, so its ParameterSource is not click's.
    from_command_line = {
        name
        for name in ("token", "token_file")
        if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"
    }
    if token and token_file:
        # A flag on the command line beats a variable left in the environment; two flags are a mistake.
        if from_command_line == {"token_file"}:
            token = None
        elif from_command_line != {"token"}:
            raise invalid_input("give a token or a token file, not both")
    if token:
        return token.strip(), "--token" if "token" in from_command_line else "ABADA_TOKEN"
    if token_file:
        named = "--token-file" if "token_file" in from_command_line else "ABADA_TOKEN_FILE"
        return read_token_file(token_file), f"{named} {token_file}"
    return None, ""


@dataclass
class CliState:
    engine: LazyEngine
    output: OutputFormat


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"abada {metadata.version('abada-engine')}")
        raise typer.Exit()


@app.callback()
def connect(
    ctx: typer.Context,
    engine: Annotated[
        str,
        typer.Option(
            "--engine", envvar="ABADA_ENGINE_ADDRESS", metavar="HOST:PORT", help="The engine's gRPC address."
        ),
    ] = DEFAULT_ADDRESS,
    token: Annotated[
        str | None, typer.Option(envvar="ABADA_TOKEN", help="Bearer token sent as `authorization` metadata.")
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(envvar="ABADA_TOKEN_FILE", dir_okay=False, help="A file holding the bearer token."),
    ] = None,
    tls_ca: Annotated[
        Path | None,
        typer.Option(envvar="ABADA_TLS_CA_FILE", help="CA bundle to verify the engine (turns on TLS)."),
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(envvar="ABADA_TLS_CERT_FILE", help="Client certificate for mTLS.")
    ] = None,
    tls_key: Annotated[
        Path | None, typer.Option(envvar="ABADA_TLS_KEY_FILE", help="Client key for mTLS.")
    ] = None,
    timeout: Annotated[
        float, typer.Option(envvar="ABADA_TIMEOUT", min=0.1, help="Seconds to wait for each answer.")
    ] = DEFAULT_TIMEOUT_SECONDS,
    output: Annotated[
        OutputFormat,
        typer.Option(
            "--output",
            "-o",
            envvar="ABADA_OUTPUT",
            help="How to print answers: table (for people), json or yaml.",
        ),
    ] = OutputFormat.table,
    as_json: Annotated[bool, typer.Option("--json", help="Same as --output json.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """Options go before or after the command: `abada instances --token-file F` works too."""
    if ctx.meta.get(_HELP_ONLY):
        return
    chosen_token, token_source = _choose_token(ctx, token, token_file)
    lazy = LazyEngine(
        ConnectionSettings(engine, timeout, chosen_token, tls_ca, tls_cert, tls_key, token_source)
    )
    ctx.obj = CliState(lazy, OutputFormat.json if as_json else output)
    ctx.call_on_close(lazy.close)


app.command("dev")(dev)


def _state(ctx: typer.Context) -> CliState:
    state: CliState = ctx.find_root().obj
    return state


def _client(ctx: typer.Context) -> LazyEngine:
    return _state(ctx).engine


def _listing(
    ctx: typer.Context,
    method: Callable[[Stubs], grpc.aio.UnaryUnaryMultiCallable[Any, Listed]],
    request: Any,
    rows: str,
    page_size: int,
    limit: int | None = None,
) -> Listed:
    """A listing read page after page (see `follow`) as one answer of its own type: the `rows` of every
    page read, and the token of the page after them ("" when none is left)."""
    client = _client(ctx)
    # The response type is known from a reply only; the rows are already in `found`, so no reply is kept.
    reply_type: type[Listed] | None = None

    def page(size: int, token: str) -> Listed:
        nonlocal reply_type
        request.page_size = size
        request.page_token = token
        reply = client.call(method, request)
        reply_type = type(reply)
        return reply

    found, page_token = follow(page, lambda reply: getattr(reply, rows), page_size, limit)
    # `follow` reads at least one page: every --limit is at least 1.
    assert reply_type is not None
    listed = reply_type(next_page_token=page_token)
    getattr(listed, rows).extend(found)
    return listed


def _emit(ctx: typer.Context, payload: Message | dict[str, Any], human: str) -> None:
    emit(_state(ctx).output, payload, human)


def _for_people(ctx: typer.Context) -> bool:
    return _state(ctx).output is OutputFormat.table


@app.command()
def deploy(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="A YAML bundle.")],
) -> None:
    """Deploy a bundle: each changed process becomes a new frozen version."""
    try:
        content = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise invalid_input(f"cannot read {file}: {error}") from None
    response = _client(ctx).call(lambda s: s.definitions.Deploy, requests.deploy(content, file.name))
    _emit(ctx, response, views.deployment(file.name, response))


@app.command()
def definitions(
    ctx: typer.Context,
    process: Annotated[str | None, typer.Option(help="Only versions of this process.")] = None,
) -> None:
    """List definition versions, newest first."""
    request = requests.list_definitions(process or "")
    listed = _listing(ctx, lambda s: s.definitions.ListDefinitions, request, "definitions", _MAX_PAGE_SIZE)
    _emit(
        ctx, listed, views.definitions_table(listed.definitions) if listed.definitions else "no definitions"
    )


@app.command()
def start(
    ctx: typer.Context,
    process: Annotated[str, typer.Argument(help="The process id.")],
    var: VarOption = None,
    vars_json: VarsJsonOption = None,
    version: Annotated[int, typer.Option(min=0, help="The definition version; 0 means the latest.")] = 0,
    business_key: Annotated[str | None, typer.Option(help="Your own reference for this instance.")] = None,
    request_id: Annotated[
        str | None,
        typer.Option(help="Start once: the same id again within a day answers the first start's instance."),
    ] = None,
    wait: Annotated[
        bool,
        typer.Option("--wait", help="Wait until the instance ends (or an incident holds it); print how."),
    ] = False,
    wait_timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout", min=0.1, help="With --wait: give up after this many seconds (exit code 3)."
        ),
    ] = None,
) -> None:
    """Start an instance of a process (with --wait, until it ends)."""
    values = variables(var or [], vars_json)
    client = _client(ctx)
    response = client.call(
        lambda s: s.processes.StartInstance,
        requests.start_instance(
            process, values, business_key=business_key or "", version=version, request_id=request_id or ""
        ),
    )
    if not wait:
        said = "already started (same --request-id)" if response.already_started else "started"
        _emit(ctx, response, said + "\n" + views.started(response.instance))
        return
    if _for_people(ctx):
        typer.echo(f"started {response.instance.id}; waiting for it to end…", err=True)
    _wait_and_report(ctx, client, response.instance.id, wait_timeout)


# Exit codes of `start --wait`: 0 completed, 1 canceled or held by an incident, 3 still running.
_STILL_RUNNING = 3


def _wait_and_report(ctx: typer.Context, client: LazyEngine, instance_id: str, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        instance = client.call(
            lambda s: s.processes.GetInstance, process_pb2.GetInstanceRequest(instance_id=instance_id)
        ).instance
        ended = instance.state != process_pb2.INSTANCE_STATE_ACTIVE
        if ended or instance.open_incidents or (deadline is not None and time.monotonic() >= deadline):
            break
        time.sleep(_POLL_SECONDS)
    incidents: list[incident_pb2.Incident] = []
    if instance.open_incidents:
        incidents = list(
            client.call(
                lambda s: s.incidents.ListIncidents,
                incident_pb2.ListIncidentsRequest(instance_id=instance_id),
            ).incidents
        )
    payload = {"instance": message_dict(instance), "incidents": [message_dict(i) for i in incidents]}
    _emit(ctx, payload, views.outcome(instance, incidents))
    if instance.state == process_pb2.INSTANCE_STATE_COMPLETED:
        return
    if instance.state == process_pb2.INSTANCE_STATE_ACTIVE and not incidents:
        if _for_people(ctx):
            typer.echo(f"gave up waiting after {timeout:g}s; the instance goes on", err=True)
        raise typer.Exit(_STILL_RUNNING)
    raise typer.Exit(FAILURE)


@app.command()
def cancel(
    ctx: typer.Context,
    instance: Annotated[str, typer.Argument(help="The instance id.")],
    reason: Annotated[str | None, typer.Option(help="Why; kept in the instance's history.")] = None,
) -> None:
    """Cancel a running instance: its open tasks are withdrawn and it ends CANCELED."""
    client = _client(ctx)
    response = client.call(
        lambda s: s.processes.CancelInstance,
        process_pb2.CancelInstanceRequest(instance_id=instance, reason=reason or ""),
    )
    _emit(ctx, response, "canceled\n" + views.started(response.instance))


@app.command()
def instances(
    ctx: typer.Context,
    process: Annotated[str | None, typer.Option(help="Only instances of this process.")] = None,
    state: Annotated[InstanceStateChoice | None, typer.Option(help="Only instances in this state.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many.")] = 100,
    business_key: Annotated[str | None, typer.Option(help="Only instances with this business key.")] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Only instances started at or after this time (RFC 3339, 2026-12-04T09:00:00Z)."),
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="Only instances started before this time (RFC 3339).")
    ] = None,
    var: Annotated[
        list[str] | None,
        typer.Option(
            "--var",
            "--where",
            metavar="NAME=VALUE",
            help="Only instances whose variable NAME equals VALUE (typed as start's --var); repeatable.",
        ),
    ] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Every instance, whatever --limit says.")] = False,
    waiting_for: Annotated[
        WaitingForChoice | None,
        typer.Option(help="Only active instances waiting on a timer, or on a message (a receive)."),
    ] = None,
    parent: Annotated[
        str | None, typer.Option(help="Only the instances this instance's call activities started.")
    ] = None,
) -> None:
    """List instances, newest first, following the engine's pages up to --limit (or --all)."""
    request = requests.list_instances(
        process or "",
        InstanceState(state.upper()) if state else None,
        business_key=business_key or "",
        created_after=rfc3339(since, "--since") if since else None,
        created_before=rfc3339(until, "--until") if until else None,
        where=variables(var or [], None),
        waiting_for=_WAITING_FOR[waiting_for] if waiting_for else process_pb2.WAITING_FOR_UNSPECIFIED,
        parent_instance_id=parent or "",
    )
    listed = _listing(
        ctx,
        lambda s: s.processes.ListInstances,
        request,
        "instances",
        _MAX_PAGE_SIZE,
        None if show_all else limit,
    )
    _emit(ctx, listed, views.instances_table(listed.instances) if listed.instances else "no instances")
    if listed.next_page_token and _for_people(ctx):
        typer.echo(f"(showing the first {limit}; raise --limit, or --all, to see more)", err=True)


@app.command()
def show(
    ctx: typer.Context,
    instance: Annotated[str, typer.Argument(help="The instance id.")],
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Then print each new history event until the instance ends."),
    ] = False,
) -> None:
    """Show one instance: state, current node, variables, its tasks and history."""
    client = _client(ctx)
    found = client.call(
        lambda s: s.processes.GetInstance, process_pb2.GetInstanceRequest(instance_id=instance)
    )
    history = client.call(
        lambda s: s.processes.GetHistory, process_pb2.GetHistoryRequest(instance_id=instance)
    )
    if not follow:
        payload = {
            "instance": message_dict(found.instance),
            "events": message_dict(history).get("events", []),
        }
        _emit(ctx, payload, views.instance_card(found.instance, history.events))
        return
    _follow(ctx, client, found.instance, list(history.events))


def _follow(
    ctx: typer.Context,
    client: LazyEngine,
    instance: process_pb2.Instance,
    events: list[process_pb2.HistoryEvent],
) -> None:
    """Streams history as it is written (JSON or YAML: one event per line or document) until the end."""
    people = _for_people(ctx)
    output = _state(ctx).output
    if people:
        typer.echo(
            f"instance {instance.id} ({instance.process_id} v{instance.version}); Ctrl-C stops following"
        )
    seen: set[int] = set()
    while True:
        for event in events:
            if event.id in seen:
                continue
            seen.add(event.id)
            if people:
                typer.echo(views.history_line(event))
            elif output is OutputFormat.json:
                typer.echo(compact_json(data_of(event)))
            else:
                emit(output, event, "")
                typer.echo("---")
        if instance.state != process_pb2.INSTANCE_STATE_ACTIVE:
            break
        time.sleep(_POLL_SECONDS)
        instance = client.call(
            lambda s: s.processes.GetInstance, process_pb2.GetInstanceRequest(instance_id=instance.id)
        ).instance
        events = list(
            client.call(
                lambda s: s.processes.GetHistory, process_pb2.GetHistoryRequest(instance_id=instance.id)
            ).events
        )
    if people:
        typer.echo(
            f"instance {instance.id} {views.instance_state(instance.state)} at {instance.current_node_id or '-'}"
        )


@app.command()
def incidents(
    ctx: typer.Context,
    instance: Annotated[str | None, typer.Option(help="Only incidents of this instance.")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Include resolved incidents.")] = False,
    incident_type: Annotated[
        str | None,
        typer.Option(
            "--reason", "--type", help="Only this type, e.g. DEPENDENCY_UNAVAILABLE or TOOL_OUTCOME_UNKNOWN."
        ),
    ] = None,
    dependency: DependencyOption = None,
) -> None:
    """List open incidents (with --all, resolved ones too)."""
    held_by = _dependency(dependency)
    found: list[incident_pb2.Incident] = []
    for state in requests.incident_states(show_all):
        request = requests.list_incidents(
            state, instance_id=instance or "", type=incident_type or "", dependency=held_by
        )
        of_state = _listing(ctx, lambda s: s.incidents.ListIncidents, request, "incidents", _MAX_LISTED)
        found += of_state.incidents
    found.sort(key=lambda i: (i.create_time.seconds, i.create_time.nanos))
    listed = incident_pb2.ListIncidentsResponse(incidents=found)
    _emit(ctx, listed, views.incidents_table(found, with_state=show_all) if found else "no incidents")


DependencyOption = Annotated[
    str | None,
    typer.Option(
        metavar="KIND:NAME",
        help="Only incidents of this dependency: model:NAME, tool_server:NAME, broker:broker or "
        "secret_store:secret-store (as `abada dependencies` names them).",
    ),
]
_DEPENDENCY_KINDS = {
    "model": dependency_pb2.DEPENDENCY_KIND_MODEL,
    "tool_server": dependency_pb2.DEPENDENCY_KIND_TOOL_SERVER,
    "broker": dependency_pb2.DEPENDENCY_KIND_BROKER,
    "secret_store": dependency_pb2.DEPENDENCY_KIND_SECRET_STORE,
}


def _dependency(text: str | None) -> dependency_pb2.Dependency | None:
    if text is None:
        return None
    kind, _, name = text.partition(":")
    if kind not in _DEPENDENCY_KINDS or not name:
        raise invalid_input(
            f"--dependency {text!r}: say KIND:NAME, KIND one of {', '.join(_DEPENDENCY_KINDS)} (model:gemini-3.6-flash)"
        )
    return dependency_pb2.Dependency(kind=_DEPENDENCY_KINDS[kind], name=name)


@app.command()
def dependencies(ctx: typer.Context) -> None:
    """The dependencies agent tasks need (models, tool servers, the broker, its secret store), as workers
    report them: up, down or probing, since when, the tasks held for each and the next probe."""
    response = dependency_pb2.ListDependenciesResponse(
        dependencies=_client(ctx).run(lambda client: client.dependencies())
    )
    _emit(
        ctx,
        response,
        views.dependencies_table(response.dependencies)
        if response.dependencies
        else "no dependency reported yet: every one answers",
    )


@app.command()
def resolve(
    ctx: typer.Context,
    incident: Annotated[
        str | None, typer.Argument(help="The incident id (or --all with --reason for many at once).")
    ] = None,
    retry: Annotated[bool, typer.Option("--retry", help="Offer the task again with fresh retries.")] = False,
    happened: Annotated[
        bool, typer.Option("--happened", help="The tool call happened; give its --result.")
    ] = False,
    result: Annotated[
        str | None, typer.Option(metavar="JSON", help="With --happened: what the tool returned.")
    ] = None,
    did_not_happen: Annotated[
        bool, typer.Option("--did-not-happen", help="The tool call did not happen; it may be tried again.")
    ] = False,
    cancel: Annotated[bool, typer.Option("--cancel", help="Cancel the instance.")] = False,
    comment: Annotated[str | None, typer.Option(help="Why; kept in the instance's history.")] = None,
    every: Annotated[
        bool,
        typer.Option("--all", help="Every open incident of --reason (and --dependency, --process) at once."),
    ] = False,
    reason: Annotated[
        str | None, typer.Option(help="With --all: the incidents' type, e.g. DEPENDENCY_UNAVAILABLE.")
    ] = None,
    dependency: DependencyOption = None,
    process: Annotated[str | None, typer.Option(help="With --all: only incidents of this process.")] = None,
) -> None:
    """Decide an incident: --retry, --happened --result JSON, --did-not-happen or --cancel.

    After an outage: `abada resolve --all --reason DEPENDENCY_UNAVAILABLE --dependency model:NAME --retry`
    offers every task that waited too long again (and probes the dependency at once)."""
    if every or reason is not None or dependency is not None or process is not None:
        if happened or did_not_happen or result is not None:
            raise invalid_input(
                "--all resolves with --retry or --cancel only: the others need one decision each"
            )
        _resolve_many(ctx, incident, every, reason, _dependency(dependency), process, retry, cancel, comment)
        return
    if incident is None:
        raise invalid_input("name the incident to resolve, or use --all --reason TYPE")
    chosen = [
        resolution
        for flag, resolution in (
            (retry, Resolution.RETRY),
            (happened, Resolution.HAPPENED),
            (did_not_happen, Resolution.DID_NOT_HAPPEN),
            (cancel, Resolution.CANCEL_INSTANCE),
        )
        if flag
    ]
    if len(chosen) != 1:
        raise invalid_input("choose exactly one of --retry, --happened, --did-not-happen, --cancel")
    returned = None
    if happened:
        if result is None:
            raise invalid_input("--happened needs --result JSON: what the tool returned")
        returned = json_object(result, "--result")
    elif result is not None:
        raise invalid_input("--result only goes with --happened")
    request = requests.resolve_incident(incident, chosen[0], result=returned, comment=comment or "")
    response = _client(ctx).call(lambda s: s.incidents.ResolveIncident, request)
    _emit(ctx, response, "resolved\n" + views.resolved(response.incident))


def _resolve_many(
    ctx: typer.Context,
    incident: str | None,
    every: bool,
    reason: str | None,
    dependency: dependency_pb2.Dependency | None,
    process: str | None,
    retry: bool,
    cancel: bool,
    comment: str | None,
) -> None:
    if incident is not None or not every or not reason:
        raise invalid_input("resolve many with --all --reason TYPE (and no incident id)")
    if retry == cancel:
        raise invalid_input("--all resolves with exactly one of --retry or --cancel")
    total = _client(ctx).run(
        lambda client: client.resolve_incidents(
            reason,
            Resolution.RETRY if retry else Resolution.CANCEL_INSTANCE,
            dependency=dependency,
            process_id=process or "",
            comment=comment or "",
        )
    )
    _emit(ctx, total, views.bulk_resolved(total))
    if total.refused:
        raise typer.Exit(FAILURE)


@app.command("user-tasks")
def user_tasks(
    ctx: typer.Context,
    instance: Annotated[str | None, typer.Option(help="Only user tasks of this instance.")] = None,
) -> None:
    """List the user tasks waiting for a person."""
    request = requests.list_user_tasks(instance or "")
    listed = _listing(ctx, lambda s: s.processes.ListUserTasks, request, "user_tasks", _MAX_LISTED)
    _emit(ctx, listed, views.user_tasks_table(listed.user_tasks) if listed.user_tasks else "no user tasks")


@app.command("complete-user-task")
def complete_user_task(
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="The user task id.")],
    var: VarOption = None,
    vars_json: VarsJsonOption = None,
) -> None:
    """Complete a waiting user task, optionally writing variables."""
    values = variables(var or [], vars_json)
    response = _client(ctx).call(
        lambda s: s.processes.CompleteUserTask, requests.complete_user_task(task, values)
    )
    _emit(ctx, response, views.user_task_completed(task, response.instance))


@app.command()
def journal(
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="The external task id.")],
) -> None:
    """Show a task's step journal across all attempts (--json for the full payloads)."""
    client = _client(ctx)
    response = client.call(lambda s: s.tasks.GetJournal, external_task_pb2.GetJournalRequest(task_id=task))
    steps = sorted(response.steps, key=lambda s: s.sequence)
    _emit(ctx, response, views.journal_table(steps) if steps else f"no journal steps for task {task}")


@app.command()
def tasks(
    ctx: typer.Context,
    topic: Annotated[str | None, typer.Option(help="Only tasks of this topic.")] = None,
    instance: Annotated[str | None, typer.Option(help="Only tasks of this instance.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many.")] = 100,
    show_all: Annotated[bool, typer.Option("--all", help="Every open task, whatever --limit says.")] = False,
) -> None:
    """List open external tasks, oldest first: state, attempt, the worker holding it, age."""
    request = requests.list_open_tasks(topic or "", instance or "")
    listed = _listing(
        ctx, lambda s: s.queue.ListTasks, request, "tasks", _MAX_LISTED, None if show_all else limit
    )
    _emit(ctx, listed, views.queued_tasks_table(listed.tasks) if listed.tasks else "no open tasks")


@app.command()
def topics(ctx: typer.Context) -> None:
    """Queue figures per topic (what autoscalers read): ready, leased, delayed, demand, oldest wait;
    and per model profile: calls admitted in the current window, waiting for quota, refused."""
    response = _client(ctx).run(lambda client: client.topics())
    text = views.topics_table(response.topics) if response.topics else "no open tasks on any topic"
    if response.models:
        text += "\n\n" + views.models_table(response.models)
    _emit(ctx, response, text)


class ApprovalStateChoice(enum.StrEnum):
    pending = "pending"
    approved = "approved"
    rejected = "rejected"
    expired = "expired"
    canceled = "canceled"


@app.command()
def approvals(
    ctx: typer.Context,
    process: Annotated[str | None, typer.Option(help="Only calls of instances of this process.")] = None,
    business_key: Annotated[
        str | None, typer.Option(help="Only calls of instances with this business key.")
    ] = None,
    tool: Annotated[str | None, typer.Option(metavar="SERVER/TOOL", help="Only calls of this tool.")] = None,
    state: Annotated[
        ApprovalStateChoice, typer.Option(help="Calls in this state (pending: waiting for a decision).")
    ] = ApprovalStateChoice.pending,
) -> None:
    """List tool calls waiting for a person's approval (or, with --state, decided ones)."""
    request = requests.list_approvals(
        process_id=process or "",
        business_key=business_key or "",
        tool_ref=tool or "",
        state=ApprovalState(state.value.upper()),
    )
    listed = _listing(ctx, lambda s: s.approvals.ListApprovals, request, "approvals", _MAX_LISTED)
    _emit(
        ctx,
        listed,
        views.approvals_list(listed.approvals) if listed.approvals else f"no {state.value} approvals",
    )


@app.command()
def approve(
    ctx: typer.Context,
    approval: Annotated[str, typer.Argument(help="The approval id.")],
    args: Annotated[
        str | None,
        typer.Option(
            "--args", metavar="JSON", help="Run the call with these arguments instead of the proposed ones."
        ),
    ] = None,
    comment: Annotated[str | None, typer.Option(help="Why; kept in the instance's history.")] = None,
) -> None:
    """Approve a tool call: it runs (with --args, as edited) when the task is offered again."""
    edited = json_object(args, "--args") if args is not None else None
    request = requests.approve(approval, arguments=edited, comment=comment or "")
    response = _client(ctx).call(lambda s: s.approvals.DecideApproval, request)
    _emit(ctx, response, "approved\n" + views.approval_card(response.approval))


@app.command()
def reject(
    ctx: typer.Context,
    approval: Annotated[str, typer.Argument(help="The approval id.")],
    reason: Annotated[str, typer.Option(help="Why; the model reads it as the call's error.")],
) -> None:
    """Reject a tool call: it never runs; the model reads "rejected by a person: REASON" and goes on."""
    if not reason.strip():
        raise invalid_input("--reason must say why: the model reads it")
    response = _client(ctx).call(lambda s: s.approvals.DecideApproval, requests.reject(approval, reason))
    _emit(ctx, response, "rejected\n" + views.approval_card(response.approval))


@app.command()
def publish(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The message's name, as a receive node's `message:` names it.")],
    correlation_key: Annotated[
        str, typer.Option(help="The key a waiting receive's correlation_key must equal.")
    ],
    var: VarOption = None,
    vars_json: VarsJsonOption = None,
    ttl: Annotated[
        str,
        typer.Option(help="How long it waits for a receive when none waits now (ISO-8601, e.g. PT1H)."),
    ] = "PT0S",
    message_id: Annotated[
        str | None,
        typer.Option(help="Publish once: the same id again within the ttl answers the first publication."),
    ] = None,
) -> None:
    """Publish a message to the oldest instance waiting for it, or buffer it for --ttl."""
    _publish(ctx, name, correlation_key, variables(var or [], vars_json), ttl, message_id)


def _publish(
    ctx: typer.Context,
    name: str,
    correlation_key: str,
    values: dict[str, Any],
    ttl: str,
    message_id: str | None,
) -> None:
    seconds = 0.0 if ttl in ("PT0S", "0") else iso_duration_seconds(ttl)
    if seconds is None:
        raise invalid_input(f"--ttl {ttl!r}: not an ISO-8601 duration (for example PT1H, P2D)")
    request = requests.publish_message(
        name, correlation_key, values, ttl=datetime.timedelta(seconds=seconds), message_id=message_id or ""
    )
    response = _client(ctx).call(lambda s: s.processes.PublishMessage, request)
    _emit(ctx, response, views.publication(response))


def _confirmed(yes: bool, what: str) -> None:
    """Deleting needs --yes, or a person at a terminal who answers yes."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise invalid_input(f"{what}: add --yes to go ahead (or --dry-run, where offered, to count first)")
    if not typer.confirm(f"{what}: this cannot be undone. Go ahead?"):
        raise typer.Exit(FAILURE)


@app.command()
def purge(
    ctx: typer.Context,
    before: Annotated[
        str, typer.Option(help="Delete finished instances that ended before this time (RFC 3339).")
    ],
    process: Annotated[str | None, typer.Option(help="Only instances of this process.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count what would go; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Delete without asking.")] = False,
) -> None:
    """Delete, now, finished instances that ended before --before, with their history and journals."""
    request = requests.purge_instances(rfc3339(before, "--before"), process or "", dry_run=dry_run)
    if not dry_run:
        _confirmed(yes, f"purge finished instances ended before {before}")
    client = _client(ctx)
    response = client.call(lambda s: s.processes.PurgeInstances, request)
    _emit(ctx, response, views.purged(response, before))


@app.command()
def erase(
    ctx: typer.Context,
    business_key: Annotated[str | None, typer.Option(help="The customer's business key.")] = None,
    var: Annotated[
        list[str] | None,
        typer.Option(
            "--var", metavar="NAME=VALUE", help="Or instances whose variable NAME equals VALUE; repeatable."
        ),
    ] = None,
    cancel_active: Annotated[
        bool, typer.Option("--cancel-active", help="Cancel the customer's active instances first.")
    ] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Erase without asking.")] = False,
) -> None:
    """Erase one customer's instances, journals and history, whatever their age (one audit row stays,
    naming no one). Active instances refuse the erasure unless --cancel-active."""
    request = requests.erase_instances(
        business_key or "", variables(var or [], None), cancel_active=cancel_active
    )
    if not request.business_key and not request.variables:
        raise invalid_input("name the customer: --business-key K or --var NAME=VALUE")
    _confirmed(yes, "erase this customer's instances")
    client = _client(ctx)
    response = client.call(lambda s: s.processes.EraseInstances, request)
    _emit(ctx, response, views.erased(response))


# The repairs of one instance (`modify`, `migrate`) and of a batch of them take the same options.
_SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="NAME=VALUE", help="Set a variable (JSON value or text); repeatable."),
]
_UnsetOption = Annotated[
    list[str] | None, typer.Option("--unset", metavar="NAME", help="Remove a variable; repeatable.")
]
_MoveOption = Annotated[
    list[str] | None,
    typer.Option(
        "--move",
        metavar="FROM_NODE=TO_NODE",
        help="Move the token at FROM_NODE to TO_NODE (its task is withdrawn); repeatable.",
    ),
]
_MapOption = Annotated[
    list[str] | None,
    typer.Option("--map", metavar="OLD_NODE=NEW_NODE", help="A node renamed in the new version; repeatable."),
]


def _pairs(values: list[str] | None, option: str) -> list[tuple[str, str]]:
    """`FROM=TO` options as pairs, in order."""
    pairs = []
    for value in values or []:
        left, separator, right = value.partition("=")
        if not separator or not left or not right:
            raise invalid_input(f"{option} {value!r}: expected FROM_NODE=TO_NODE")
        pairs.append((left, right))
    return pairs


@app.command()
def modify(
    ctx: typer.Context,
    instance: Annotated[str, typer.Argument(help="The instance id.")],
    reason: Annotated[str, typer.Option(help="Why; kept in the history with each change.")],
    set_: _SetOption = None,
    unset: _UnsetOption = None,
    move: _MoveOption = None,
) -> None:
    """Repair a running instance: set or remove variables, move a token; each change is recorded in the
    history with your identity and the reason."""
    request = requests.modify_instance(
        instance, reason, variables(set_ or [], None, "--set"), unset or [], _pairs(move, "--move")
    )
    client = _client(ctx)
    response = client.call(lambda s: s.processes.ModifyInstance, request)
    _emit(ctx, response, "modified\n" + views.started(response.instance))


@app.command()
def migrate(
    ctx: typer.Context,
    from_: Annotated[
        str, typer.Option("--from", metavar="PROCESS:VERSION", help="The process and version to leave.")
    ],
    to: Annotated[int, typer.Option("--to", help="The version to move to.")],
    map_: _MapOption = None,
    instance: Annotated[
        list[str] | None, typer.Option("--instance", help="Only this instance; repeatable.")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the plan; move nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", help="Migrate without asking.")] = False,
) -> None:
    """Move running instances to another version of their process, under a plan checked first: every
    node holding a token must map to a node of the same type (by id unless --map renames it)."""
    process_id, separator, version = from_.rpartition(":")
    if not separator or not process_id or not version.isdigit():
        raise invalid_input(f"--from {from_!r}: expected PROCESS:VERSION, like support_triage:3")
    request = requests.migrate_instances(
        process_id, int(version), to, dict(_pairs(map_, "--map")), instance or [], dry_run=dry_run
    )
    if not dry_run:
        _confirmed(yes, f"migrate the running instances of {from_} to version {to}")
    client = _client(ctx)
    response = client.call(lambda s: s.processes.MigrateInstances, request)
    _emit(ctx, response, views.migrated(response, from_, to))


class _BatchGroup(TyperGroup):
    """`abada batch ...`: each command's help ends with its own example."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        command = super().get_command(ctx, cmd_name)
        if command is not None and not command.epilog:
            command.epilog = epilog(cmd_name, BATCH_EXAMPLES)
        return command


batch_app = typer.Typer(
    name="batch",
    cls=_BatchGroup,
    help=(
        "Retry incidents, cancel, migrate or modify instances over a filter, as one batch worked through "
        "in the background."
    ),
    no_args_is_help=True,
    context_settings={"help_option_names": list(HELP_OPTIONS)},
)
app.add_typer(batch_app, name="batch")


@app.command()
def batches(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=100, help="Show at most this many.")] = 100,
) -> None:
    """Batches, newest first, with their progress."""
    response = _client(ctx).call(
        lambda s: s.batches.ListBatches, batch_pb2.ListBatchesRequest(page_size=limit)
    )
    _emit(ctx, response, views.batches_table(response.batches) if response.batches else "no batches")


_ProcessOption = Annotated[str | None, typer.Option("--process", help="The instances' process (required).")]
_VersionOption = Annotated[int, typer.Option(min=0, help="Only instances of this version (0: every one).")]
_NodeOption = Annotated[
    str | None, typer.Option("--node", help="Only instances whose token rests at this node.")
]
_BusinessKeyOption = Annotated[str | None, typer.Option(help="Only instances with this business key.")]
_IncidentTypeOption = Annotated[
    str | None, typer.Option("--type", help="Only instances with an open incident of this type.")
]
_BatchReasonOption = Annotated[
    str | None, typer.Option(help="Why; kept in each instance's history (required).")
]
_BatchArgument = Annotated[str, typer.Argument(metavar="BATCH", help="The batch id.")]


def _instance_filter(
    version: int,
    node: str | None,
    business_key: str | None,
    incident_type: str | None,
    *,
    state: str = "",
    incident_message: str = "",
) -> requests.BatchFilter:
    """The filter options of the batch commands as the request's filter (an option not given: "")."""
    return requests.BatchFilter(
        version=version,
        state=state,
        node_id=node or "",
        business_key=business_key or "",
        incident_type=incident_type or "",
        incident_message=incident_message,
    )


def _created(ctx: typer.Context, request: batch_pb2.CreateBatchRequest) -> None:
    response = _client(ctx).call(lambda s: s.batches.CreateBatch, request)
    batch = response.batch
    _emit(
        ctx,
        response,
        f"batch {batch.id}: {batch.total} instance(s) matched; `abada batch show {batch.id}` follows it",
    )


@batch_app.command("retry-incidents")
def batch_retry_incidents(
    ctx: typer.Context,
    process: _ProcessOption = None,
    incident_type: Annotated[
        str | None,
        typer.Option("--type", help="Only incidents of this type (INVALID_OUTPUT, FAILED_TASK, ...)."),
    ] = None,
    message: Annotated[
        str | None, typer.Option(help="Only incidents whose message contains this text.")
    ] = None,
    version: _VersionOption = 0,
    node: _NodeOption = None,
    business_key: _BusinessKeyOption = None,
) -> None:
    """Retry the open incidents of every active instance of --process that has one matching."""
    if not process:
        raise invalid_input("--process is required")
    _created(
        ctx,
        requests.create_batch(
            "retry-incidents",
            process,
            **_instance_filter(version, node, business_key, incident_type, incident_message=message or ""),
        ),
    )


@batch_app.command("cancel")
def batch_cancel(
    ctx: typer.Context,
    batch: Annotated[
        str | None, typer.Argument(metavar="[BATCH]", help="Cancel this batch (its pending instances stay).")
    ] = None,
    process: _ProcessOption = None,
    state: Annotated[
        InstanceStateChoice | None, typer.Option(help="Only instances in this state (default: active).")
    ] = None,
    version: _VersionOption = 0,
    node: _NodeOption = None,
    business_key: _BusinessKeyOption = None,
    incident_type: _IncidentTypeOption = None,
    reason: _BatchReasonOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Cancel without asking.")] = False,
) -> None:
    """Cancel every instance of --process matching the filter, as a batch; or, given BATCH, cancel that
    batch (the instances it has not reached are left as they are)."""
    if batch is not None:
        if process:
            raise invalid_input("give either BATCH (to cancel a batch) or --process (to cancel instances)")
        response = _client(ctx).call(
            lambda s: s.batches.CancelBatch, batch_pb2.CancelBatchRequest(batch_id=batch)
        )
        _emit(ctx, response, views.batch_line(response.batch, "canceled"))
        return
    if not process:
        raise invalid_input("--process is required (or BATCH, to cancel a batch)")
    if not reason:
        raise invalid_input("--reason is required: it is kept in each instance's history")
    _confirmed(yes, f"cancel the matching instances of {process}")
    _created(
        ctx,
        requests.create_batch(
            "cancel",
            process,
            reason=reason,
            **_instance_filter(
                version,
                node,
                business_key,
                incident_type,
                state=state.value.upper() if state is not None else "",
            ),
        ),
    )


@batch_app.command("migrate")
def batch_migrate(
    ctx: typer.Context,
    process: _ProcessOption = None,
    version: Annotated[int, typer.Option(min=0, help="The version the instances leave (required).")] = 0,
    to: Annotated[int, typer.Option("--to", min=0, help="The version they move to (required).")] = 0,
    map_: _MapOption = None,
    node: _NodeOption = None,
    business_key: _BusinessKeyOption = None,
    incident_type: _IncidentTypeOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Migrate without asking.")] = False,
) -> None:
    """Move every active instance of --process --version matching the filter to version --to, as a
    batch: each is checked where it stands, and one holding a token at a node the new version lacks is
    refused (outcome failed, naming the node) while the others move."""
    if not process or not version or not to:
        raise invalid_input("--process, --version and --to are required")
    _confirmed(yes, f"migrate the matching instances of {process}:{version} to version {to}")
    _created(
        ctx,
        requests.create_batch(
            "migrate",
            process,
            to_version=to,
            mappings=dict(_pairs(map_, "--map")),
            **_instance_filter(version, node, business_key, incident_type),
        ),
    )


@batch_app.command("modify")
def batch_modify(
    ctx: typer.Context,
    process: _ProcessOption = None,
    version: _VersionOption = 0,
    node: _NodeOption = None,
    business_key: _BusinessKeyOption = None,
    incident_type: _IncidentTypeOption = None,
    set_: _SetOption = None,
    unset: _UnsetOption = None,
    move: _MoveOption = None,
    reason: _BatchReasonOption = None,
    yes: Annotated[bool, typer.Option("--yes", help="Modify without asking.")] = False,
) -> None:
    """Set or remove variables and move tokens of every active instance of --process matching the
    filter, as a batch; each instance takes all its changes or none, recorded with your identity and
    the reason."""
    if not process:
        raise invalid_input("--process is required")
    if not reason:
        raise invalid_input("--reason is required: it is kept in each instance's history")
    if not (set_ or unset or move):
        raise invalid_input("nothing to change: give --set, --unset or --move")
    _confirmed(yes, f"modify the matching instances of {process}")
    _created(
        ctx,
        requests.create_batch(
            "modify",
            process,
            reason=reason,
            **_instance_filter(version, node, business_key, incident_type),
            set_variables=variables(set_ or [], None, "--set"),
            unset_variables=unset or [],
            moves=_pairs(move, "--move"),
        ),
    )


@batch_app.command("show")
def batch_show(
    ctx: typer.Context,
    batch: _BatchArgument,
    outcome: Annotated[
        BatchOutcomeChoice | None, typer.Option(help="Only instances with this outcome.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1, max=1000, help="Show at most this many instances.")] = 1000,
) -> None:
    """A batch's progress and the outcome of each instance worked on so far."""
    request = requests.get_batch(batch, outcome=outcome.value if outcome else "", page_size=limit)
    response = _client(ctx).call(lambda s: s.batches.GetBatch, request)
    _emit(ctx, response, views.batch_card(response))


@batch_app.command("pause")
def batch_pause(ctx: typer.Context, batch: _BatchArgument) -> None:
    """Stop working on a batch (instances being worked on finish); `abada batch resume` goes on."""
    response = _client(ctx).call(lambda s: s.batches.PauseBatch, batch_pb2.PauseBatchRequest(batch_id=batch))
    _emit(ctx, response, views.batch_line(response.batch, "paused"))


@batch_app.command("resume")
def batch_resume(ctx: typer.Context, batch: _BatchArgument) -> None:
    """Go on with a paused batch."""
    response = _client(ctx).call(
        lambda s: s.batches.ResumeBatch, batch_pb2.ResumeBatchRequest(batch_id=batch)
    )
    _emit(ctx, response, views.batch_line(response.batch, "resumed"))


def main() -> None:
    app(prog_name="abada")


if __name__ == "__main__":
    main()
