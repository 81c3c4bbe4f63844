"""A journal step at a glance on the console: what a worker wrote is read for its type, so an odd
payload shows less and never breaks the instance page."""

from __future__ import annotations

from abada.engine.v1 import external_task_pb2 as et
from abada_engine.console.app import step_view
from google.protobuf import struct_pb2


def step(kind: int, request: dict, response: dict | None = None) -> et.JournalStep:
    message = et.JournalStep(kind=kind, request=struct_pb2.Struct())
    message.request.update(request)
    if response is not None:
        message.response.update(response)
    return message


def test_a_model_turn_shows_its_text_and_the_calls_it_asked_for() -> None:
    view = step_view(
        step(
            et.STEP_KIND_MODEL_CALL,
            {"turn": 1, "provider": "gemini", "model": "gemini-3.6-flash"},
            {
                "text": "Opening a ticket.",
                "finish": "tool_calls",
                "functionCalls": [{"name": "crm__create_ticket", "args": {"subject": "Parcel"}}],
            },
        )
    )
    assert view["model"] == "gemini · gemini-3.6-flash" and view["text"] == "Opening a ticket."
    assert view["calls"] == [("crm/create_ticket", '{"subject": "Parcel"}')]


def test_odd_shapes_show_less() -> None:
    view = step_view(
        step(et.STEP_KIND_MODEL_CALL, {"model": ["not", "text"]}, {"text": {"a": 1}, "functionCalls": "x"})
    )
    assert (view["model"], view["text"], view["calls"]) == ("", "", [])
    view = step_view(step(et.STEP_KIND_MODEL_CALL, {}, {"functionCalls": ["x", {"args": 1}]}))
    assert view["calls"] == [("", "1")]


def test_a_decided_call_names_who_decided() -> None:
    view = step_view(
        step(
            et.STEP_KIND_TOOL_CALL,
            {"callId": "c1", "arguments": {"subject": "Parcel"}},
            {"approval": {"decision": "APPROVED", "decidedBy": "carol", "comment": "ok"}},
        )
    )
    assert (view["arguments"], view["decision"], view["decided_by"]) == (
        '{"subject": "Parcel"}',
        "approved",
        "carol",
    )
