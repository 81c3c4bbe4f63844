"""The script format: named scripts, how a conversation picks one, and the turns each plays.

A script file (YAML or JSON) looks like::

    scripts:
      - name: runaway
        match: {input_contains: "ignore your instructions"}
        turns:
          - call: {name: crm__create_ticket, args: {customerId: "{{input.customerId}}"}}
            repeat: true
      - name: support_triage            # no `match`: the default script
        turns:
          - call: {name: crm__get_customer, args: {customerId: "{{input.customerId}}"}}
          - calls:
              - {name: crm__create_ticket, args: {subject: "Parcel not received"}}
            delay_ms: 200
          - json: {ticketId: "{{tool.crm__create_ticket.ticketId}}", priority: high}
            fenced: true

A turn may also answer with `refusal: "text"` (the model declines), and may be rate limited:
`rate_limit: {retry_after_seconds: 1, times: 1}` answers the first `times` requests for that turn
with a 429 and that retry-after (each endpoint in its API's shape), then plays the turn.

A file may also hold a single script (a mapping with `turns`) or just a list of turns.
Every unknown key is an error, so a typo in a script fails at load time instead of silently
playing something else.
"""

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

SCRIPTS_DIR = Path(__file__).parent / "scripts"
SUPPORT_TRIAGE_SCRIPT = SCRIPTS_DIR / "support_triage.yaml"


class ScriptError(ValueError):
    """A script file is malformed; the message names the offending place."""


@dataclass(frozen=True)
class MatchRule:
    """Conditions a conversation must meet to play a script; every listed condition must hold.

    Each condition is a list of phrases of which at least one must appear (case-insensitive).
    `prompt_contains` looks at the system instruction and the first user content;
    `input_contains` looks only at the values of `<input name="...">` blocks, which is what
    marker-based selection should use: the worker's guard text in the system instruction
    may itself quote phrases such as "ignore your instructions".
    """

    prompt_contains: tuple[str, ...] = ()
    input_contains: tuple[str, ...] = ()

    def matches(self, prompt_text: str, input_values: Sequence[str]) -> bool:
        if self.prompt_contains and not _contains_any(prompt_text, self.prompt_contains):
            return False
        return not self.input_contains or any(
            _contains_any(value, self.input_contains) for value in input_values
        )


def _contains_any(text: str, phrases: Sequence[str]) -> bool:
    folded = text.casefold()
    return any(phrase.casefold() in folded for phrase in phrases)


@dataclass(frozen=True)
class ScriptedFunctionCall:
    """One function call the model asks for; `args` may hold `{{...}}` templates."""

    name: str
    args: Mapping[str, Any]


@dataclass(frozen=True)
class FunctionCallsReply:
    calls: tuple[ScriptedFunctionCall, ...]


@dataclass(frozen=True)
class TextReply:
    """A final answer given as a text template."""

    template: str


@dataclass(frozen=True)
class JsonReply:
    """A final answer given as a JSON value (templates keep their JSON type), sent as text."""

    value: Any
    fenced: bool = False


@dataclass(frozen=True)
class RefusalReply:
    """The model declines the task; each endpoint says so the way its API does."""

    template: str


Reply = FunctionCallsReply | TextReply | JsonReply | RefusalReply


@dataclass(frozen=True)
class RateLimit:
    """The first `times` requests for the turn get a 429 with this retry-after."""

    retry_after_seconds: float
    times: int = 1


@dataclass(frozen=True)
class UsageOverride:
    """Token counts a turn reports instead of the computed ones, e.g. to hit a token limit."""

    prompt_tokens: int | None = None
    candidates_tokens: int | None = None
    # Of the prompt, served from cache; of the candidates, spent reasoning (0 when not given).
    cached_tokens: int | None = None
    reasoning_tokens: int | None = None


@dataclass(frozen=True)
class Turn:
    reply: Reply
    repeat: bool = False
    delay_ms: int = 0
    usage: UsageOverride = field(default_factory=UsageOverride)
    rate_limit: RateLimit | None = None


