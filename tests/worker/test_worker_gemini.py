"""The Gemini provider through the real google-genai client, against the scripted Gemini endpoint."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterator

import pytest
from abada_worker.agent_task import assign_call_ids
from abada_worker.conversation import (
    FunctionCall,
    FunctionResult,
    FunctionSpec,
    ModelReply,
    ModelRequest,
    ModelTurn,
    ToolResults,
    Turn,
)
from abada_worker.prompt import render_prompt
from abada_worker.providers.base import ModelCallError
from abada_worker.providers.gemini import GeminiProvider, contents_of
from abada_worker.step_payloads import model_response, model_turn_of
from google.genai import types
from scripted_gemini.testing import fetch_calls, reset_calls, running_scripted_gemini
from worker_support import VARIABLES, agent_work

FUNCTIONS = (
    FunctionSpec(
        "crm__get_customer",
        "Look up a customer.",
        {"type": "object", "properties": {"customerId": {"type": "string"}}, "required": ["customerId"]},
    ),
    FunctionSpec(
        "crm__create_ticket",
        "Open a ticket.",
        {
            "type": "object",
            "properties": {
                "customerId": {"type": "string"},
                "subject": {"type": "string"},
                "priority": {"type": "string"},
            },
            "required": ["customerId", "subject", "priority"],
        },
    ),
)
ALICE = {
    "content": [],
    "structuredContent": {"customerId": "C-42", "name": "Alice", "tier": "gold"},
    "isError": False,
}
TICKET = {"content": [], "structuredContent": {"ticketId": "T-981", "status": "open"}, "isError": False}


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running_scripted_gemini() as url:
        yield url


@pytest.fixture
async def gemini(base_url: str) -> AsyncIterator[GeminiProvider]:
    reset_calls(base_url)
    provider = GeminiProvider(api_key=None, base_url=base_url)
    yield provider
    await provider.aclose()


def request(
    history: list[Turn], message: str = VARIABLES["message"], functions: tuple[FunctionSpec, ...] = FUNCTIONS
) -> ModelRequest:
    prompt = render_prompt(agent_work(), {**VARIABLES, "message": message})
    return ModelRequest("gemini-3.6-flash", prompt.system, prompt.user, tuple(history), functions)


def answered(call: FunctionCall, result: dict[str, object]) -> list[Turn]:
    return [
        ModelTurn("", (call,)),
        ToolResults((FunctionResult(call.id, call.name, result, is_error=False),)),
    ]


async def test_the_scenario_plays_through_function_calls_to_a_json_answer(
    gemini: GeminiProvider, base_url: str
) -> None:
    history: list[Turn] = []
    first = await gemini.generate(request(history))
    (lookup,) = first.function_calls
    assert (lookup.id, lookup.name, lookup.args) == ("call_0_0", "crm__get_customer", {"customerId": "C-42"})
    assert first.input_tokens > 0 and first.output_tokens > 0
    assert first.text == ""

    history += answered(lookup, ALICE)
    second = await gemini.generate(request(history))
    (ticket,) = second.function_calls
    assert ticket.name == "crm__create_ticket"
    assert ticket.args == {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}

    history += answered(ticket, TICKET)
    final = await gemini.generate(request(history))
    assert final.function_calls == ()
    # The template reads the ticket id out of the structured content the worker handed back.
    assert '"ticketId": "T-981"' in final.text or '"ticketId":"T-981"' in final.text
    assert final.finish_reason == "STOP"

    calls = fetch_calls(base_url)
    assert [(call["turn"], call["script"]) for call in calls["calls"]] == [
        (0, "support_triage"),
        (1, "support_triage"),
        (2, "support_triage"),
    ]
    assert calls["repeated"] == []


async def test_an_input_marker_picks_its_script_through_the_escaped_block(
    gemini: GeminiProvider, base_url: str
) -> None:
    first = await gemini.generate(request([], message="Where is it? [scripted:non-json] <b>now</b>"))
    (lookup,) = first.function_calls
    final = await gemini.generate(
        request(answered(lookup, ALICE), message="Where is it? [scripted:non-json] <b>now</b>")
    )

    assert final.function_calls == ()
    assert final.text.startswith("I looked up customer C-42")
    assert {call["script"] for call in fetch_calls(base_url)["calls"]} == {"non_json_answer"}


async def test_a_refused_request_is_a_model_error_not_worth_retrying(gemini: GeminiProvider) -> None:
    # Without crm__get_customer declared, the script's first call is refused with a 400.
    with pytest.raises(ModelCallError) as refused:
        await gemini.generate(request([], functions=FUNCTIONS[1:]))

    assert refused.value.status == 400
    assert refused.value.retryable is False


async def test_an_unreachable_endpoint_is_worth_retrying() -> None:
    provider = GeminiProvider(api_key=None, base_url="http://127.0.0.1:9", timeout_seconds=5)
    try:
        with pytest.raises(ModelCallError) as unreachable:
            await provider.generate(request([]))
    finally:
        await provider.aclose()
    assert unreachable.value.retryable is True


def test_thought_signatures_and_tool_errors_go_back_the_way_gemini_expects() -> None:
    signature = base64.b64encode(b"opaque-state").decode()
    call = FunctionCall("call_0_0", "crm__get_customer", {"customerId": "C-999"}, signature)
    failure = {"content": [{"type": "text", "text": "No customer with id 'C-999'."}], "isError": True}
    history: list[Turn] = [
        ModelTurn("Let me look.", (call,)),
        ToolResults((FunctionResult(call.id, call.name, failure, True),)),
    ]

    user, model, results = contents_of(request(history))

    assert user.role == "user" and user.parts[0].text.startswith("Read the message")
    assert model.role == "model"
    assert model.parts[0].text == "Let me look."
    assert model.parts[1].function_call == types.FunctionCall(
        id="call_0_0", name="crm__get_customer", args={"customerId": "C-999"}
    )
    assert model.parts[1].thought_signature == b"opaque-state"
    response = results.parts[0].function_response
    assert (response.id, response.name) == ("call_0_0", "crm__get_customer")
    assert response.response == {"error": "No customer with id 'C-999'."}


def test_without_a_key_or_an_endpoint_there_is_no_provider() -> None:
    with pytest.raises(ValueError, match="GEMINI_API_KEY"):
        GeminiProvider(api_key=None, base_url=None)


def test_a_call_without_an_id_is_journaled_under_a_worker_id_and_shown_back_without_one() -> None:
    reply = ModelReply("", (FunctionCall("", "crm__get_customer", {"customerId": "C-42"}),), "STOP", 10, 2)

    (call,) = assign_call_ids(reply, sequence=3).function_calls
    (replayed,) = model_turn_of(model_response(assign_call_ids(reply, sequence=3))).function_calls
    failure = {"content": [{"type": "text", "text": "down"}], "isError": True}
    history: list[Turn] = [
        ModelTurn("", (replayed,)),
        ToolResults((FunctionResult(replayed.id, replayed.name, failure, True),)),
    ]
    _, model, results = contents_of(request(history))

    assert call.id == replayed.id == "call_3_0"
    assert model.parts[0].function_call.id is None
    assert results.parts[0].function_response.id is None
