"""Reading the model's final reply: a JSON answer, its `_confidence` taken out into the metadata."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

CONFIDENCE_KEY = "_confidence"
_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\r?\n(.*?)```", re.DOTALL)


class InvalidAnswer(ValueError):
    """The reply is not a usable answer; the message is the reason handed to the engine."""


@dataclass(frozen=True)
class Answer:
    value: Any
    confidence: float | None


def parse_answer(text: str) -> Answer:
    """The reply as JSON, either bare or in a Markdown code fence; `_confidence` moves out of it."""
    stripped = text.strip()
    if not stripped:
        raise InvalidAnswer("the model's final reply was empty")
    value = _json_in(stripped)
    if not isinstance(value, dict) or CONFIDENCE_KEY not in value:
        return Answer(value=value, confidence=None)
    answer = dict(value)
    return Answer(value=answer, confidence=_confidence(answer.pop(CONFIDENCE_KEY)))


def _json_in(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    for fenced in _FENCE.finditer(text):
        try:
            return json.loads(fenced.group(1))
        except json.JSONDecodeError:
            continue
    raise InvalidAnswer(f"the model's final reply is not JSON: {_excerpt(text)}")


def _confidence(raw: Any) -> float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise InvalidAnswer(f"{CONFIDENCE_KEY} must be a number from 0 to 100, not {json.dumps(raw)}")
    if not 0 <= raw <= 100:
        raise InvalidAnswer(f"{CONFIDENCE_KEY} must be between 0 and 100, not {raw:g}")
    return float(raw)


def _excerpt(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return json.dumps(flat if len(flat) <= limit else flat[: limit - 1] + "…", ensure_ascii=False)
