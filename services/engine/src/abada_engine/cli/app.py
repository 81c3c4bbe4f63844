"""The `abada` commands: each one request (or a few) to the engine, printed for people or as JSON."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

import typer
from abada.engine.v1 import definition_pb2, external_task_pb2, incident_pb2, process_pb2
from google.protobuf.message import Message
from typer.core import TyperGroup

from . import views
from .client import (
    DEFAULT_ADDRESS,
    DEFAULT_TIMEOUT_SECONDS,
    ConnectionSettings,
    EngineClient,
    LazyEngine,
    read_token_file,
)
from .errors import CliError, invalid_input
from .inputs import json_object, to_struct, variables
from .render import message_dict, to_json

# The engine caps a page at 500; asking for full pages keeps long listings to a few round trips.
_MAX_PAGE_SIZE = 500


class _ReportingGroup(TyperGroup):
    """Every command's CliError becomes `error: ...` on stderr and its exit code, never a traceback."""

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except CliError as error:
            for line in error.lines():
                typer.echo(line, err=True)
            raise typer.Exit(error.exit_code) from None


app = typer.Typer(
    name="abada",
    cls=_ReportingGroup,
    help="Operate an Abada engine: deploy definitions, start and inspect instances, decide incidents.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the engine's answer as JSON, for scripts.")]
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


_INSTANCE_STATES = {
    InstanceStateChoice.active: process_pb2.INSTANCE_STATE_ACTIVE,
    InstanceStateChoice.completed: process_pb2.INSTANCE_STATE_COMPLETED,
    InstanceStateChoice.canceled: process_pb2.INSTANCE_STATE_CANCELED,
}


def _choose_token(ctx: typer.Context, token: str | None, token_file: Path | None) -> str | None:
    if token and token_file:
        # A flag on the command line beats a variable left in the environment; two flags are a mistake.
        # Compared by name: newer typer vendors click, so its ParameterSource is not click's.
        from_command_line = {
            name
            for name in ("token", "token_file")
            if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"
        }
        if from_command_line == {"token_file"}:
            token = None
        elif from_command_line != {"token"}:
            raise invalid_input("give a token or a token file, not both")
    if token:
        return token.strip()
    return read_token_file(token_file) if token_file else None


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
) -> None:
    chosen_token = _choose_token(ctx, token, token_file)
    lazy = LazyEngine(ConnectionSettings(engine, timeout, chosen_token, tls_ca, tls_cert, tls_key))
    ctx.obj = lazy
    ctx.call_on_close(lazy.close)


def _client(ctx: typer.Context) -> EngineClient:
    lazy: LazyEngine = ctx.find_root().obj
    return lazy.client


def _emit(as_json: bool, payload: Message | dict[str, Any], human: str) -> None:
    if as_json:
        typer.echo(to_json(message_dict(payload) if isinstance(payload, Message) else payload))
    else:
        typer.echo(human)


@app.command()
def deploy(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="A YAML bundle.")],
    as_json: JsonFlag = False,
) -> None:
    """Deploy a bundle: each changed process becomes a new frozen version."""
    try:
        content = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise invalid_input(f"cannot read {file}: {error}") from None
    client = _client(ctx)
    response = client.call(
        client.definitions.Deploy, definition_pb2.DeployRequest(source_name=file.name, content=content)
    )
    _emit(as_json, response, views.deployment(file.name, response))


