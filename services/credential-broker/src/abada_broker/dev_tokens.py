"""``abada-broker dev-tokens``: a callers file and the matching plaintext tokens for a local setup."""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from .auth import ENGINE, WORKER, callers_document, parse_callers

CALLERS_FILE = "broker-callers.yaml"
WORKER_TOKEN_FILE = "worker-token"
ENGINE_TOKEN_FILE = "engine-token"
DEFAULT_WORKER_IDENTITY = "agent-pool"
DEFAULT_ENGINE_IDENTITY = "abada-engine"


@dataclass(frozen=True)
class DevTokens:
    callers_file: Path
    worker_token_file: Path
    engine_token_file: Path
    worker_identity: str
    engine_identity: str

    def describe(self) -> str:
        return "\n".join(
            [
                f"wrote the broker's callers file (hashed tokens): {self.callers_file}",
                f"  broker:  ABADA_BROKER_AUTH_TOKENS_FILE={self.callers_file}",
                f"wrote the worker pool's token ({self.worker_identity!r}, role worker): {self.worker_token_file}",
                f"  workers: ABADA_WORKER_TOKEN_FILE={self.worker_token_file}"
                f"  (worker ids {self.worker_identity} or {self.worker_identity}/<name>)",
                f"wrote the engine's token ({self.engine_identity!r}, role engine): {self.engine_token_file}",
                f"  engine:  ABADA_BROKER_TOKEN_FILE={self.engine_token_file}",
            ]
        )


class DevTokensExist(Exception):
    """The output directory already holds tokens; overwriting them would lock out running processes."""


def _write_private(path: Path, content: str) -> None:
    """Write ``content`` readable by the owner only, atomically (a reader never sees half a file)."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(descriptor, 0o600)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(content)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_dev_tokens(
    out_dir: Path,
    *,
    worker_identity: str = DEFAULT_WORKER_IDENTITY,
    engine_identity: str = DEFAULT_ENGINE_IDENTITY,
    overwrite: bool = False,
) -> DevTokens:
    out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    written = DevTokens(
        callers_file=out_dir / CALLERS_FILE,
        worker_token_file=out_dir / WORKER_TOKEN_FILE,
        engine_token_file=out_dir / ENGINE_TOKEN_FILE,
        worker_identity=worker_identity,
        engine_identity=engine_identity,
    )
    targets = (written.callers_file, written.worker_token_file, written.engine_token_file)
    existing = [str(path) for path in targets if path.exists()]
    if existing and not overwrite:
        raise DevTokensExist(f"already there: {', '.join(existing)} (pass --force to replace them)")
    worker_token = secrets.token_urlsafe(32)
    engine_token = secrets.token_urlsafe(32)
    document = callers_document(
        [(worker_identity, [WORKER], worker_token), (engine_identity, [ENGINE], engine_token)]
    )
    parse_callers(document, "dev-tokens")  # refuses identities the broker would not accept
    header = "# Written by `abada-broker dev-tokens`: SHA-256 digests only; the tokens are in the files beside it.\n"
    _write_private(written.worker_token_file, worker_token + "\n")
    _write_private(written.engine_token_file, engine_token + "\n")
    _write_private(written.callers_file, header + yaml.safe_dump(document, sort_keys=False))
    return written
