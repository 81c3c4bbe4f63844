"""Declarative settings: a service's environment variables as one pydantic-settings model.

Each field names its variable (`variable(...)`), its type, its default and a description; the
model validates them all at start-up, and `describe` lists them for the program's `--help`. A bad
value stops the service with one line naming the variable and what it accepts, never a traceback:
`SettingsError` carries that line.

Empty (or blank) variables count as unset, as they always have for Abada's services.
"""

from __future__ import annotations

import contextvars
import os
import textwrap
from collections.abc import Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Self, Union, get_args, get_origin

from annotated_types import Ge, Le
from pydantic import AliasChoices, BeforeValidator, Field, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonDict
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict


def _upper(value: Any) -> Any:
    return value.upper() if isinstance(value, str) else value


# ABADA_LOG_LEVEL, in any case.
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], BeforeValidator(_upper)]

# The environment `from_env` reads: os.environ, or the mapping a test or a caller hands in.
_environ: contextvars.ContextVar[Mapping[str, str]] = contextvars.ContextVar("abada_settings_environ")


class SettingsError(ValueError):
    """A setting's value is unusable; the message is one line naming the variable."""


def variable(
    name: str, default: Any, description: str, *, accepts: str = "", also: str = "", **constraints: Any
) -> Any:
    """A field read from the environment variable `name` (else `also`, another program's name for it);
    `accepts` words what a bad value should be."""
    extra: JsonDict | None = {"accepts": accepts} if accepts else None
    return Field(
        default,
        validation_alias=AliasChoices(name, also) if also else name,
        description=description,
        json_schema_extra=extra,
        **constraints,
    )


class _Environ(EnvSettingsSource):
    """The environment source over `_environ`, values stripped and blank ones left out."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # Outside `from_env` (a model built in code) the process's own environment is read.
        return {key: value.strip() for key, value in _environ.get(os.environ).items() if value.strip()}


class ServiceSettings(BaseSettings):
    """A service's settings; subclasses declare one field per variable with `variable(...)`."""

    model_config = SettingsConfigDict(
        case_sensitive=True, frozen=True, extra="ignore", validate_by_name=True, validate_by_alias=True
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Arguments given in code win over the environment; no .env files, no secrets directory.
        return (init_settings, _Environ(settings_cls))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Self:
        """The settings from `environ` (default: os.environ); `overrides` (flags) win over it."""
        token = _environ.set(dict(os.environ if environ is None else environ))
        try:
            return cls(**{key: value for key, value in overrides.items() if value is not None})
        except ValidationError as error:
            raise SettingsError(_one_line(cls, error)) from None
        finally:
            _environ.reset(token)

    @classmethod
    def variables(cls) -> dict[str, FieldInfo]:
        """Every variable the model reads, by name (fields that no variable sets are left out)."""
        return {
            _name_of(name, info): info for name, info in cls.model_fields.items() if info.validation_alias
        }

    @classmethod
    def describe(cls, width: int = 100) -> str:
        """The variables for `--help`: name, type and default, then the description."""
        lines = ["environment variables:"]
        for name, info in cls.variables().items():
            also = _also(info)
            lines.append(
                f"  {name}{f' (or {also})' if also else ''} ({_accepted(info)}; default: {_default(info)})"
            )
            lines.extend(
                textwrap.wrap(
                    info.description or "", width, initial_indent=" " * 6, subsequent_indent=" " * 6
                )
            )
        return "\n".join(lines)


def _name_of(field_name: str, info: FieldInfo) -> str:
    alias = info.validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return alias if isinstance(alias, str) else field_name


def _also(info: FieldInfo) -> str:
    alias = info.validation_alias
    return str(alias.choices[1]) if isinstance(alias, AliasChoices) and len(alias.choices) > 1 else ""


def _shown(value: Any) -> str:
    text = str(value)
    return repr(text if len(text) <= 40 else text[:40] + "…")


def _one_line(model: type[ServiceSettings], error: ValidationError) -> str:
    """The first problem, as `VARIABLE must be …, not 'value'`."""
    problem = error.errors(include_url=False)[0]
    location = str(problem["loc"][0]) if problem["loc"] else ""
    # The location is the variable's name for a value from the environment, the field's for an override.
    info = model.variables().get(location) or model.model_fields.get(location)
    name = _name_of(location, info) if info is not None else location
    if info is None or problem["type"] in ("value_error", "assertion_error"):
        # A check across settings (a model validator) words its own message.
        return str(problem["msg"]).removeprefix("Value error, ")
    # What the user wrote, before any validator touched it (the log level is upper-cased, say).
    written = _environ.get(os.environ).get(name, "").strip() or problem.get("input")
    if isinstance(written, SecretStr) or (
        info.annotation is not None and "SecretStr" in str(info.annotation)
    ):
        return f"{name} must be {_accepted(info)}"
    return f"{name} must be {_accepted(info)}, not {_shown(written)}"


def _accepted(info: FieldInfo) -> str:
    """What a variable takes, in words: its own `accepts`, else from its type and bounds."""
    extra = info.json_schema_extra
    if isinstance(extra, dict) and extra.get("accepts"):
        return str(extra["accepts"])
    annotation = info.annotation
    if get_origin(annotation) in (Union, UnionType):  # `X | None`: the X
        annotation = next(arg for arg in get_args(annotation) if arg is not type(None))
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(str(arg) for arg in get_args(annotation))
    low = next((bound.ge for bound in info.metadata if isinstance(bound, Ge)), None)
    high = next((bound.le for bound in info.metadata if isinstance(bound, Le)), None)
    if annotation is int and low is not None and high is not None:
        return f"a whole number from {low} to {high}"
    words = {int: "a whole number", float: "a number", bool: "1 or 0", Path: "a file path"}
    return words.get(annotation, "text") if isinstance(annotation, type) else "text"


def _default(info: FieldInfo) -> str:
    if info.default is None:
        return "unset"
    if isinstance(info.default, bool):
        return "1" if info.default else "0"
    return str(info.default)
