"""Deciding the model's reply to one request: which script, which turn, what it says, or a 429.

Shared by the scripted Gemini, OpenAI and Anthropic endpoints: each reads its API's request into a
`Conversation` and renders the neutral `PlayedTurn` (or `RateLimited`) in its API's shape.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

from scripted_gemini.conversation import Conversation
from scripted_gemini.ledger import CallLedger
from scripted_gemini.script import (
    FunctionCallsReply,
    JsonReply,
    RefusalReply,
    Script,
    ScriptBook,
    TextReply,
    Turn,
)
from scripted_gemini.templates import TemplateError, render_text, render_value


class PlayError(Exception):
    """The script cannot answer this request; sent back as a Gemini-style HTTP error."""

    def __init__(self, message: str, *, script_name: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.script_name = script_name


@dataclass(frozen=True)
class PlayedCall:
    name: str
    args: Any
    # Its place in the turn; each endpoint derives its wire id from the turn and this.
    position: int


@dataclass(frozen=True)
class PlayedTurn:
    """One reply in no provider's format; each endpoint renders it the way its API does."""

    script_name: str
    text: str | None
    calls: tuple[PlayedCall, ...]
    refusal: str | None
    prompt_tokens: int
    candidates_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    delay_ms: int

    @property
    def function_call_names(self) -> tuple[str, ...]:
        return tuple(call.name for call in self.calls)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.candidates_tokens


@dataclass(frozen=True)
class RateLimited:
    """Answer this request with a 429 and this retry-after instead of the turn."""

    script_name: str
    retry_after_seconds: float


def decide(
    book: ScriptBook, ledger: CallLedger, conversation: Conversation, model: str
) -> PlayedTurn | RateLimited:
    """The reply to one request, recorded in the ledger; raises PlayError (recorded too)."""
    try:
        played = play_turn(book, conversation)
    except PlayError as error:
        ledger.record(
            conversation=conversation.conversation_id,
            turn=conversation.turn_index,
            model=model,
            script=error.script_name,
            status=400,
            error=error.message,
        )
        raise
    limit = _turn_of(book, conversation).rate_limit
    refused = ledger.count(conversation.conversation_id, conversation.turn_index, status=429)
    if limit is not None and refused < limit.times:
        ledger.record(
            conversation=conversation.conversation_id,
            turn=conversation.turn_index,
            model=model,
            script=played.script_name,
            status=429,
            error=f"rate limited, retry after {limit.retry_after_seconds:g}s",
        )
        return RateLimited(played.script_name, limit.retry_after_seconds)
    # Recorded before any delay so a test can see a slow call that is still in flight.
    ledger.record(
        conversation=conversation.conversation_id,
        turn=conversation.turn_index,
        model=model,
        script=played.script_name,
        status=200,
        function_calls=played.function_call_names,
        function_responses=tuple(response.name for response in conversation.function_responses),
    )
    return played


def _turn_of(book: ScriptBook, conversation: Conversation) -> Turn:
    script = book.select(conversation.selection_text, list(conversation.inputs.values()))
    assert script is not None  # play_turn succeeded, so a script and a turn were found
    turn = script.turn_at(conversation.turn_index)
    assert turn is not None
    return turn


def play_turn(book: ScriptBook, conversation: Conversation) -> PlayedTurn:
    script = book.select(conversation.selection_text, list(conversation.inputs.values()))
    if script is None:
        raise PlayError(
            f"no script matches conversation {conversation.conversation_id} and there is no default "
            f"script (loaded: {', '.join(book.names)})"
        )
    turn = script.turn_at(conversation.turn_index)
    if turn is None:
        raise PlayError(
            f"script {script.name!r} has {len(script.turns)} turn(s) but the conversation already "
            f"holds {conversation.turn_index} model turn(s)",
            script_name=script.name,
        )
    try:
        text, calls, refusal = _render_reply(turn, conversation)
    except TemplateError as error:
        raise PlayError(
            f"script {script.name!r} turn {conversation.turn_index}: {error}", script_name=script.name
        ) from error
    _check_declared(script, conversation, tuple(call.name for call in calls))
    candidates_text = json.dumps(
        {"text": text, "calls": [[call.name, call.args] for call in calls], "refusal": refusal},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return PlayedTurn(
        script_name=script.name,
        text=text,
        calls=calls,
        refusal=refusal,
        prompt_tokens=_override_or(turn.usage.prompt_tokens, approximate_tokens(conversation.prompt_text)),
        candidates_tokens=_override_or(turn.usage.candidates_tokens, approximate_tokens(candidates_text)),
        cached_tokens=turn.usage.cached_tokens or 0,
        reasoning_tokens=turn.usage.reasoning_tokens or 0,
        delay_ms=turn.delay_ms,
    )


def approximate_tokens(text: str) -> int:
    """About four characters per token, as Gemini's documentation suggests; never zero."""
    return max(1, math.ceil(len(text) / 4))


def _override_or(override: int | None, computed: int) -> int:
    return computed if override is None else override


def _render_reply(
    turn: Turn, conversation: Conversation
) -> tuple[str | None, tuple[PlayedCall, ...], str | None]:
    reply = turn.reply
    if isinstance(reply, FunctionCallsReply):
        calls = tuple(
            PlayedCall(call.name, render_value(call.args, conversation), position)
            for position, call in enumerate(reply.calls)
        )
        return None, calls, None
    if isinstance(reply, TextReply):
        return render_text(reply.template, conversation), (), None
    if isinstance(reply, RefusalReply):
        return None, (), render_text(reply.template, conversation)
    return _json_answer_text(reply, conversation), (), None


def _json_answer_text(reply: JsonReply, conversation: Conversation) -> str:
    text = json.dumps(render_value(reply.value, conversation), ensure_ascii=False)
    return f"```json\n{text}\n```" if reply.fenced else text


def _check_declared(script: Script, conversation: Conversation, names: tuple[str, ...]) -> None:
    undeclared = [name for name in names if name not in conversation.declared_functions]
    if undeclared:
        declared = ", ".join(sorted(conversation.declared_functions)) or "none"
        raise PlayError(
            f"script {script.name!r} turn {conversation.turn_index} calls {', '.join(undeclared)}, "
            f"which the request does not declare (declared functions: {declared})",
            script_name=script.name,
        )
