"""The console's pages: Starlette routes that read and act through the engine's public API as the
signed-in person, and render Jinja2 templates (plain HTML, a little JavaScript, no CDN)."""

from __future__ import annotations

import asyncio
import json
import logging
import pathlib
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from abada.engine.v1 import (
    approval_pb2,
    definition_pb2,
    dependency_pb2,
    external_task_pb2,
    incident_pb2,
    process_pb2,
    queue_pb2,
)
from abada_common.addresses import is_loopback_host
from abada_common.struct_codec import from_struct, to_struct
from abada_sdk.errors import AbadaError, NotFound, PermissionDenied, Unauthenticated
from google.protobuf import json_format, timestamp_pb2
from jinja2 import Environment, FileSystemLoader, select_autoescape
from starlette.applications import Starlette
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from . import forms
from .engine import Engine
from .session import COOKIE, SESSION_SECONDS, SIGN_IN_COOKIE, Sealer, Session

log = logging.getLogger(__name__)
HERE = pathlib.Path(__file__).parent
PAGE_SIZE = 50
# Approvals and incidents are worked through on one page, so theirs are longer than the instances'.
_LIST_PAGE_SIZE = 200
Handler = Callable[[Request], Awaitable[Response]]
STATES = {
    "": process_pb2.INSTANCE_STATE_UNSPECIFIED,
    "active": process_pb2.INSTANCE_STATE_ACTIVE,
    "completed": process_pb2.INSTANCE_STATE_COMPLETED,
    "canceled": process_pb2.INSTANCE_STATE_CANCELED,
}
# Every incident type may be retried or its instance cancelled; the journal adds the two answers to
# "did that write happen?" for TOOL_OUTCOME_UNKNOWN (the engine refuses any other pairing).
RESOLUTIONS = {
    "RETRY": ("Retry", "offer the task again with fresh retries"),
    "HAPPENED": ("It happened", "the call took effect: record its result and go on"),
    "DID_NOT_HAPPEN": ("It did not happen", "the call did not take effect: it may be made again"),
    "CANCEL_INSTANCE": ("Cancel the instance", "stop this instance for good"),
}
OUTCOME_UNKNOWN = "TOOL_OUTCOME_UNKNOWN"


def resolutions_for(incident_type: str) -> list[str]:
    if incident_type == OUTCOME_UNKNOWN:
        return ["HAPPENED", "DID_NOT_HAPPEN", "RETRY", "CANCEL_INSTANCE"]
    return ["RETRY", "CANCEL_INSTANCE"]


def moment(stamp: timestamp_pb2.Timestamp) -> str:
    if not stamp.seconds and not stamp.nanos:
        return ""
    return stamp.ToDatetime(tzinfo=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def enum_name(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix).replace("_", " ").lower()


def pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)


def parse_variable(text: str) -> tuple[str, Any] | None:
    """`customerId = C-42` as (name, value): the value is JSON when it reads as JSON (42, true,
    "quoted"), else the text itself."""
    name, sep, raw = text.partition("=")
    name, raw = name.strip(), raw.strip()
    if not sep or not name or not raw:
        return None
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def _filters(query: QueryParams, *names: str) -> dict[str, str]:
    """A list page's filters as its query gives them, trimmed; "" for those it leaves out."""
    return {name: query.get(name, "").strip() for name in names}


def _next_query(request: Request, next_page_token: str) -> str:
    """The query of the list's next page (its filters kept), "" on the last page."""
    return str(request.url.include_query_params(page=next_page_token).query) if next_page_token else ""


def _timestamp(text: str) -> timestamp_pb2.Timestamp | None:
    """A datetime-local input's value, read as UTC."""
    if not text:
        return None
    try:
        moment_ = datetime.fromisoformat(text)
    except ValueError:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(moment_ if moment_.tzinfo else moment_.replace(tzinfo=UTC))
    return stamp


def _text(value: Any, limit: int) -> str:
    text = value if isinstance(value, str) else ""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _compact(value: Any, limit: int) -> str:
    return _text(json.dumps(value, ensure_ascii=False, sort_keys=True), limit)


