"""Who is who in a local stack: one set of callers the engine, the broker and the workers agree on.

The engine's development callers (`auth.write_dev_callers`: dev-operator, dev-approver, dev-worker
with every topic, dev-broker) are the base. The broker accepts the same dev-worker token, so an
agent worker is one identity at both, and the engine reaches the broker with a token of its own.
Everything is written once and kept, so a restarted stack is the same stack.
"""

from __future__ import annotations

import pathlib
import secrets
from dataclasses import dataclass

import yaml

from ..auth import token_sha256, write_dev_callers
from ..private_files import write_private

WORKER_IDENTITY = "dev-worker"
BROKER_IDENTITY_AT_ENGINE = "dev-broker"
ENGINE_IDENTITY_AT_BROKER = "abada-engine"
CRM_SECRET_NAME = "crm-token"


@dataclass(frozen=True)
class DevIdentities:
    directory: pathlib.Path
    engine_callers: pathlib.Path
    broker_callers: pathlib.Path
    secrets_file: pathlib.Path  # the broker's file backend: name -> value

    @property
    def operator_token_file(self) -> pathlib.Path:
        return self.directory / "operator.token"

    @property
    def approver_token_file(self) -> pathlib.Path:
        return self.directory / "approver.token"

    @property
    def worker_token_file(self) -> pathlib.Path:
        """dev-worker's: worker ids `dev-worker/NAME`, every topic, accepted by the broker too."""
        return self.directory / "worker.token"

    @property
    def broker_token_file(self) -> pathlib.Path:
        """What the broker sends the engine (VerifyLease)."""
        return self.directory / "broker.token"

    @property
    def engine_token_file(self) -> pathlib.Path:
        """What the engine sends the broker (deploy-time tool credentials)."""
        return self.directory / "engine-to-broker.token"

    def token(self, path: pathlib.Path) -> str:
        return path.read_text().strip()

    def crm_token(self) -> str:
        return str(yaml.safe_load(self.secrets_file.read_text())[CRM_SECRET_NAME])


def dev_identities(directory: pathlib.Path) -> DevIdentities:
    """The callers and tokens in `directory`, written the first time and read every time after."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    identities = DevIdentities(
        directory=directory,
        engine_callers=write_dev_callers(directory),
        broker_callers=directory / "broker-callers.yaml",
        secrets_file=directory / "secrets.yaml",
    )
    if not identities.engine_token_file.exists():
        write_private(identities.engine_token_file, secrets.token_urlsafe(32) + "\n")
    if not identities.secrets_file.exists():
        write_private(identities.secrets_file, yaml.safe_dump({CRM_SECRET_NAME: secrets.token_urlsafe(24)}))
    worker = identities.token(identities.worker_token_file)
    engine = identities.token(identities.engine_token_file)
    document = {
        "callers": [
            {"identity": WORKER_IDENTITY, "roles": ["worker"], "token_sha256": token_sha256(worker)},
            {
                "identity": ENGINE_IDENTITY_AT_BROKER,
                "roles": ["engine"],
                "token_sha256": token_sha256(engine),
            },
        ]
    }
    write_private(identities.broker_callers, yaml.safe_dump(document, sort_keys=False))
    return identities
