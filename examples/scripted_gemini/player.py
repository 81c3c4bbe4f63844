"""Deciding the model's reply to one request: which script, which turn, and the rendered parts."""

import json
import math
from dataclasses import dataclass
from typing import Any

from scripted_gemini.conversation import Conversation
from scripted_gemini.script import FunctionCallsReply, JsonReply, Script, ScriptBook, TextReply, Turn
from scripted_gemini.templates import TemplateError, render_text, render_value


class PlayError(Exception):
    """The script cannot answer this request; sent back as a Gemini-style HTTP error."""

    def __init__(self, message: str, *, script_name: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.script_name = script_name


@dataclass(frozen=True)
class PlayedTurn:
    script_name: str
    # Gemini `Part` objects, camelCase, ready for the wire.
    parts: tuple[dict[str, Any], ...]
    function_call_names: tuple[str, ...]
    prompt_tokens: int
    candidates_tokens: int
    delay_ms: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.candidates_tokens


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
        parts = _render_parts(turn, conversation)
    except TemplateError as error:
        raise PlayError(
            f"script {script.name!r} turn {conversation.turn_index}: {error}", script_name=script.name
        ) from error
    function_call_names = tuple(part["functionCall"]["name"] for part in parts if "functionCall" in part)
    _check_declared(script, conversation, function_call_names)
    candidates_text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return PlayedTurn(
        script_name=script.name,
        parts=parts,
        function_call_names=function_call_names,
        prompt_tokens=_override_or(turn.usage.prompt_tokens, approximate_tokens(conversation.prompt_text)),
        candidates_tokens=_override_or(turn.usage.candidates_tokens, approximate_tokens(candidates_text)),
        delay_ms=turn.delay_ms,
    )


def approximate_tokens(text: str) -> int:
    """About four characters per token, as Gemini's documentation suggests; never zero."""
    return max(1, math.ceil(len(text) / 4))


def _override_or(override: int | None, computed: int) -> int:
    return computed if override is None else override


def _render_parts(turn: Turn, conversation: Conversation) -> tuple[dict[str, Any], ...]:
    reply = turn.reply
    if isinstance(reply, FunctionCallsReply):
        return tuple(
            {
                "functionCall": {
                    # Stable across replays of the same turn, so a journal can match calls by id.
                    "id": f"call_{conversation.turn_index}_{position}",
                    "name": call.name,
                    "args": render_value(call.args, conversation),
                }
            }
            for position, call in enumerate(reply.calls)
        )
    if isinstance(reply, TextReply):
        return ({"text": render_text(reply.template, conversation)},)
    return ({"text": _json_answer_text(reply, conversation)},)


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
