"""The HTTP gateway's pieces on their own: path templates, request bodies, refusals as HTTP answers."""

from __future__ import annotations

import json

import grpc
import pytest
from abada.engine.v1 import external_task_pb2, incident_pb2
from abada_common import rpc_status
from abada_common.errors import Category
from abada_common.http_gateway import (
    BadRequest,
    HttpAbort,
    HttpCallContext,
    PathTemplate,
    _refusal,
    to_message,
)


def test_path_templates_match_variables_and_custom_verbs_only_where_they_should():
    steps = PathTemplate.parse("/v1/external-tasks/{task_id}/steps")
    assert steps.match("/v1/external-tasks/task-7f3/steps") == {"task_id": "task-7f3"}
    assert steps.match("/v1/external-tasks/a%2Fb/steps") == {"task_id": "a/b"}
    assert steps.match("/v1/external-tasks/a/b/steps") is None
    complete = PathTemplate.parse("/v1/external-tasks/{task_id}:complete")
    assert complete.match("/v1/external-tasks/t1:complete") == {"task_id": "t1"}
    assert complete.match("/v1/external-tasks/t1:fail") is None
    assert complete.match("/v1/external-tasks/t1") is None
    fetch = PathTemplate.parse("/v1/external-tasks:fetchAndLock")
    assert fetch.match("/v1/external-tasks:fetchAndLock") == {}
    assert fetch.openapi_path == "/v1/external-tasks:fetchAndLock"


def test_the_scenarios_short_enum_names_are_taken_beside_the_full_ones():
    short = to_message({"kind": "TOOL_CALL", "state": "STARTED"}, external_task_pb2.AppendStepRequest)
    full = to_message(
        {"kind": "STEP_KIND_TOOL_CALL", "state": "STEP_STATE_STARTED"}, external_task_pb2.AppendStepRequest
    )
    assert short == full
    assert short.kind == external_task_pb2.STEP_KIND_TOOL_CALL  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "message_type", "field"),
    [
        ({"kind": "NAP"}, external_task_pb2.AppendStepRequest, "kind"),
        ({"attempt": "one"}, external_task_pb2.AppendStepRequest, "attempt"),
        ({"tokens": {"inputTokens": "many"}}, external_task_pb2.AppendStepRequest, "tokens.inputTokens"),
        ({"colour": "red"}, external_task_pb2.AppendStepRequest, "colour"),
        (
            {"steps": [{"kind": "MODEL_CALL"}, {"state": "DONE"}]},
            external_task_pb2.AppendStepsRequest,
            "steps[1].state",
        ),
        ({"dependency": "model"}, incident_pb2.ListIncidentsRequest, "dependency"),
        ({"steps": {"kind": 1}}, external_task_pb2.AppendStepsRequest, "steps"),
    ],
)
def test_a_malformed_body_names_its_field(body, message_type, field):
    with pytest.raises(BadRequest) as caught:
        to_message(body, message_type)
    assert caught.value.field_name == field


def test_a_refusal_is_the_grpc_gateway_status_with_the_details_and_retry_after():
    status = rpc_status.status_message(
        Category.RESOURCE_EXHAUSTED, "ENGINE_BUSY", "too many checks waiting", retry_after_seconds=1.2
    )
    answer = _refusal(status)
    assert answer.status_code == 429
    assert answer.headers["Retry-After"] == "2"
    body = json.loads(answer.body)
    assert body["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert [d["@type"].rsplit(".", 1)[1] for d in body["details"]] == ["ErrorInfo", "RetryInfo"]
    assert body["details"][0]["reason"] == "ENGINE_BUSY"


async def test_the_call_context_gives_the_servicer_what_grpc_would():
    context = HttpCallContext([("authorization", "Bearer t")], "ipv4:127.0.0.1:5", common_name="agent-pool")
    assert context.invocation_metadata() == (("authorization", "Bearer t"),)
    assert context.auth_context() == {"x509_common_name": [b"agent-pool"]}
    status = rpc_status.status_message(Category.NOT_FOUND, "TASK_NOT_FOUND", "no such task", field="task_id")
    with pytest.raises(HttpAbort) as caught:
        await rpc_status.abort(context, status)  # type: ignore[arg-type]
    assert caught.value.status == status
    with pytest.raises(HttpAbort) as plain:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
    assert plain.value.status.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