@app.command()
def definitions(
    ctx: typer.Context,
    process: Annotated[str | None, typer.Option(help="Only versions of this process.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """List definition versions, newest first."""
    client = _client(ctx)
    found: list[definition_pb2.Definition] = []
    page_token = ""
    while True:
        response = client.call(
            client.definitions.ListDefinitions,
            definition_pb2.ListDefinitionsRequest(
                process_id=process or "", page_size=_MAX_PAGE_SIZE, page_token=page_token
            ),
        )
        found.extend(response.definitions)
        page_token = response.next_page_token
        if not page_token:
            break
    listed = definition_pb2.ListDefinitionsResponse(definitions=found)
    _emit(as_json, listed, views.definitions_table(found) if found else "no definitions")


@app.command()
def start(
    ctx: typer.Context,
    process: Annotated[str, typer.Argument(help="The process id.")],
    var: VarOption = None,
    vars_json: VarsJsonOption = None,
    version: Annotated[int, typer.Option(min=0, help="The definition version; 0 means the latest.")] = 0,
    business_key: Annotated[str | None, typer.Option(help="Your own reference for this instance.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Start an instance of a process."""
    values = variables(var or [], vars_json)
    client = _client(ctx)
    response = client.call(
        client.processes.StartInstance,
        process_pb2.StartInstanceRequest(
            process_id=process, version=version, variables=to_struct(values), business_key=business_key or ""
        ),
    )
    _emit(as_json, response, "started\n" + views.started(response.instance))


@app.command()
def instances(
    ctx: typer.Context,
    process: Annotated[str | None, typer.Option(help="Only instances of this process.")] = None,
    state: Annotated[InstanceStateChoice | None, typer.Option(help="Only instances in this state.")] = None,
    limit: Annotated[int, typer.Option(min=1, help="Show at most this many.")] = 100,
    as_json: JsonFlag = False,
) -> None:
    """List instances, following the engine's pages up to --limit."""
    client = _client(ctx)
    found: list[process_pb2.Instance] = []
    page_token = ""
    while len(found) < limit:
        response = client.call(
            client.processes.ListInstances,
            process_pb2.ListInstancesRequest(
                process_id=process or "",
                state=_INSTANCE_STATES[state] if state else process_pb2.INSTANCE_STATE_UNSPECIFIED,
                page_size=min(limit - len(found), _MAX_PAGE_SIZE),
                page_token=page_token,
            ),
        )
        found.extend(response.instances)
        page_token = response.next_page_token
        if not page_token:
            break
    listed = process_pb2.ListInstancesResponse(instances=found[:limit], next_page_token=page_token)
    _emit(as_json, listed, views.instances_table(found[:limit]) if found else "no instances")
    if page_token and not as_json:
        typer.echo(f"(showing the first {limit}; raise --limit to see more)", err=True)


@app.command()
def show(
    ctx: typer.Context,
    instance: Annotated[str, typer.Argument(help="The instance id.")],
    as_json: JsonFlag = False,
) -> None:
    """Show one instance: state, current node, variables and history."""
    client = _client(ctx)
    found = client.call(client.processes.GetInstance, process_pb2.GetInstanceRequest(instance_id=instance))
    history = client.call(client.processes.GetHistory, process_pb2.GetHistoryRequest(instance_id=instance))
    payload = {"instance": message_dict(found.instance), "events": message_dict(history).get("events", [])}
    _emit(as_json, payload, views.instance_card(found.instance, history.events))


@app.command()
def incidents(
    ctx: typer.Context,
    instance: Annotated[str | None, typer.Option(help="Only incidents of this instance.")] = None,
    show_all: Annotated[bool, typer.Option("--all", help="Include resolved incidents.")] = False,
    incident_type: Annotated[
        str | None, typer.Option("--type", help="Only this type, e.g. TOOL_OUTCOME_UNKNOWN.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """List open incidents (with --all, resolved ones too)."""
    client = _client(ctx)
    states = (
        (incident_pb2.INCIDENT_STATE_OPEN, incident_pb2.INCIDENT_STATE_RESOLVED)
        if show_all
        else (incident_pb2.INCIDENT_STATE_OPEN,)
    )
    found: list[incident_pb2.Incident] = []
    for state in states:
        response = client.call(
            client.incidents.ListIncidents,
            incident_pb2.ListIncidentsRequest(
                instance_id=instance or "", state=state, type=incident_type or ""
            ),
        )
        found.extend(response.incidents)
    found.sort(key=lambda i: (i.create_time.seconds, i.create_time.nanos))
    listed = incident_pb2.ListIncidentsResponse(incidents=found)
    _emit(as_json, listed, views.incidents_table(found, with_state=show_all) if found else "no incidents")


@app.command()
def resolve(
    ctx: typer.Context,
    incident: Annotated[str, typer.Argument(help="The incident id.")],
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
    as_json: JsonFlag = False,
) -> None:
    """Decide an incident: --retry, --happened --result JSON, --did-not-happen or --cancel."""
    chosen = [
        resolution
        for flag, resolution in (
            (retry, incident_pb2.RESOLUTION_RETRY),
            (happened, incident_pb2.RESOLUTION_HAPPENED),
            (did_not_happen, incident_pb2.RESOLUTION_DID_NOT_HAPPEN),
            (cancel, incident_pb2.RESOLUTION_CANCEL_INSTANCE),
        )
        if flag
    ]
    if len(chosen) != 1:
        raise invalid_input("choose exactly one of --retry, --happened, --did-not-happen, --cancel")
    request = incident_pb2.ResolveIncidentRequest(
        incident_id=incident, resolution=chosen[0], comment=comment or ""
    )
    if happened:
        if result is None:
            raise invalid_input("--happened needs --result JSON: what the tool returned")
        request.result.CopyFrom(to_struct(json_object(result, "--result")))
    elif result is not None:
        raise invalid_input("--result only goes with --happened")
    client = _client(ctx)
    response = client.call(client.incidents.ResolveIncident, request)
    _emit(as_json, response, "resolved\n" + views.resolved(response.incident))


@app.command("user-tasks")
def user_tasks(
    ctx: typer.Context,
    instance: Annotated[str | None, typer.Option(help="Only user tasks of this instance.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """List the user tasks waiting for a person."""
    client = _client(ctx)
    response = client.call(
        client.processes.ListUserTasks, process_pb2.ListUserTasksRequest(instance_id=instance or "")
    )
    _emit(
        as_json,
        response,
        views.user_tasks_table(response.user_tasks) if response.user_tasks else "no user tasks",
    )


@app.command("complete-user-task")
def complete_user_task(
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="The user task id.")],
    var: VarOption = None,
    vars_json: VarsJsonOption = None,
    as_json: JsonFlag = False,
) -> None:
    """Complete a waiting user task, optionally writing variables."""
    values = variables(var or [], vars_json)
    client = _client(ctx)
    response = client.call(
        client.processes.CompleteUserTask,
        process_pb2.CompleteUserTaskRequest(user_task_id=task, variables=to_struct(values)),
    )
    _emit(as_json, response, views.user_task_completed(task, response.instance))


@app.command()
def journal(
    ctx: typer.Context,
    task: Annotated[str, typer.Argument(help="The external task id.")],
    as_json: JsonFlag = False,
) -> None:
    """Show a task's step journal across all attempts (--json for the full payloads)."""
    client = _client(ctx)
    response = client.call(client.tasks.GetJournal, external_task_pb2.GetJournalRequest(task_id=task))
    steps = sorted(response.steps, key=lambda s: s.sequence)
    _emit(as_json, response, views.journal_table(steps) if steps else f"no journal steps for task {task}")


def main() -> None:
    app(prog_name="abada")


if __name__ == "__main__":
    main()
