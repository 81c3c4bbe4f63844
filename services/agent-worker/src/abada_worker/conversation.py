"""The conversation with the model, independent of any provider's wire format.

A conversation is the guarded system message, the first user message, then alternating model
turns and tool results. It is rebuilt from the journal on replay, so every piece of it must be
derivable from what the journal stores.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionCall:
    id: str
    name: str
    args: dict[str, Any]
    # Opaque provider state that must travel back with the call (Gemini's thought signature, base64).
    signature: str = ""
    # The id the model itself gave, when the worker had to assign `id` (None: the same as `id`).
    provider_id: str | None = None

    @property
    def wire_id(self) -> str:
        """The id to show the model again: its own, which may be empty."""
        return self.id if self.provider_id is None else self.provider_id


@dataclass(frozen=True)
class ModelTurn:
    text: str
    function_calls: tuple[FunctionCall, ...] = ()
    # What the model said instead of answering when it declined the task (OpenAI's `refusal`,
    # Anthropic's `stop_reason: refusal`); "" when it did not.
    refusal: str = ""


@dataclass(frozen=True)
class FunctionResult:
    call_id: str
    name: str
    # The MCP CallToolResult as JSON: {"content": [...], "structuredContent": ..., "isError": bool}.
    result: dict[str, Any]
    is_error: bool


@dataclass(frozen=True)
class ToolResults:
    results: tuple[FunctionResult, ...]


Turn = ModelTurn | ToolResults


@dataclass(frozen=True)
class FunctionSpec:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ModelRequest:
    model: str
    system: str
    user: str
    history: tuple[Turn, ...]
    functions: tuple[FunctionSpec, ...]


# Why a turn ended, in the journal's provider-neutral words; each provider maps its own reasons.
FINISH_STOP = "stop"  # the model ended its turn: an answer (or text) with nothing else asked for
FINISH_TOOL_CALLS = "tool_calls"  # it asked for function calls
FINISH_LENGTH = "length"  # it ran out of output tokens (or context window)
FINISH_REFUSAL = "refusal"  # it declined
FINISH_FILTERED = "content_filter"  # the provider's safety filter stopped it
FINISH_OTHER = "other"


def neutral_finish(reason: str, finishes: Mapping[str, str]) -> str:
    """A provider's own finish reason in the journal's words, through the provider's `finishes`: a
    reason it does not list is FINISH_OTHER, and no reason at all stays ""."""
    return finishes.get(reason, FINISH_OTHER if reason else "")


@dataclass(frozen=True)
class ModelReply:
    text: str
    function_calls: tuple[FunctionCall, ...]
    # The provider's own finish reason, as it said it (STOP, tool_calls, end_turn, ...).
    finish_reason: str
    input_tokens: int
    # Output tokens including any reasoning the provider bills as output.
    output_tokens: int
    # What the provider said about the turn beyond the text, for the journal only.
    extra: dict[str, Any] = field(default_factory=dict)
    # The same reason in provider-neutral words (FINISH_*); "" when the provider gave none.
    finish: str = ""
    refusal: str = ""
    # Of input_tokens, served from the provider's prompt cache; of output_tokens, spent reasoning.
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0

    def as_turn(self) -> ModelTurn:
        return ModelTurn(text=self.text, function_calls=self.function_calls, refusal=self.refusal)


def result_for_model(result: dict[str, Any]) -> Any:
    """What the model reads of a tool result: the structured content when there is one, else the text.

    The full CallToolResult repeats structured content as JSON text; sending both would pay for the
    same tokens twice.
    """
    structured = result.get("structuredContent")
    if structured is not None:
        return structured
    content = result.get("content") or []
    texts = [
        block.get("text", "") for block in content if isinstance(block, dict) and block.get("type") == "text"
    ]
    if texts and len(texts) == len(content):
        return "\n".join(texts)
    return content
