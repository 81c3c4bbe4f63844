"""Engine settings, read from the environment (documented in the README).

A bad value stops the engine with one line naming the variable and what it accepts, never a
traceback: `SettingsError` carries that line and `main` prints it.
"""

from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass

EXTRA_PROCESS = "ABADA_ENGINE_EXTRA_PROCESS"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class SettingsError(ValueError):
    """A setting's value is unusable; the message names the variable."""


@dataclass(frozen=True)
class EngineSettings:
    database_url: str | None
    grpc_address: str
    http_address: str
    state_dir: pathlib.Path
    log_level: str
    db_pool_size: int
    # Engine processes serving one gRPC port (SO_REUSEPORT): one per core on a bigger machine.
    processes: int = 1
    # Set in the extra processes the first one starts: they serve gRPC only.
    extra_process: bool = False
    deploy_mcp_timeout_seconds: float = 10.0

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> EngineSettings:
        env = dict(os.environ if env is None else env)
        return EngineSettings(
            database_url=env.get("ABADA_DATABASE_URL") or None,
            grpc_address=env.get("ABADA_GRPC_ADDRESS", "127.0.0.1:50051"),
            http_address=env.get("ABADA_HTTP_ADDRESS", "127.0.0.1:8080"),
            state_dir=pathlib.Path(env.get("ABADA_STATE_DIR", ".abada")),
            log_level=_log_level(env, "ABADA_LOG_LEVEL", "INFO"),
            db_pool_size=_whole_number(env, "ABADA_DB_POOL_SIZE", 20, low=1, high=1_000),
            processes=_whole_number(env, "ABADA_ENGINE_PROCESSES", 1, low=1, high=256),
            extra_process=env.get(EXTRA_PROCESS) == "1",
            deploy_mcp_timeout_seconds=_seconds(env, "ABADA_DEPLOY_MCP_TIMEOUT_SECONDS", 10.0),
        )


def _raw(env: dict[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _shown(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:40] + "…")


def _whole_number(env: dict[str, str], name: str, default: int, *, low: int, high: int) -> int:
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(
            f"{name} must be a whole number from {low} to {high}, not {_shown(raw)}"
        ) from None
    if not low <= value <= high:
        raise SettingsError(f"{name} must be a whole number from {low} to {high}, not {value}")
    return value


def _seconds(env: dict[str, str], name: str, default: float) -> float:
    raw = _raw(env, name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(
            f"{name} must be a number of seconds (e.g. 10 or 2.5), not {_shown(raw)}"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise SettingsError(f"{name} must be a positive number of seconds, not {_shown(raw)}")
    return value


def _log_level(env: dict[str, str], name: str, default: str) -> str:
    raw = _raw(env, name)
    if raw is None:
        return default
    if raw.upper() not in LOG_LEVELS:
        raise SettingsError(f"{name} must be one of {', '.join(LOG_LEVELS)}, not {_shown(raw)}")
    return raw.upper()
