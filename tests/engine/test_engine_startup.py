"""Starting the engine: no silent development secrets against a real database; a broken callers edit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
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
    registry = CallerRegistry(path, recheck_seconds=0)  # look at the file on every call
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


def test_the_callers_file_is_looked_at_no_more_than_once_a_second(tmp_path):
    path = tmp_path / "callers.yaml"

    def callers(identity: str, token: str) -> str:
        return yaml.safe_dump(
            {"callers": [{"identity": identity, "roles": ["operator"], "token_sha256": token_sha256(token)}]}
        )

    path.write_text(callers("ops", "first-token"))
    registry = CallerRegistry(path, recheck_seconds=3600)
    assert registry.by_token("first-token").identity == "ops"
    path.write_text(callers("ops2", "second-token"))
    os.utime(path, ns=(1, 1))
    assert registry.by_token("first-token").identity == "ops"  # not looked at again yet
    soon = CallerRegistry(path, recheck_seconds=0.05)
    path.write_text(callers("ops3", "third-token"))
    os.utime(path, ns=(2, 2))
    deadline = time.monotonic() + 5
    while soon.by_token("third-token") is None:
        assert time.monotonic() < deadline, "the change was never picked up"
        time.sleep(0.01)
    assert soon.by_token("third-token").identity == "ops3"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("ABADA_DB_POOL_SIZE", "abc"),
        ("ABADA_LOG_LEVEL", "verbose"),
        ("ABADA_DEPLOY_MCP_TIMEOUT_SECONDS", "ten"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable(tmp_path, name, value):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
    env.update({"ABADA_STATE_DIR": str(tmp_path), name: value})
    done = subprocess.run(
        [sys.executable, "-m", "abada_engine.main", "serve"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert name in lines[0] and repr(value) in lines[0]
    assert "Traceback" not in done.stderr


def _unreachable_start(tmp_path, url: str, command: str = "serve") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ABADA_")}
    env.update(ABADA_DATABASE_URL=url, ABADA_DEVELOPMENT="1", ABADA_STATE_DIR=str(tmp_path))
    return subprocess.run(
        [sys.executable, "-m", "abada_engine.main", command],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("command", ["serve", "migrate"])
def test_a_database_that_refuses_connections_is_one_line_with_the_fix(tmp_path, command):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]  # nothing listens once the socket is closed
    done = _unreachable_start(tmp_path, f"postgresql://abada:s3cret@127.0.0.1:{closed_port}/abada", command)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"abada-engine: cannot use the database at ABADA_DATABASE_URL=postgresql://abada:***@127.0.0.1:"
        f"{closed_port}/abada (host 127.0.0.1:{closed_port}): connection refused (is PostgreSQL running "
        "there, on that port?)"
    )
    assert "s3cret" not in done.stdout + done.stderr


def test_a_database_that_does_not_exist_is_one_line_naming_it(tmp_path):
    server = os.environ.get("ABADA_TEST_DATABASE_URL")
    if not server:
        pytest.skip("needs ABADA_TEST_DATABASE_URL: a server to ask for a database it does not have")
    missing = server.rsplit("/", 1)[0] + "/abada_no_such_database"
    done = _unreachable_start(tmp_path, missing)
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("abada-engine: cannot use the database at ABADA_DATABASE_URL=")
    assert 'the database does not exist (database "abada_no_such_database" does not exist)' in line
