"""How answers are printed: a table or card for people, or the engine's answer as JSON or YAML."""

from __future__ import annotations

import enum
from typing import Any

import typer
import yaml
from google.protobuf.message import Message

from .render import message_dict, to_json


class OutputFormat(enum.StrEnum):
    table = "table"
    json = "json"
    yaml = "yaml"


def data_of(payload: Message | dict[str, Any]) -> Any:
    return message_dict(payload) if isinstance(payload, Message) else payload


def emit(output: OutputFormat, payload: Message | dict[str, Any], human: str) -> None:
    if output is OutputFormat.json:
        typer.echo(to_json(data_of(payload)))
    elif output is OutputFormat.yaml:
        typer.echo(yaml.safe_dump(data_of(payload), sort_keys=False, allow_unicode=True).rstrip("\n"))
    else:
        typer.echo(human)