def step_view(step: external_task_pb2.JournalStep) -> dict[str, Any]:
    """What a journal step shows at a glance. Its payloads are what a worker wrote: every field is
    read for its type here, so an unexpected shape shows less, never breaks the page."""
    request = from_struct(step.request)
    response = from_struct(step.response) if step.HasField("response") else {}
    view: dict[str, Any] = {"calls": []}
    if step.kind == external_task_pb2.STEP_KIND_MODEL_CALL:
        model = " · ".join(_text(request.get(k), 100) for k in ("provider", "model") if request.get(k))
        view.update(model=model, finish=_text(response.get("finish"), 40))
        view.update(text=_text(response.get("text"), 600), refusal=_text(response.get("refusal"), 600))
        calls = response.get("functionCalls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict):
                name = _text(call.get("name"), 200).replace("__", "/")
                view["calls"].append((name, _compact(call.get("args", {}), 200)))
    elif "arguments" in request:
        view["arguments"] = _compact(request["arguments"], 300)
    decided = response.get("approval")
    if isinstance(decided, dict):
        view.update(
            decision=_text(decided.get("decision"), 40).lower(),
            decided_by=_text(decided.get("decidedBy"), 200),
            comment=_text(decided.get("comment"), 600),
        )
    return view


class Refused(Exception):
    """Ends a request with this response (a sign-in page, a 403)."""

    def __init__(self, response: Response) -> None:
        self.response = response


class Console:
    def __init__(self, engine: Engine, secret: bytes) -> None:
        self.engine = engine
        self.sealer = Sealer(secret)
        self.env = Environment(
            loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(), trim_blocks=True
        )
        self.env.filters["moment"] = moment
        self.env.filters["pretty"] = pretty
        self.env.globals["enum_name"] = enum_name
        self.env.globals["from_struct"] = from_struct
        self.env.globals["step_view"] = step_view
        self.env.globals["instance_state"] = lambda i: enum_name(
            process_pb2.InstanceState, i.state, "INSTANCE_STATE_"
        )
        self.env.globals["approval_state"] = lambda a: enum_name(
            approval_pb2.ApprovalState, a.state, "APPROVAL_STATE_"
        )

    # --- plumbing

    def render(
        self,
        request: Request,
        template: str,
        status: int = 200,
        session: Session | None = None,
        **context: Any,
    ) -> HTMLResponse:
        html = self.env.get_template(template).render(
            request=request, session=session, root=request.scope.get("root_path", ""), **context
        )
        response = HTMLResponse(html, status_code=status)
        # Pages hold journal contents: never cached, never framed, no scripts but ours.
        response.headers["Cache-Control"] = "no-store"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "same-origin"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
        )
        return response

    def refusal(
        self, request: Request, status: int, session: Session | None, message: str, title: str = ""
    ) -> HTMLResponse:
        """The page saying what was refused and why (titled "Not allowed" unless `title`)."""
        return self.render(request, "refused.html", status, session, message=message, title=title)

    def url(self, request: Request, path: str) -> str:
        return request.scope.get("root_path", "") + path

    def _secure(self, request: Request) -> bool:
        # Off loopback the cookie travels over TLS only (an ingress terminates it before the engine).
        return request.url.scheme == "https" or not is_loopback_host(request.url.hostname or "")

    def _set_cookie(self, response: Response, request: Request, name: str, value: str, max_age: int) -> None:
        """Every cookie of ours: sent to the console's pages only, never to scripts nor from another site."""
        response.set_cookie(
            name,
            value,
            max_age=max_age,
            path=self.url(request, "/"),
            httponly=True,
            samesite="strict",
            secure=self._secure(request),
        )

    def _start_page(self, request: Request, session: Session) -> Response:
        """Where a person starts: an operator at the instances, an approver at the calls to decide."""
        return RedirectResponse(
            self.url(request, "/instances" if session.operator else "/approvals"), status_code=303
        )

    def session(self, request: Request, operator: bool = False) -> Session:
        session = self.sealer.open(request.cookies.get(COOKIE))
        if session is None:
            raise Refused(RedirectResponse(self.url(request, "/login"), status_code=303))
        if operator and not session.operator:
            raise Refused(
                self.refusal(
                    request, 403, session, "This page is for operators. Your token lets you decide approvals."
                )
            )
        return session

    async def form(self, request: Request, session: Session) -> dict[str, str]:
        """The posted form, once its CSRF token matches the session's."""
        data = await request.form()
        values = {k: v for k, v in data.items() if isinstance(v, str)}
        if not session.csrf_matches(values.get("csrf", "")):
            raise Refused(
                self.refusal(
                    request,
                    403,
                    session,
                    "The form was sent without its security token. Reload the page and try again.",
                )
            )
        return values

    async def call(self, session: Session, method: Any, request: Any) -> Any:
        return await self.engine.call(session.token, method, request)

    async def _list_page(
        self,
        request: Request,
        session: Session,
        method: Any,
        search: Any,
        rows: str,
        filters: dict[str, str],
        **context: Any,
    ) -> HTMLResponse:
        """A list page: the page of `rows` that `search` (a List...Request, its filters set) reaches at the
        query's page token, shown by the template named after them, with a link to the next page that
        keeps the filters."""
        search.page_size = _LIST_PAGE_SIZE
        search.page_token = request.query_params.get("page", "")
        reply = await self.call(session, method, search)
        context[rows] = list(getattr(reply, rows))
        return self.render(
            request,
            f"{rows}.html",
            session=session,
            filters=filters,
            next_query=_next_query(request, reply.next_page_token),
            **context,
        )

    def page(self, handler: Callable[[Request], Awaitable[Response]]) -> Handler:
        """Runs a page, turning refusals (ours and the engine's) into pages a person can act on."""

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except Refused as refused:
                return refused.response
            except Unauthenticated:
                # The token left the callers file (or the session was sealed for another engine).
                response = RedirectResponse(self.url(request, "/login?expired=1"), status_code=303)
                response.delete_cookie(COOKIE, path=self.url(request, "/"))
                return response
            except PermissionDenied as error:
                session = self.sealer.open(request.cookies.get(COOKIE))
                return self.refusal(request, 403, session, error.message)
            except NotFound as error:
                session = self.sealer.open(request.cookies.get(COOKIE))
                return self.refusal(request, 404, session, error.message, title="Not found")
            except AbadaError as error:
                session = self.sealer.open(request.cookies.get(COOKIE))
                log.warning("the engine refused a console call", extra={"reason": error.reason})
                return self.refusal(
                    request,
                    502 if error.transient else 400,
                    session,
                    f"{error.reason or error.code.name}: {error.message}",
                    title="The engine said no",
                )

        return run

    # --- sign in and out

    async def home(self, request: Request) -> Response:
        return self._start_page(request, self.session(request))

    async def sign_in_page(self, request: Request, error: str = "", status: int = 200) -> Response:
        nonce = secrets.token_urlsafe(24)
        expired = request.query_params.get("expired") == "1"
        response = self.render(
            request,
            "login.html",
            status,
            None,
            csrf=nonce,
            error=error or ("Your session ended; sign in again." if expired else ""),
        )
        self._set_cookie(response, request, SIGN_IN_COOKIE, nonce, max_age=1800)
        return response

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            return await self.sign_in_page(request)
        data = await request.form()
        sent, expected = str(data.get("csrf", "")), request.cookies.get(SIGN_IN_COOKIE, "")
        if not sent or not expected or not secrets.compare_digest(sent, expected):
            return await self.sign_in_page(request, "The form expired; sign in again.", 403)
        token = str(data.get("token", "")).strip()
        if not token:
            return await self.sign_in_page(request, "Paste your caller token.", 400)
        try:
            roles = await self.engine.roles_of(token)
        except Unauthenticated:
            return await self.sign_in_page(request, "The engine does not know this token.", 401)
        except PermissionDenied:
            return await self.sign_in_page(
                request, "This token has neither the operator nor the approver role.", 403
            )
        except AbadaError as error:
            return await self.sign_in_page(request, f"The engine could not be asked: {error.message}", 502)
        session = self.sealer.new(token, roles)
        response = self._start_page(request, session)
        self._set_cookie(response, request, COOKIE, self.sealer.seal(session), max_age=SESSION_SECONDS)
        response.delete_cookie(SIGN_IN_COOKIE, path=self.url(request, "/"))
        return response

    async def logout(self, request: Request) -> Response:
        session = self.session(request)
        await self.form(request, session)
        response = RedirectResponse(self.url(request, "/login"), status_code=303)
        response.delete_cookie(COOKIE, path=self.url(request, "/"))
        return response

    # --- instances

    async def instances(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        query = request.query_params
        filters = _filters(query, "process", "state", "business_key", "variable", "after", "before")
        problems: list[str] = []
        search = process_pb2.ListInstancesRequest(
            process_id=filters["process"],
            state=STATES.get(filters["state"], process_pb2.INSTANCE_STATE_UNSPECIFIED),
            business_key=filters["business_key"],
            page_size=PAGE_SIZE,
            page_token=query.get("page", ""),
        )
        for name in ("after", "before"):
            if filters[name]:
                stamp = _timestamp(filters[name])
                if stamp is None:
                    problems.append(f"'{filters[name]}' is not a date and time")
                else:
                    getattr(search, f"created_{name}").CopyFrom(stamp)
        if filters["variable"]:
            parsed = parse_variable(filters["variable"])
            if parsed is None:
                problems.append("write a variable search as name = value, for instance customerId = C-42")
            else:
                wanted = search.variables.add()
                wanted.name = parsed[0]
                json_format.ParseDict(parsed[1], wanted.value)
        found: list[process_pb2.Instance] = []
        next_page = ""
        if not problems:
            reply = await self.call(session, lambda e: e.processes.ListInstances, search)
            found, next_page = list(reply.instances), reply.next_page_token
        return self.render(
            request,
            "instances.html",
            200 if not problems else 400,
            session,
            filters=filters,
            instances=found,
            problems=problems,
            next_query=_next_query(request, next_page),
            first_page=bool(query.get("page")),
            states=STATES,
        )

    async def instance(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        instance_id = request.path_params["instance_id"]
        instance = await self._instance(session, instance_id)
        events = list(
            (
                await self.call(
                    session,
                    lambda e: e.processes.GetHistory,
                    process_pb2.GetHistoryRequest(instance_id=instance_id),
                )
            ).events
        )
        tasks: dict[str, str] = {}
        for event in events:
            if event.task_id and event.task_id not in tasks:
                tasks[event.task_id] = event.node_id
        journals = []
        for task_id, node_id in tasks.items():
            steps = (
                await self.call(
                    session,
                    lambda e: e.tasks.GetJournal,
                    external_task_pb2.GetJournalRequest(task_id=task_id),
                )
            ).steps
            if steps:
                journals.append(
                    {
                        "task_id": task_id,
                        "node_id": node_id,
                        "steps": list(steps),
                        "cost": sum(s.cost_usd for s in steps),
                        "tokens": sum(s.tokens.input_tokens + s.tokens.output_tokens for s in steps),
                    }
                )
        incidents: list[incident_pb2.Incident] = []
        for state in (incident_pb2.INCIDENT_STATE_OPEN, incident_pb2.INCIDENT_STATE_RESOLVED):
            incidents += (
                await self.call(
                    session,
                    lambda e: e.incidents.ListIncidents,
                    incident_pb2.ListIncidentsRequest(instance_id=instance_id, state=state),
                )
            ).incidents
        waiting = any(
            s.state == external_task_pb2.STEP_STATE_AWAITING_APPROVAL for j in journals for s in j["steps"]
        )
        approvals = await self._pending_approvals_of(session, instance) if waiting else []
        user_tasks = (
            await self.call(
                session,
                lambda e: e.processes.ListUserTasks,
                process_pb2.ListUserTasksRequest(instance_id=instance_id),
            )
        ).user_tasks
        return self.render(
            request,
            "instance.html",
            session=session,
            instance=instance,
            variables=from_struct(instance.variables),
            events=events,
            journals=journals,
            incidents=incidents,
            approvals_by_step={(a.task_id, a.sequence): a for a in approvals},
            approvals=approvals,
            user_tasks=user_tasks,
            step_kind=lambda s: enum_name(external_task_pb2.StepKind, s.kind, "STEP_KIND_"),
            step_state=lambda s: enum_name(external_task_pb2.StepState, s.state, "STEP_STATE_"),
            resolutions_for=resolutions_for,
            resolution_names=RESOLUTIONS,
        )

    async def _instance(self, session: Session, instance_id: str) -> process_pb2.Instance:
        reply = await self.call(
            session,
            lambda e: e.processes.GetInstance,
            process_pb2.GetInstanceRequest(instance_id=instance_id),
        )
        return reply.instance

    async def _pending_approvals_of(
        self, session: Session, instance: process_pb2.Instance
    ) -> list[approval_pb2.Approval]:
        """The instance's calls still waiting for a decision (decided ones are in their journal step)."""
        found: list[approval_pb2.Approval] = []
        request = approval_pb2.ListApprovalsRequest(
            process_id=instance.process_id, business_key=instance.business_key, page_size=1000
        )
        while True:
            reply = await self.call(session, lambda e: e.approvals.ListApprovals, request)
            found += [a for a in reply.approvals if a.instance_id == instance.id]
            if not reply.next_page_token:
                return found
            request.page_token = reply.next_page_token

    async def cancel_instance(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        values = await self.form(request, session)
        instance_id = request.path_params["instance_id"]
        await self.call(
            session,
            lambda e: e.processes.CancelInstance,
            process_pb2.CancelInstanceRequest(instance_id=instance_id, reason=values.get("reason", "")),
        )
        return RedirectResponse(self.url(request, f"/instances/{instance_id}"), status_code=303)

    # --- approvals

    async def approvals(self, request: Request) -> Response:
        session = self.session(request)
        query = request.query_params
        filters = _filters(query, "process", "tool", "business_key", "state")
        state = {
            "approved": approval_pb2.APPROVAL_STATE_APPROVED,
            "rejected": approval_pb2.APPROVAL_STATE_REJECTED,
            "expired": approval_pb2.APPROVAL_STATE_EXPIRED,
        }.get(filters["state"], approval_pb2.APPROVAL_STATE_PENDING)
        search = approval_pb2.ListApprovalsRequest(
            process_id=filters["process"],
            tool_ref=filters["tool"],
            business_key=filters["business_key"],
            state=state,
        )
        return await self._list_page(
            request,
            session,
            lambda e: e.approvals.ListApprovals,
            search,
            "approvals",
            filters,
            decided=query.get("decided", ""),
        )

    def _approval_form(self, approval: approval_pb2.Approval) -> tuple[dict[str, Any], list[forms.Field]]:
        proposed = from_struct(approval.arguments)
        # The tool's input schema as frozen at deploy; a version deployed before schemas were kept
        # has none: then the form keeps each proposed argument's JSON type and requires every one.
        if approval.HasField("input_schema"):
            schema = from_struct(approval.input_schema)
        else:
            schema = forms.inferred_schema(proposed)
        return schema, forms.fields_for(schema, proposed)

    async def approval(self, request: Request) -> Response:
        session = self.session(request)
        approval_id = request.path_params["approval_id"]
        approval = (
            await self.call(
                session,
                lambda e: e.approvals.GetApproval,
                approval_pb2.GetApprovalRequest(approval_id=approval_id),
            )
        ).approval
        schema, fields = self._approval_form(approval)
        problems: list[str] = []
        status = 200
        if request.method == "POST":
            values = await self.form(request, session)
            action = values.get("action", "")
            comment = values.get("comment", "").strip()
            decide = approval_pb2.DecideApprovalRequest(approval_id=approval_id, comment=comment)
            if action == "reject":
                if not comment:
                    problems.append("Say why you reject the call: the model reads the reason.")
                decide.decision = approval_pb2.APPROVAL_DECISION_REJECT
            elif action == "approve":
                decide.decision = approval_pb2.APPROVAL_DECISION_APPROVE
                answers, readable = forms.read_answers(fields, values)
                if readable:
                    problems += await asyncio.to_thread(forms.check, schema, answers, fields)
                if readable and not problems and answers != from_struct(approval.arguments):
                    decide.arguments.CopyFrom(to_struct(answers))
                if not readable or any(f.error for f in fields):
                    problems.insert(0, "Some arguments need fixing before the call can be approved.")
            else:
                problems.append("Choose approve or reject.")
            if not problems:
                decided = (await self.call(session, lambda e: e.approvals.DecideApproval, decide)).approval
                word = "approved" if decided.state == approval_pb2.APPROVAL_STATE_APPROVED else "rejected"
                # Straight on to the next call waiting (the oldest), as a person working the inbox would.
                waiting = await self.call(
                    session,
                    lambda e: e.approvals.ListApprovals,
                    approval_pb2.ListApprovalsRequest(page_size=1),
                )
                following = f"/approvals/{waiting.approvals[0].id}" if waiting.approvals else "/approvals"
                return RedirectResponse(self.url(request, f"{following}?decided={word}"), status_code=303)
            status = 422
        return self.render(
            request,
            "approval.html",
            status,
            session,
            approval=approval,
            fields=fields,
            problems=problems,
            state=enum_name(approval_pb2.ApprovalState, approval.state, "APPROVAL_STATE_"),
            pending=approval.state == approval_pb2.APPROVAL_STATE_PENDING,
            decided=request.query_params.get("decided", "") if request.method == "GET" else "",
        )

    # --- incidents

    async def incidents(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        query = request.query_params
        filters = _filters(query, "type", "instance", "state")
        search = incident_pb2.ListIncidentsRequest(
            type=filters["type"],
            instance_id=filters["instance"],
            state=incident_pb2.INCIDENT_STATE_RESOLVED
            if filters["state"] == "resolved"
            else incident_pb2.INCIDENT_STATE_OPEN,
        )
        return await self._list_page(
            request,
            session,
            lambda e: e.incidents.ListIncidents,
            search,
            "incidents",
            filters,
            resolutions_for=resolutions_for,
            resolution_names=RESOLUTIONS,
            resolved=query.get("resolved", ""),
        )

    async def resolve(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        values = await self.form(request, session)
        resolution = values.get("resolution", "")
        comment = values.get("comment", "").strip()
        back = values.get("back", "")
        back = back if back.startswith("/instances/") or back == "/incidents" else "/incidents"
        if resolution not in RESOLUTIONS:
            raise Refused(self.refusal(request, 400, session, "Choose a resolution."))
        if not comment:
            raise Refused(self.refusal(request, 400, session, "Say why: the reason is recorded."))
        resolve = incident_pb2.ResolveIncidentRequest(
            incident_id=request.path_params["incident_id"],
            resolution=f"RESOLUTION_{resolution}",
            comment=comment,
        )
        if resolution == "HAPPENED":
            try:
                result = json.loads(values.get("result", "") or "{}")
            except json.JSONDecodeError as error:
                raise Refused(
                    self.refusal(request, 400, session, f"The result is not JSON: {error.msg}")
                ) from None
            if not isinstance(result, dict):
                raise Refused(self.refusal(request, 400, session, "The result is a JSON object."))
            resolve.result.CopyFrom(to_struct(result))
        await self.call(session, lambda e: e.incidents.ResolveIncident, resolve)
        separator = "&" if "?" in back else "?"
        return RedirectResponse(self.url(request, f"{back}{separator}resolved=1"), status_code=303)

    # --- user tasks

    async def user_tasks(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        reply = await self.call(
            session, lambda e: e.processes.ListUserTasks, process_pb2.ListUserTasksRequest(page_size=200)
        )
        return self.render(
            request,
            "user_tasks.html",
            session=session,
            user_tasks=list(reply.user_tasks),
            completed=request.query_params.get("completed", ""),
        )

    async def _user_task_schema(
        self, session: Session, task: process_pb2.UserTask
    ) -> tuple[str, dict[str, Any]]:
        """The variable a person's answer goes to and its schema: the node's own output schema, else
        that of the agent node whose doubtful answer the task reviews (on_invalid_output and
        on_low_confidence lead here), else any JSON object."""
        instance = await self._instance(session, task.instance_id)
        definition = (
            await self.call(
                session,
                lambda e: e.definitions.GetDefinition,
                definition_pb2.GetDefinitionRequest(definition_id=instance.definition_id),
            )
        ).definition
        spec = from_struct(definition.spec)
        nodes = spec.get("nodes") or []
        listed = list(nodes.values()) if isinstance(nodes, dict) else list(nodes)
        for node in listed:
            if node.get("id") == task.node_id and isinstance(node.get("output_schema"), dict):
                return str(node.get("result_variable") or ""), node["output_schema"]
        for node in listed:
            reviewed_here = task.node_id in (node.get("on_invalid_output"), node.get("on_low_confidence"))
            if reviewed_here and node.get("result_variable") and isinstance(node.get("output_schema"), dict):
                return str(node["result_variable"]), node["output_schema"]
        return "", {}

    async def user_task(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        task_id = request.path_params["task_id"]
        listed = (
            await self.call(
                session, lambda e: e.processes.ListUserTasks, process_pb2.ListUserTasksRequest(page_size=1000)
            )
        ).user_tasks
        task = next((t for t in listed if t.id == task_id), None)
        if task is None:
            raise Refused(
                self.refusal(request, 404, session, "No such user task is waiting.", title="Not found")
            )
        variable, schema = await self._user_task_schema(session, task)
        variables = from_struct(task.variables)
        current = variables.get(variable) if variable else None
        fields = forms.fields_for(schema, current if isinstance(current, dict) else {}) if schema else []
        problems: list[str] = []
        status = 200
        raw_variables = ""
        if request.method == "POST":
            values = await self.form(request, session)
            to_write: dict[str, Any] = {}
            if fields:
                answers, readable = forms.read_answers(fields, values)
                if readable:
                    problems += await asyncio.to_thread(forms.check, schema, answers, fields)
                if not readable or any(f.error for f in fields):
                    problems.insert(0, "Some fields need fixing.")
                to_write[variable] = answers
            raw_variables = values.get("variables", "").strip()
            if raw_variables:
                try:
                    extra = json.loads(raw_variables)
                    if not isinstance(extra, dict):
                        raise ValueError
                    to_write.update(extra)
                except ValueError:
                    problems.append("Other variables must be a JSON object.")
            if not problems:
                await self.call(
                    session,
                    lambda e: e.processes.CompleteUserTask,
                    process_pb2.CompleteUserTaskRequest(user_task_id=task_id, variables=to_struct(to_write)),
                )
                return RedirectResponse(self.url(request, "/user-tasks?completed=1"), status_code=303)
            status = 422
        return self.render(
            request,
            "user_task.html",
            status,
            session,
            task=task,
            variables=variables,
            variable=variable,
            fields=fields,
            problems=problems,
            raw_variables=raw_variables,
        )

    # --- queues

    async def queues(self, request: Request) -> Response:
        session = self.session(request, operator=True)
        topics = await self.call(session, lambda e: e.queues.ListTopics, queue_pb2.ListTopicsRequest())
        dependencies = await self.call(
            session, lambda e: e.dependencies.ListDependencies, dependency_pb2.ListDependenciesRequest()
        )
        # Tasks parked for a person's decision are in no topic's figures: say how many wait.
        waiting = await self.call(
            session, lambda e: e.approvals.ListApprovals, approval_pb2.ListApprovalsRequest(page_size=100)
        )
        awaiting = f"{len(waiting.approvals)}{'+' if waiting.next_page_token else ''}"
        topic = request.query_params.get("topic", "").strip()
        tasks = await self.call(
            session,
            lambda e: e.queues.ListTasks,
            queue_pb2.ListTasksRequest(topic_name=topic, page_size=100),
        )
        return self.render(
            request,
            "queues.html",
            session=session,
            topics=list(topics.topics),
            models=list(topics.models),
            dependencies=list(dependencies.dependencies),
            tasks=list(tasks.tasks),
            topic=topic,
            awaiting=awaiting,
            dependency_kind=lambda d: enum_name(dependency_pb2.DependencyKind, d.kind, "DEPENDENCY_KIND_"),
            dependency_state=lambda d: enum_name(
                dependency_pb2.DependencyState, d.state, "DEPENDENCY_STATE_"
            ),
        )


def build_console(engine: Engine, secret: bytes) -> Starlette:
    """The console as an app to mount (under /console/ on the engine's HTTP port)."""
    console = Console(engine, secret)
    page = console.page
    return Starlette(
        routes=[
            Route("/", page(console.home)),
            Route("/login", page(console.login), methods=["GET", "POST"]),
            Route("/logout", page(console.logout), methods=["POST"]),
            Route("/instances", page(console.instances)),
            Route("/instances/{instance_id}", page(console.instance)),
            Route("/instances/{instance_id}/cancel", page(console.cancel_instance), methods=["POST"]),
            Route("/approvals", page(console.approvals)),
            Route("/approvals/{approval_id}", page(console.approval), methods=["GET", "POST"]),
            Route("/incidents", page(console.incidents)),
            Route("/incidents/{incident_id}/resolve", page(console.resolve), methods=["POST"]),
            Route("/user-tasks", page(console.user_tasks)),
            Route("/user-tasks/{task_id}", page(console.user_task), methods=["GET", "POST"]),
            Route("/queues", page(console.queues)),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]
    )
