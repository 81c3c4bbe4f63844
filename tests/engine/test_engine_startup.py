"""Starting the engine: no silent development secrets against a real database; a broken callers edit."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml
from abada_engine.auth import CallerRegistry, token_sha256


def test_a_real_database_without_shared_secrets_refuses_to_start(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
    env.update(ABADA_DATABASE_URL="postgresql://nobody@127.0.0.1:1/none", ABADA_STATE_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "abada_engine.main", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    for name in ("ABADA_JOURNAL_KEYS", "ABADA_IDEMPOTENCY_SECRET", "ABADA_AUTH_TOKENS_FILE"):
        assert name in done.stderr
    assert not (tmp_path / "journal-keys").exists()  # nothing was generated


def test_a_broken_edit_of_the_callers_file_keeps_the_last_good_list(tmp_path):
    path = tmp_path / "callers.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "callers": [
                    {"identity": "ops", "roles": ["operator"], "token_sha256": token_sha256("good-token")}
                ]
            }
        )
    )
    registry = CallerRegistry(path)
    assert registry.by_token("good-token").identity == "ops"
    path.write_text("callers: [ {identity: ops, roles: [operator], token_sha256: ")  # half-written
    os.utime(path, ns=(1, 1))
    assert registry.by_token("good-token").identity == "ops"
    path.write_text(
        yaml.safe_dump(
            {
                "callers": [
                    {"identity": "ops2", "roles": ["operator"], "token_sha256": token_sha256("new-token")}
                ]
            }
        )
    )
    assert registry.by_token("new-token").identity == "ops2"
    assert registry.by_token("good-token") is None