@dataclass(frozen=True)
class Script:
    name: str
    turns: tuple[Turn, ...]
    match: MatchRule | None = None

    def turn_at(self, index: int) -> Turn | None:
        """The turn to play when the conversation already holds `index` model turns."""
        if index < len(self.turns):
            return self.turns[index]
        last = self.turns[-1]
        return last if last.repeat else None


@dataclass(frozen=True)
class ScriptBook:
    """All loaded scripts, in file order; matched scripts are tried first, then the default."""

    scripts: tuple[Script, ...]

    @property
    def names(self) -> list[str]:
        return [script.name for script in self.scripts]

    def select(self, prompt_text: str, input_values: Sequence[str]) -> Script | None:
        for script in self.scripts:
            if script.match is not None and script.match.matches(prompt_text, input_values):
                return script
        return next((script for script in self.scripts if script.match is None), None)


def load_script_file(path: str | Path) -> ScriptBook:
    source = Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except OSError as error:
        raise ScriptError(f"{source}: cannot read script file: {error}") from error
    return parse_script_text(text, source=str(source))


def parse_script_text(text: str, *, source: str = "<script>") -> ScriptBook:
    """Parses YAML or JSON (JSON is valid YAML) into a validated script book."""
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ScriptError(f"{source}: not valid YAML/JSON: {error}") from error
    return parse_script_document(document, source=source)


def parse_script_document(document: Any, *, source: str = "<script>") -> ScriptBook:
    if isinstance(document, list):
        scripts = [_parse_script({"name": "default", "turns": document}, f"{source}: turns")]
    elif isinstance(document, Mapping) and "scripts" in document:
        _reject_unknown_keys(document, {"scripts"}, source)
        entries = document["scripts"]
        if not isinstance(entries, list) or not entries:
            raise ScriptError(f"{source}: 'scripts' must be a non-empty list")
        scripts = [_parse_script(entry, f"{source}: scripts[{i}]") for i, entry in enumerate(entries)]
    elif isinstance(document, Mapping):
        scripts = [_parse_script({"name": "default", **document}, source)]
    else:
        raise ScriptError(f"{source}: expected a mapping with 'scripts', a script or a list of turns")
    _check_book(scripts, source)
    return ScriptBook(tuple(scripts))


def _check_book(scripts: list[Script], source: str) -> None:
    seen: set[str] = set()
    for script in scripts:
        if script.name in seen:
            raise ScriptError(f"{source}: script name {script.name!r} is used twice")
        seen.add(script.name)
    defaults = [script.name for script in scripts if script.match is None]
    if len(defaults) > 1:
        raise ScriptError(
            f"{source}: only one script may lack 'match' (the default), found {', '.join(defaults)}"
        )


def _parse_script(entry: Any, where: str) -> Script:
    entry = _require_mapping(entry, where)
    _reject_unknown_keys(entry, {"name", "match", "turns"}, where)
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ScriptError(f"{where}: 'name' must be a non-empty string")
    where = f"{where} ({name})"
    turns_value = entry.get("turns")
    if not isinstance(turns_value, list) or not turns_value:
        raise ScriptError(f"{where}: 'turns' must be a non-empty list")
    turns = tuple(_parse_turn(turn, f"{where}.turns[{i}]") for i, turn in enumerate(turns_value))
    for index, turn in enumerate(turns[:-1]):
        if turn.repeat:
            raise ScriptError(
                f"{where}.turns[{index}]: a 'repeat' turn plays forever, so it must be the last turn"
            )
    match = _parse_match(entry["match"], f"{where}.match") if "match" in entry else None
    return Script(name=name, turns=turns, match=match)


def _parse_match(value: Any, where: str) -> MatchRule:
    value = _require_mapping(value, where)
    _reject_unknown_keys(value, {"prompt_contains", "input_contains"}, where)
    rule = MatchRule(
        prompt_contains=_phrases(value.get("prompt_contains"), f"{where}.prompt_contains"),
        input_contains=_phrases(value.get("input_contains"), f"{where}.input_contains"),
    )
    if not rule.prompt_contains and not rule.input_contains:
        raise ScriptError(f"{where}: give 'prompt_contains' and/or 'input_contains'")
    return rule


def _phrases(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(item, str) and item for item in items):
        raise ScriptError(f"{where}: must be a non-empty string or a list of them")
    return tuple(items)


