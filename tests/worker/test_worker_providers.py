"""The OpenAI and Anthropic providers through their real SDKs, against the scripted endpoints.

Each endpoint speaks its API's REST shapes and refuses what the real service refuses (a tool call
left without its result, a result without its call, a strict schema OpenAI would reject), so a
mapping mistake in a provider fails here the way it would fail against the service.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import openai
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
from abada_worker.providers.anthropic_messages import AnthropicMessagesProvider
from abada_worker.providers.base import ModelCallError, ModelProvider, retry_after_seconds
from abada_worker.providers.openai_chat import OpenAIChatProvider, tool_of
from abada_worker.providers.schemas import openai_parameters
from abada_worker.step_payloads import model_response, model_turn_of
from scripted_gemini import SUPPORT_TRIAGE_SCRIPT
from scripted_gemini.testing import fetch_calls, load_script, reset_calls, running_scripted_endpoint
from worker_support import VARIABLES, agent_work

GET_CUSTOMER = FunctionSpec(
    "crm__get_customer",
    "Look up a customer.",
    {"type": "object", "properties": {"customerId": {"type": "string"}}, "required": ["customerId"]},
)
CREATE_TICKET = FunctionSpec(
    "crm__create_ticket",
    "Open a ticket.",
    {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {
            "customerId": {"type": "string"},
            "subject": {"type": "string"},
            "priority": {"type": "string", "default": "normal"},
        },
        "required": ["customerId", "subject"],
    },
)
FUNCTIONS = (GET_CUSTOMER, CREATE_TICKET)
ALICE = {
    "content": [],
    "structuredContent": {"customerId": "C-42", "name": "Alice", "tier": "gold"},
    "isError": False,
}
BOB = {
    "content": [],
    "structuredContent": {"customerId": "C-7", "name": "Bob", "tier": "silver"},
    "isError": False,
}
TICKET = {"content": [], "structuredContent": {"ticketId": "T-981", "status": "open"}, "isError": False}
MODELS = {"openai": "gpt-5-mini", "anthropic": "claude-sonnet-4-5"}
ID_PREFIXES = {"openai": "call_", "anthropic": "toolu_"}

PARALLEL = {
    "scripts": [
        {
            "name": "parallel",
            "turns": [
                {
                    "calls": [
                        {"name": "crm__get_customer", "args": {"customerId": "C-42"}},
                        {"name": "crm__get_customer", "args": {"customerId": "C-7"}},
                    ]
                },
                {"json": {"latest": "{{tool.crm__get_customer.name}}", "_confidence": 90}},
            ],
        }
    ]
}


@dataclass(frozen=True)
class Endpoint:
    provider: str
    url: str

    def client(self) -> ModelProvider:
        if self.provider == "openai":
            return OpenAIChatProvider(
                api_key="sk-test-not-a-secret", base_url=f"{self.url}/v1", timeout_seconds=10
            )
        return AnthropicMessagesProvider(api_key="sk-ant-test", base_url=self.url, timeout_seconds=10)


@pytest.fixture(scope="module", params=["openai", "anthropic"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[Endpoint]:
    with running_scripted_endpoint(f"scripted_{request.param}.server") as url:
        yield Endpoint(request.param, url)


@pytest.fixture
async def provider(endpoint: Endpoint) -> AsyncIterator[ModelProvider]:
    load_script(endpoint.url, SUPPORT_TRIAGE_SCRIPT)
    reset_calls(endpoint.url)
    client = endpoint.client()
    yield client
    await client.aclose()


def request(
    endpoint: Endpoint,
    history: list[Turn],
    *,
    message: str = VARIABLES["message"],
    functions: tuple[FunctionSpec, ...] = FUNCTIONS,
) -> ModelRequest:
    prompt = render_prompt(agent_work(), {**VARIABLES, "message": message})
    return ModelRequest(MODELS[endpoint.provider], prompt.system, prompt.user, tuple(history), functions)


def journaled(reply: ModelReply, sequence: int) -> ModelTurn:
    """What a successor reads back: the reply as journaled, then rebuilt from the journal."""
    return model_turn_of(model_response(assign_call_ids(reply, sequence)))


def results(turn: ModelTurn, *outcomes: dict[str, Any]) -> ToolResults:
    return ToolResults(
        tuple(
            FunctionResult(call.id, call.name, outcome, bool(outcome.get("isError")))
            for call, outcome in zip(turn.function_calls, outcomes, strict=True)
        )
    )


async def test_the_scenario_plays_through_function_calls_to_a_json_answer(
    endpoint: Endpoint, provider: ModelProvider
) -> None:
    first = await provider.generate(request(endpoint, []))
    (lookup,) = first.function_calls
    assert lookup.id.startswith(ID_PREFIXES[endpoint.provider]) and len(lookup.id) > 12
    assert (lookup.name, lookup.args) == ("crm__get_customer", {"customerId": "C-42"})
    assert (first.finish, first.text) == ("tool_calls", "")
    assert first.input_tokens > 0 and first.output_tokens > 0

    history: list[Turn] = [journaled(first, 1)]
    history.append(results(history[-1], ALICE))
    second = await provider.generate(request(endpoint, history))
    (ticket,) = second.function_calls
    assert ticket.args == {"customerId": "C-42", "subject": "Parcel not received", "priority": "high"}

    history += [journaled(second, 3)]
    history.append(results(history[-1], TICKET))
    final = await provider.generate(request(endpoint, history))
    assert final.function_calls == ()
    assert final.finish == "stop"
    assert final.finish_reason == {"openai": "stop", "anthropic": "end_turn"}[endpoint.provider]
    assert '"ticketId": "T-981"' in final.text

    calls = fetch_calls(endpoint.url)
    assert [(call["turn"], call["status"]) for call in calls["calls"]] == [(0, 200), (1, 200), (2, 200)]
    assert calls["repeated"] == []


async def test_two_parallel_calls_in_one_turn_round_trip_with_their_ids(
    endpoint: Endpoint, provider: ModelProvider
) -> None:
    load_script(endpoint.url, PARALLEL)
    first = await provider.generate(request(endpoint, []))
    alice, bob = first.function_calls
    assert [call.args for call in (alice, bob)] == [{"customerId": "C-42"}, {"customerId": "C-7"}]
    assert alice.id != bob.id

    # Journaled and read back, the provider's own ids survive, and both results go back together.
    turn = journaled(first, 1)
    assert [call.id for call in turn.function_calls] == [alice.id, bob.id]
    final = await provider.generate(request(endpoint, [turn, results(turn, ALICE, BOB)]))
    assert final.function_calls == ()
    assert '"latest": "Bob"' in final.text

    # The endpoint refuses a turn whose second call got no result, as the real API does.
    half = ToolResults(results(turn, ALICE, BOB).results[:1])
    with pytest.raises(ModelCallError) as refused:
        await provider.generate(request(endpoint, [turn, half]))
    assert (refused.value.status, refused.value.retryable) == (400, False)
    assert bob.id in str(refused.value)


async def test_a_rate_limit_says_when_to_come_back_and_the_turn_then_plays(
    endpoint: Endpoint, provider: ModelProvider
) -> None:
    load_script(
        endpoint.url,
        [
            {
                "call": {"name": "crm__get_customer", "args": {"customerId": "C-42"}},
                "rate_limit": {"retry_after_seconds": 2},
            }
        ],
    )
    with pytest.raises(ModelCallError) as limited:
        await provider.generate(request(endpoint, []))
    assert (limited.value.status, limited.value.retry_after_seconds, limited.value.retryable) == (
        429,
        2.0,
        True,
    )

    again = await provider.generate(request(endpoint, []))
    assert [call.name for call in again.function_calls] == ["crm__get_customer"]
    assert [call["status"] for call in fetch_calls(endpoint.url)["calls"]] == [429, 200]


async def test_a_refusal_is_reported_as_one(endpoint: Endpoint, provider: ModelProvider) -> None:
    load_script(endpoint.url, [{"refusal": "I can't help with that request."}])
    reply = await provider.generate(request(endpoint, []))

    assert (reply.finish, reply.refusal, reply.function_calls) == (
        "refusal",
        "I can't help with that request.",
        (),
    )
    assert model_turn_of(model_response(reply)).refusal == "I can't help with that request."


async def test_cached_and_reasoning_tokens_are_read_where_reported(
    endpoint: Endpoint, provider: ModelProvider
) -> None:
    load_script(
        endpoint.url,
        [
            {
                "json": {"ok": True},
                "usage": {
                    "prompt_tokens": 1000,
                    "candidates_tokens": 50,
                    "cached_tokens": 800,
                    "reasoning_tokens": 30,
                },
            }
        ],
    )
    reply = await provider.generate(request(endpoint, []))

    # Every prompt token read counts as input; reasoning is billed as output on both APIs.
    assert (reply.input_tokens, reply.output_tokens) == (1000, 80)
    assert reply.cached_input_tokens == 800
    assert reply.reasoning_tokens == (30 if endpoint.provider == "openai" else 0)
    assert model_response(reply)["usage"]["cachedInputTokens"] == 800


async def test_a_call_to_an_undeclared_function_is_refused_not_retried(
    endpoint: Endpoint, provider: ModelProvider
) -> None:
    with pytest.raises(ModelCallError) as refused:
        await provider.generate(request(endpoint, [], functions=(CREATE_TICKET,)))
    assert (refused.value.status, refused.value.retryable) == (400, False)


async def test_an_unreachable_server_is_worth_retrying(endpoint: Endpoint) -> None:
    unreachable = Endpoint(endpoint.provider, "http://127.0.0.1:9").client()
    try:
        with pytest.raises(ModelCallError) as failed:
            await unreachable.generate(request(endpoint, []))
    finally:
        await unreachable.aclose()
    assert failed.value.retryable is True and failed.value.status is None


def test_strict_mode_is_used_exactly_where_openai_accepts_it() -> None:
    strict_parameters, strict = openai_parameters(GET_CUSTOMER.parameters)
    assert strict is True
    assert strict_parameters["additionalProperties"] is False
    # An optional argument (and a default) is outside strict mode: sent plain, meaning unchanged.
    loose_parameters, loose = openai_parameters(CREATE_TICKET.parameters)
    assert loose is False
    assert loose_parameters["required"] == ["customerId", "subject"] and "$schema" not in loose_parameters
    assert tool_of(GET_CUSTOMER)["function"]["strict"] is True


async def test_the_scripted_openai_endpoint_refuses_a_schema_strict_mode_would_refuse() -> None:
    with running_scripted_endpoint("scripted_openai.server") as url:
        client = openai.AsyncOpenAI(api_key="sk-test", base_url=f"{url}/v1", max_retries=0)
        loose = {"type": "object", "properties": {"note": {"type": "string"}}}
        try:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.chat.completions.create(
                    model="gpt-5-mini",
                    messages=[{"role": "user", "content": "hi"}],
                    tools=[
                        {"type": "function", "function": {"name": "f", "parameters": loose, "strict": True}}
                    ],
                )
        finally:
            await client.close()
    assert "additionalProperties" in str(refused.value)


def test_retry_after_is_read_in_milliseconds_seconds_or_as_a_date() -> None:
    assert retry_after_seconds({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after_seconds({"Retry-After": "2"}) == 2.0
    assert retry_after_seconds({"retry-after": "Wed, 02 Dec 2026 21:00:10 GMT"}, now=1796245200.0) == 10.0
    assert retry_after_seconds({"retry-after": "soon"}) is None
    assert retry_after_seconds({}) is None


def test_a_worker_assigned_id_is_never_shown_to_a_provider_that_gave_its_own() -> None:
    reply = ModelReply("", (FunctionCall("call_abc", "crm__get_customer", {}),), "tool_calls", 1, 1)
    assert assign_call_ids(reply, 5) == reply
