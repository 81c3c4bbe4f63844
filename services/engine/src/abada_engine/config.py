"""Engine settings, read from the environment (documented in the README)."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

EXTRA_PROCESS = "ABADA_ENGINE_EXTRA_PROCESS"


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

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> EngineSettings:
        env = dict(os.environ if env is None else env)
        return EngineSettings(
            database_url=env.get("ABADA_DATABASE_URL") or None,
            grpc_address=env.get("ABADA_GRPC_ADDRESS", "127.0.0.1:50051"),
            http_address=env.get("ABADA_HTTP_ADDRESS", "127.0.0.1:8080"),
            state_dir=pathlib.Path(env.get("ABADA_STATE_DIR", ".abada")),
            log_level=env.get("ABADA_LOG_LEVEL", "INFO"),
            db_pool_size=int(env.get("ABADA_DB_POOL_SIZE", "20")),
            processes=max(1, int(env.get("ABADA_ENGINE_PROCESSES", "1"))),
            extra_process=env.get(EXTRA_PROCESS) == "1",
        )