_REPLY_KEYS = ("call", "calls", "text", "json", "refusal")


def _parse_turn(value: Any, where: str) -> Turn:
    value = _require_mapping(value, where)
    _reject_unknown_keys(value, {*_REPLY_KEYS, "fenced", "repeat", "delay_ms", "usage", "rate_limit"}, where)
    given = [key for key in _REPLY_KEYS if key in value]
    if len(given) != 1:
        raise ScriptError(f"{where}: a turn needs exactly one of {', '.join(_REPLY_KEYS)}")
    kind = given[0]
    if "fenced" in value and kind != "json":
        raise ScriptError(f"{where}: 'fenced' only applies to a 'json' answer")
    reply: Reply
    if kind == "call":
        reply = FunctionCallsReply((_parse_call(value["call"], f"{where}.call"),))
    elif kind == "calls":
        calls = value["calls"]
        if not isinstance(calls, list) or not calls:
            raise ScriptError(f"{where}.calls: must be a non-empty list")
        reply = FunctionCallsReply(
            tuple(_parse_call(call, f"{where}.calls[{i}]") for i, call in enumerate(calls))
        )
    elif kind == "text":
        if not isinstance(value["text"], str):
            raise ScriptError(f"{where}.text: must be a string")
        reply = TextReply(value["text"])
    elif kind == "refusal":
        if not isinstance(value["refusal"], str):
            raise ScriptError(f"{where}.refusal: must be a string")
        reply = RefusalReply(value["refusal"])
    else:
        _require_json_value(value["json"], f"{where}.json")
        reply = JsonReply(value["json"], fenced=_bool(value.get("fenced", False), f"{where}.fenced"))
    return Turn(
        reply=reply,
        repeat=_bool(value.get("repeat", False), f"{where}.repeat"),
        delay_ms=_non_negative_int(value.get("delay_ms", 0), f"{where}.delay_ms"),
        usage=_parse_usage(value.get("usage"), f"{where}.usage"),
        rate_limit=_parse_rate_limit(value.get("rate_limit"), f"{where}.rate_limit"),
    )


def _parse_rate_limit(value: Any, where: str) -> RateLimit | None:
    if value is None:
        return None
    value = _require_mapping(value, where)
    _reject_unknown_keys(value, {"retry_after_seconds", "times"}, where)
    seconds = value.get("retry_after_seconds")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0:
        raise ScriptError(f"{where}.retry_after_seconds: must be a non-negative number")
    times = _non_negative_int(value.get("times", 1), f"{where}.times")
    return RateLimit(retry_after_seconds=float(seconds), times=times)


def _parse_call(value: Any, where: str) -> ScriptedFunctionCall:
    value = _require_mapping(value, where)
    _reject_unknown_keys(value, {"name", "args"}, where)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise ScriptError(f"{where}: 'name' must be a non-empty string")
    args = value.get("args", {})
    if not isinstance(args, Mapping):
        raise ScriptError(f"{where}.args: must be a mapping")
    _require_json_value(args, f"{where}.args")
    return ScriptedFunctionCall(name=name, args=dict(args))


def _parse_usage(value: Any, where: str) -> UsageOverride:
    if value is None:
        return UsageOverride()
    value = _require_mapping(value, where)
    keys = ("prompt_tokens", "candidates_tokens", "cached_tokens", "reasoning_tokens")
    _reject_unknown_keys(value, set(keys), where)
    counts = {
        key: None if value.get(key) is None else _non_negative_int(value[key], f"{where}.{key}")
        for key in keys
    }
    return UsageOverride(**counts)


def _require_mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ScriptError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _reject_unknown_keys(value: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(str(key) for key in value if key not in allowed)
    if unknown:
        raise ScriptError(
            f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _require_json_value(value: Any, where: str) -> None:
    # YAML can produce dates and other non-JSON values; they would only fail later on the wire.
    try:
        json.dumps(value)
    except (TypeError, ValueError) as error:
        raise ScriptError(f"{where}: not representable as JSON ({error}); quote the value") from error


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ScriptError(f"{where}: must be true or false")
    return value


def _non_negative_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScriptError(f"{where}: must be a non-negative integer")
    return value
